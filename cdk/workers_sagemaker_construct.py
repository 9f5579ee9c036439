"""Workers on SageMaker: the worker image behind a real-time endpoint, fed by a
dispatcher Lambda that drains the priority queues in batches."""

from __future__ import annotations

import re

from aws_cdk import ArnFormat, Duration, Stack
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda_event_sources as sources
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from cdk import access
from cdk.config import PRIORITIES, SluiceConfig
from cdk.functions import LambdaCode, PythonFunction
from cdk.log_retention import expire_service_log_group
from cdk.queues_construct import Queues
from cdk.storage_construct import Storage

VARIANT = "AllTraffic"


class SageMakerWorkers(Construct):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: SluiceConfig,
        image: ecr_assets.DockerImageAsset,
        code: LambdaCode,
        storage: Storage,
        queues: Queues,
    ) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)

        role = iam.Role(self, "ExecutionRole", assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"))
        image.repository.grant_pull(role)
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[
                    stack.format_arn(
                        service="logs",
                        resource="log-group",
                        resource_name="/aws/sagemaker/Endpoints/*",
                        arn_format=ArnFormat.COLON_RESOURCE_NAME,
                    )
                ],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                # The container makes no AWS call (network isolation); the
                # dispatcher sends the Sluice metrics.
                conditions={"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/Endpoints"}},
            )
        )

        self.model = sagemaker.CfnModel(
            self,
            "Model",
            execution_role_arn=role.role_arn,
            primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
                image=image.image_uri,
                environment={
                    "SLUICE_MODELS": config.models,
                    "SLUICE_MAX_BATCH_SIZE": str(config.max_batch_size),
                    "SLUICE_DEVICE": "cuda",
                },
            ),
            # The container only answers /ping and /invocations: the dispatcher
            # does every table, queue and bucket call, so it needs no network.
            enable_network_isolation=True,
        )
        # The role's policy (ECR pull) must exist before SageMaker pulls the image,
        # not just the role its ARN points at.
        self.model.node.add_dependency(role)
        self.endpoint_config = sagemaker.CfnEndpointConfig(
            self,
            "EndpointConfig",
            production_variants=[
                sagemaker.CfnEndpointConfig.ProductionVariantProperty(
                    variant_name=VARIANT,
                    model_name=self.model.attr_model_name,
                    instance_type=config.sagemaker_instance_type,
                    initial_instance_count=config.min_instances,
                    initial_variant_weight=1,
                    container_startup_health_check_timeout_in_seconds=600,
                    inference_ami_version=config.sagemaker_inference_ami,
                )
            ],
        )
        # Named after the instance type: SageMaker refuses to update an endpoint
        # whose variant is an autoscaling target to another instance type, and
        # the stack's update would roll back. Another type makes a new endpoint
        # (and scaling target); the old one serves until CloudFormation removes it.
        # The default type keeps the ids stacks deployed before this had.
        per_instance_type = "" if config.sagemaker_instance_type == SluiceConfig.sagemaker_instance_type else "".join(
            part.capitalize() for part in re.split(r"[^A-Za-z0-9]+", config.sagemaker_instance_type))
        self.endpoint = sagemaker.CfnEndpoint(
            self,
            f"Endpoint{per_instance_type}",
            endpoint_config_name=self.endpoint_config.attr_endpoint_config_name,
            # An update (a new image, a changed setting) keeps the instance count
            # autoscaling reached, rather than dropping to min_instances under load.
            retain_all_variant_properties=True,
        )
        self.endpoint_name = self.endpoint.attr_endpoint_name
        # The container's stdout and stderr, where SageMaker puts them.
        expire_service_log_group(
            self, "EndpointLogRetention", log_group_name=f"/aws/sagemaker/Endpoints/{self.endpoint_name}"
        )

        target = appscaling.ScalableTarget(
            self,
            f"Scaling{per_instance_type}",
            service_namespace=appscaling.ServiceNamespace.SAGEMAKER,
            resource_id=f"endpoint/{self.endpoint_name}/variant/{VARIANT}",
            scalable_dimension="sagemaker:variant:DesiredInstanceCount",
            min_capacity=config.min_instances,
            max_capacity=config.max_instances,
        )
        # On calls held at once, not invocations per minute: serve.py runs one
        # call per model at a time, so an instance whose calls take longer than
        # 60 s / target never reaches an InvocationsPerInstance target, and the
        # endpoint never scaled out however long the queues grew.
        # ConcurrentRequestsPerModel counts the calls waiting in the container
        # as well as the one running, every 10 s (SluiceConfig's
        # concurrent_requests_per_instance says why its default is 2).
        target.scale_to_track_metric(
            "ConcurrentRequestsPerModel",
            target_value=config.concurrent_requests_per_instance,
            predefined_metric=appscaling.PredefinedMetric.SAGEMAKER_VARIANT_CONCURRENT_REQUESTS_PER_MODEL_HIGH_RESOLUTION,
            scale_in_cooldown=Duration.minutes(5),
            scale_out_cooldown=Duration.minutes(1),
        )

        self.dispatcher = PythonFunction(
            self,
            "Dispatcher",
            code=code,
            handler="lambdas.dispatcher.handler.handler",
            description="Sluice dispatcher: SQS batches -> SageMaker endpoint -> task table",
            timeout=Duration.seconds(config.dispatcher_timeout_s),
            memory_mb=512,
            # As many as its event sources may run at once: never throttled (SluiceConfig).
            reserved_concurrency=config.dispatcher_reserved_concurrency,
            environment={
                "SLUICE_SAGEMAKER_ENDPOINT": self.endpoint_name,
                "SLUICE_INVOKE_TIMEOUT_S": str(min(60, config.longest_batch_s)),
                # A batch splits into at most one call per task; all of them run
                # at once, so the batch takes one call's time, within the timeout.
                "SLUICE_DISPATCH_CONCURRENCY": str(config.dispatcher_batch_size),
                "SLUICE_TASKS_TABLE": storage.tasks.table_name,
                "SLUICE_BUCKET": storage.bucket.bucket_name,
                **config.lifecycle_env,
                "SLUICE_MODELS": config.models,
                # Its metrics' deployment dimension, as the dashboard reads them.
                "SLUICE_QUEUE_PREFIX": config.name_prefix,
                **queues.env(),
            },
        )
        fn = self.dispatcher.function
        queues.grant_dlqs(fn, access.DEAD_LETTER_DLQS)
        storage.grant_tasks(fn, access.WORKER_TASKS)
        storage.grant_inputs(fn, access.WORKER_INPUTS)
        storage.grant_results(fn, access.WORKER_RESULTS)
        storage.grant_bucket(fn, access.WORKER_BUCKET)
        fn.add_to_role_policy(iam.PolicyStatement(actions=["sagemaker:InvokeEndpoint"], resources=[self.endpoint.ref]))
        for priority in PRIORITIES:
            # The event source grants exactly ReceiveMessage, DeleteMessage,
            # ChangeMessageVisibility, GetQueueAttributes, GetQueueUrl on its queue.
            fn.add_event_source(
                sources.SqsEventSource(
                    queues.queues[priority],
                    batch_size=config.dispatcher_batch_size,
                    max_batching_window=Duration.seconds(config.dispatcher_batching_window_s),
                    max_concurrency=config.dispatcher_max_concurrency[priority],
                    report_batch_item_failures=True,
                )
            )

        # No worker process runs on this backend, so a scheduled function
        # settles the tasks whose messages were dead-lettered without an
        # outcome (a dispatcher timed out or died on each of their receives).
        self.settler = PythonFunction(
            self,
            "Settler",
            code=code,
            handler="lambdas.settler.handler.handler",
            description="Sluice settler: dead-lettered tasks without an outcome are failed or requeued",
            timeout=Duration.seconds(60),
            memory_mb=256,
            environment={
                "SLUICE_TASKS_TABLE": storage.tasks.table_name,
                **config.lifecycle_env,
                "SLUICE_QUEUE_PREFIX": config.name_prefix,
                **queues.env(),
            },
        )
        settler = self.settler.function
        storage.grant_tasks(settler, access.SETTLE_TASKS)
        queues.grant(settler, access.SETTLE_QUEUES)
        queues.grant_dlqs(settler, access.SETTLE_DLQS)
        events.Rule(
            self,
            "SettleSchedule",
            schedule=events.Schedule.rate(Duration.minutes(1)),
            targets=[targets.LambdaFunction(settler, retry_attempts=0)],
        )
