"""Python Lambda functions built from the locally bundled layer and code."""

from __future__ import annotations

from pathlib import Path

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from constructs import Construct

from cdk.log_retention import LOG_RETENTION
from sluice.worker.metrics import NAMESPACE as METRICS_NAMESPACE

RUNTIME = lambda_.Runtime.PYTHON_3_14  # must match cdk.bundling.LAMBDA_PYTHON


class LambdaCode(Construct):
    """One layer (third-party packages) and one code asset, shared by every function."""

    def __init__(self, scope: Construct, id: str, *, layer_dir: Path, code_dir: Path) -> None:
        super().__init__(scope, id)
        self.layer = lambda_.LayerVersion(
            self,
            "Dependencies",
            code=lambda_.Code.from_asset(str(layer_dir / "layer.zip")),
            compatible_runtimes=[RUNTIME],
            compatible_architectures=[lambda_.Architecture.X86_64],
            description="Sluice API/dispatcher dependencies (no torch)",
        )
        self.code = lambda_.Code.from_asset(str(code_dir))


class PythonFunction(Construct):
    """A function with its own log group and a role that may write only to it.

    The role is explicit so that no AWS managed policy (with its account-wide
    log permissions) is attached.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        code: LambdaCode,
        handler: str,
        environment: dict[str, str],
        timeout: Duration,
        memory_mb: int,
        description: str,
        reserved_concurrency: int | None = None,
    ) -> None:
        super().__init__(scope, id)
        self.log_group = logs.LogGroup(
            self, "Logs", retention=LOG_RETENTION, removal_policy=RemovalPolicy.DESTROY
        )
        self.role = iam.Role(self, "Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"))
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                resources=[self.log_group.log_group_arn],
            )
        )
        self.function = lambda_.Function(
            self,
            "Function",
            runtime=RUNTIME,
            architecture=lambda_.Architecture.X86_64,
            handler=handler,
            code=code.code,
            layers=[code.layer],
            role=self.role,
            environment={
                "POWERTOOLS_METRICS_NAMESPACE": METRICS_NAMESPACE,
                "SLUICE_REGION": Stack.of(self).region,
                **environment,
            },
            timeout=timeout,
            memory_size=memory_mb,
            reserved_concurrent_executions=reserved_concurrency,
            tracing=lambda_.Tracing.ACTIVE,
            log_group=self.log_group,
            logging_format=lambda_.LoggingFormat.JSON,
            description=description,
        )
