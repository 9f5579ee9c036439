"""How long the stack keeps its logs, the log groups AWS services create for it included."""

from __future__ import annotations

from aws_cdk import CfnResource, Stack
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from constructs import Construct

# The stack's operational logs: its functions', the VPC flow logs, and the log
# groups the EKS control plane and the SageMaker endpoint write. (The API's
# access logs, an audit trail of who called, keep a year.)
LOG_RETENTION = logs.RetentionDays.ONE_MONTH

# aws-cdk-lib's construct id, at the stack's root, of the one function that
# every LogRetention of a stack shares (cdk/nag.py acknowledges its role).
RETENTION_FUNCTION_ID = "LogRetentionaae0aa3c5b4d4f87b02d85b201efdd8a"


def expire_service_log_group(scope: Construct, id: str, *, log_group_name: str) -> logs.LogRetention:
    """Give a log group that an AWS service creates itself the stack's retention.

    EKS (control-plane logging) and SageMaker (an endpoint's container logs)
    create their groups with no retention: every line kept forever. A
    logs.LogGroup of the same name cannot take such a group over: its create
    fails with "already exists" on every stack whose cluster or endpoint has
    already written a line, and the names are CloudFormation-generated, known
    only once the cluster or endpoint exists, by which time the service has
    written its first lines. LogRetention is a custom resource whose function
    sets the retention of the group whether or not it exists yet (creating it
    if it does not), so it works on new and already-deployed stacks alike. Its
    cost: one function per stack, shared by every LogRetention of the stack,
    whose role cdk/nag.py acknowledges. On stack deletion the group is kept (the
    default removal policy), to expire on its own.
    """
    return logs.LogRetention(scope, id, log_group_name=log_group_name, retention=LOG_RETENTION)


def expire_function_log_groups(stack: Stack) -> None:
    """Give the stack's retention to the log group of every function that names
    none: Lambda creates `/aws/lambda/<name>` at its first invocation, with no
    retention. Sluice's own functions name a logs.LogGroup (cdk/functions.py);
    aws-cdk-lib's do not (the kubectl provider's handler and its framework
    function, CfnUtils' provider). Called once the stack's constructs exist."""
    for resource in stack.node.find_all():
        if not isinstance(resource, CfnResource) or resource.cfn_resource_type != "AWS::Lambda::Function":
            continue
        if RETENTION_FUNCTION_ID in resource.node.path.split("/"):
            continue  # it sets its own group's retention when it runs
        if isinstance(resource, lambda_.CfnFunction) and _names_log_group(stack, resource):
            continue
        expire_service_log_group(resource.node.scope, f"{resource.node.id}LogRetention",
                                 log_group_name=f"/aws/lambda/{resource.ref}")


def _names_log_group(stack: Stack, function: lambda_.CfnFunction) -> bool:
    # Resolved, a LoggingConfig is keyed as the L1's struct is: logGroup.
    return bool((stack.resolve(function.logging_config) or {}).get("logGroup"))
