"""The Sluice stack: storage, queues, API, one worker backend, observability."""

from __future__ import annotations

from pathlib import Path

from aws_cdk import CfnOutput, Stack
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_ecr_assets as ecr_assets
from constructs import Construct

from cdk import nag
from cdk.api_construct import Api
from cdk.config import SluiceConfig
from cdk.functions import LambdaCode
from cdk.log_retention import expire_function_log_groups
from cdk.observability_construct import MINUTE, Observability
from cdk.queues_construct import Queues
from cdk.storage_construct import Storage
from cdk.workers_eks_construct import EksWorkers
from cdk.workers_sagemaker_construct import VARIANT, SageMakerWorkers

# Never part of the worker image's build context (on top of .dockerignore), so
# that the image asset's hash, and a rebuild, follow only what the image uses.
# README.md stays: pip reads it while installing the project from pyproject.toml.
IMAGE_EXCLUDES = [
    ".git", ".venv", ".venv-*", "cdk.out", "build", ".sluice", ".pytest_cache",
    "**/__pycache__", "*.pyc", "tests", "bench", "docs", "cdk", "lambdas",
    "app.py", "cdk.json", "Makefile", ".gitignore",
]


class SluiceStack(Stack):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: SluiceConfig,
        root: Path,
        layer_dir: Path,
        code_dir: Path,
        **kwargs,
    ) -> None:
        super().__init__(scope, id, **kwargs)
        backend = config.backend
        self.config = config

        storage = Storage(self, "Storage", config=config)
        queues = Queues(self, "Queues", config=config)
        code = LambdaCode(self, "LambdaCode", layer_dir=layer_dir, code_dir=code_dir)
        api = Api(self, "Api", config=config, code=code, storage=storage, queues=queues)
        image = ecr_assets.DockerImageAsset(
            self,
            "WorkerImage",
            directory=str((root / config.image_directory).resolve()),
            file=config.image_file,
            platform=ecr_assets.Platform.LINUX_AMD64,
            exclude=IMAGE_EXCLUDES,
        )

        functions = {"api": api.handler.function}
        scheduled = {}  # run on a schedule: no caller sees them fail, so each alarms on its errors
        if backend == "eks":
            workers = EksWorkers(self, "Workers", config=config, image=image, storage=storage, queues=queues)
            gpu_metrics = [
                cw.Metric(
                    namespace="ContainerInsights",
                    metric_name="node_gpu_utilization",
                    dimensions_map={"ClusterName": workers.cluster.cluster_name},
                    statistic="Average",
                    period=MINUTE,
                    label="node GPU % (Container Insights)",
                )
            ]
            endpoint = None
            CfnOutput(self, "ClusterName", value=workers.cluster.cluster_name)
        else:
            workers = SageMakerWorkers(
                self, "Workers", config=config, image=image, code=code, storage=storage, queues=queues
            )
            functions["dispatcher"] = workers.dispatcher.function
            scheduled["settler"] = workers.settler.function
            dims = {"EndpointName": workers.endpoint_name, "VariantName": VARIANT}
            gpu_metrics = [
                cw.Metric(
                    namespace="/aws/sagemaker/Endpoints",
                    metric_name=name,
                    dimensions_map=dims,
                    statistic="Average",
                    period=MINUTE,
                    label=f"endpoint {name} (%)",
                )
                for name in ("GPUUtilization", "GPUMemoryUtilization")
            ]
            endpoint = dims
            CfnOutput(self, "EndpointName", value=workers.endpoint_name)
        self.workers = workers

        self.observability = Observability(
            self,
            "Observability",
            config=config,
            queues=queues,
            api=api,
            functions=functions,
            scheduled=scheduled,
            gpu_metrics=gpu_metrics,
            # Only a worker process with torch reports GPU figures: not the dispatcher Lambda.
            worker_gpu=backend == "eks",
            endpoint=endpoint,
            dashboard_name=f"{id}-{self.region}",  # dashboard names are account-wide
        )

        CfnOutput(self, "ApiUrl", value=api.api.url)
        for plan in api.usage_plans:
            CfnOutput(self, f"UsagePlan{plan.node.id}", value=plan.usage_plan_id)
        CfnOutput(self, "TasksTable", value=storage.tasks.table_name)
        CfnOutput(self, "Bucket", value=storage.bucket.bucket_name)
        for p, q in queues.queues.items():
            CfnOutput(self, f"Queue{p.title()}", value=q.queue_url)
        CfnOutput(self, "AlarmTopic", value=self.observability.topic.topic_arn)

        expire_function_log_groups(self)
        nag.suppress(self)
