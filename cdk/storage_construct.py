"""Tasks table, API keys table and the payload/result bucket."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

from cdk.config import SluiceConfig
from sluice.contract import INPUTS_PREFIX, RESULTS_PREFIX, payload_ttl_days


class Storage(Construct):
    def __init__(self, scope: Construct, id: str, *, config: SluiceConfig) -> None:
        super().__init__(scope, id)

        self.tasks = self._durable_table("Tasks", "task_id", time_to_live_attribute="expires_at")
        # Hashed keys for the `table` auth mode (embedded/on-prem, or a private
        # deployment without API Gateway keys); the AWS API authenticates with
        # API Gateway keys and never reads it, so nothing here is granted on it.
        self.keys = self._durable_table("ApiKeys", "key_hash")

        self.access_logs = s3.Bucket(
            self,
            "AccessLogs",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(90))],
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.bucket = s3.Bucket(
            self,
            "Payloads",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=False,
            server_access_logs_bucket=self.access_logs,
            server_access_logs_prefix="payloads/",
            # Per prefix (sluice.contract.payload_ttl_days): results for the
            # finished record's TTL, inputs while their task may still run.
            lifecycle_rules=[
                s3.LifecycleRule(
                    prefix=prefix,
                    expiration=Duration.days(payload_ttl_days(prefix, config.result_ttl_days)),
                    abort_incomplete_multipart_upload_after=Duration.days(1),
                )
                for prefix in (INPUTS_PREFIX, RESULTS_PREFIX)
            ],
            removal_policy=RemovalPolicy.RETAIN,
        )

    # ------------------------------------------------------------ grants
    # Explicit action lists (cdk.access) instead of grantReadWriteData() and
    # friends, whose s3:GetObject*-style wildcards cover far more than we call.
    def grant_tasks(self, grantee: iam.IGrantable, actions: list[str]) -> None:
        iam.Grant.add_to_principal(grantee=grantee, actions=actions, resource_arns=[self.tasks.table_arn])

    def grant_inputs(self, grantee: iam.IGrantable, actions: list[str]) -> None:
        iam.Grant.add_to_principal(grantee=grantee, actions=actions,
                                   resource_arns=[self.bucket.arn_for_objects(f"{INPUTS_PREFIX}*")])

    def grant_results(self, grantee: iam.IGrantable, actions: list[str]) -> None:
        iam.Grant.add_to_principal(grantee=grantee, actions=actions,
                                   resource_arns=[self.bucket.arn_for_objects(f"{RESULTS_PREFIX}*")])

    def grant_bucket(self, grantee: iam.IGrantable, actions: list[str]) -> None:
        iam.Grant.add_to_principal(grantee=grantee, actions=actions, resource_arns=[self.bucket.bucket_arn])

    def _durable_table(self, id: str, key: str, **extra) -> dynamodb.Table:
        """On-demand, encrypted, point-in-time recovery, kept on stack deletion."""
        return dynamodb.Table(
            self,
            id,
            partition_key=dynamodb.Attribute(name=key, type=dynamodb.AttributeType.STRING),
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            encryption=dynamodb.TableEncryption.AWS_MANAGED,
            deletion_protection=True,
            removal_policy=RemovalPolicy.RETAIN,
            **extra,
        )
