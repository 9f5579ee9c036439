"""Create the queues, tables and bucket if they are missing (embedded and on-prem
profiles; on AWS the CDK stack owns them). Safe to run any number of times."""

from __future__ import annotations

import json

from botocore.exceptions import ClientError

from sluice.aws import client
from sluice.contract import Priority
from sluice.settings import Settings


def ensure_resources(settings: Settings) -> dict[str, str]:
    urls = ensure_queues(settings)
    ensure_tables(settings)
    ensure_bucket(settings)
    return urls


def ensure_queues(settings: Settings) -> dict[str, str]:
    sqs = client("sqs", settings)
    urls: dict[str, str] = {}
    for priority in Priority:
        dlq_url = sqs.create_queue(
            QueueName=settings.queue_name(priority, dlq=True),
            Attributes={"MessageRetentionPeriod": str(14 * 24 * 3600)},
        )["QueueUrl"]
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        # A task's last attempt ends with its message released, and that
        # message's next receive must move it to the DLQ: the queue's
        # maxReceiveCount is max_attempts (as in the CDK stack).
        attributes = {
            "VisibilityTimeout": str(settings.visibility_timeout_s),
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(settings.max_attempts)}),
        }
        name = settings.queue_name(priority)
        try:
            url = sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
        except ClientError as err:
            # AWS and moto say QueueAlreadyExists, LocalStack QueueNameExists.
            if err.response["Error"]["Code"] not in ("QueueAlreadyExists", "QueueNameExists"):
                raise
            # Created before with other settings (a persistent on-prem LocalStack).
            url = sqs.get_queue_url(QueueName=name)["QueueUrl"]
            sqs.set_queue_attributes(QueueUrl=url, Attributes=attributes)
        urls[priority.value] = url
        urls[f"{priority.value}-dlq"] = dlq_url
    return urls


def ensure_tables(settings: Settings) -> None:
    ddb = client("dynamodb", settings)
    for table, key in ((settings.tasks_table, "task_id"), (settings.keys_table, "key_hash")):
        try:
            ddb.create_table(
                TableName=table,
                AttributeDefinitions=[{"AttributeName": key, "AttributeType": "S"}],
                KeySchema=[{"AttributeName": key, "KeyType": "HASH"}],
                BillingMode="PAY_PER_REQUEST",
            )
            ddb.get_waiter("table_exists").wait(TableName=table, WaiterConfig={"Delay": 0.2, "MaxAttempts": 50})
        except ClientError as err:
            if err.response["Error"]["Code"] != "ResourceInUseException":
                raise
    try:
        ddb.update_time_to_live(
            TableName=settings.tasks_table,
            TimeToLiveSpecification={"Enabled": True, "AttributeName": "expires_at"},
        )
    except ClientError as err:
        # dynalite (the embedded profile's DynamoDB) has no TTL API; expiry is
        # DynamoDB's own background job in any case, never run by an emulator.
        if "already enabled" not in str(err).lower() and err.response["Error"]["Code"] != "UnknownOperationException":
            raise


def ensure_bucket(settings: Settings) -> None:
    s3 = client("s3", settings)
    try:
        s3.head_bucket(Bucket=settings.bucket)
    except ClientError:
        s3.create_bucket(Bucket=settings.bucket)
