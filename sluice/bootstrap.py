"""Create the queues, tables and bucket if they are missing (embedded and on-prem
profiles; on AWS the CDK stack owns them). Safe to run any number of times, and
by several processes at once (the on-prem API and workers run it as they start).

Queues and a bucket that exist already are given this process's settings (a
visibility timeout, max attempts, the results' expiry) where `apply` is true,
as the containers do when they start with the deployment's settings. An
operator's `sluice bootstrap` passes False unless told otherwise: run from a
shell without the deployment's settings, it would set Settings' defaults on
live queues (and expire stored results sooner). The differences go to
`changes` either way, each as one line."""

from __future__ import annotations

import json
import logging

from botocore.exceptions import ClientError

from sluice.aws import client
from sluice.contract import INPUTS_PREFIX, MESSAGE_RETENTION_S, RESULTS_PREFIX, Priority, payload_ttl_days
from sluice.settings import Settings

log = logging.getLogger("sluice.bootstrap")


def ensure_resources(settings: Settings, apply: bool = True, changes: list[str] | None = None) -> dict[str, str]:
    urls = ensure_queues(settings, apply, changes)
    ensure_tables(settings)
    ensure_bucket(settings, apply, changes)
    return urls


def ensure_resources_on_start(settings: Settings) -> None:
    """The on-prem containers' first step when SLUICE_BOOTSTRAP_ON_START=1 (set by
    onprem/compose.yaml and onprem/k8s/onprem/config.yaml). LocalStack keeps
    everything in memory, and after a host reboot Docker restarts the containers
    without the compose `init` step (or LocalStack's pod restarts, and a worker
    whose queue stays missing exits): the API and the workers then create what
    is missing themselves. A failure
    ends the process, and its restart policy tries again. Elsewhere (AWS, where
    the stack owns the resources and the roles may not create them) it does nothing.
    Its callers have refused bad settings first, each in its own line."""
    if not settings.bootstrap_on_start:
        return
    ensure_resources(settings)
    log.info("queues, tables and bucket are in place")


def ensure_queues(settings: Settings, apply: bool = True, changes: list[str] | None = None) -> dict[str, str]:
    sqs = client("sqs", settings)
    changes = [] if changes is None else changes
    urls: dict[str, str] = {}
    for priority in Priority:
        dlq_url = _ensure_queue(sqs, settings.queue_name(priority, dlq=True),
                                {"MessageRetentionPeriod": str(MESSAGE_RETENTION_S)}, apply, changes)
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        # A task's last attempt ends with its message released, and that
        # message's next receive must move it to the DLQ: the queue's
        # maxReceiveCount is max_attempts (as in the CDK stack).
        attributes = {
            "MessageRetentionPeriod": str(MESSAGE_RETENTION_S),
            "VisibilityTimeout": str(settings.visibility_timeout_s),
            "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(settings.max_attempts)}),
        }
        urls[priority.value] = _ensure_queue(sqs, settings.queue_name(priority), attributes, apply, changes)
        urls[f"{priority.value}-dlq"] = dlq_url
    return urls


# Where each queue attribute comes from, for an operator reading a difference.
_FROM = {"VisibilityTimeout": "SLUICE_VISIBILITY_TIMEOUT_S", "RedrivePolicy": "SLUICE_MAX_ATTEMPTS",
         "MessageRetentionPeriod": "fixed: 14 days"}


def _comparable(name: str, value: str | None):
    if name == "RedrivePolicy" and value:
        policy = json.loads(value)
        return policy.get("deadLetterTargetArn"), int(policy.get("maxReceiveCount", 0))
    return value


def _shown(name: str, value: str | None) -> str | None:
    if name == "RedrivePolicy":
        return f"maxReceiveCount {_comparable(name, value)[1]}" if value else "none"
    return value


_QUEUE_EXISTS = ("QueueAlreadyExists", "QueueNameExists", "AWS.SimpleQueueService.QueueNameExists")


def _ensure_queue(sqs, name: str, attributes: dict[str, str], apply: bool, changes: list[str]) -> str:
    """The queue's URL, created with these attributes or (`apply`) given them."""
    try:
        return sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    except ClientError as err:
        # AWS and moto say QueueAlreadyExists, LocalStack QueueNameExists, fauxqs
        # (make run's SQS) the old Query API's AWS.SimpleQueueService.QueueNameExists.
        if err.response["Error"]["Code"] not in _QUEUE_EXISTS:
            raise
    # Created before with other settings (a persistent on-prem LocalStack, an
    # earlier release): a DLQ as much as a queue, or bootstrap would stop half-way.
    url = sqs.get_queue_url(QueueName=name)["QueueUrl"]
    current = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=list(attributes)).get("Attributes", {})
    differ = {k: v for k, v in attributes.items() if _comparable(k, current.get(k)) != _comparable(k, v)}
    for key, value in differ.items():
        changes.append(f"queue {name}: {key} {_shown(key, current.get(key))} -> {_shown(key, value)} ({_FROM[key]})")
    if differ and apply:
        sqs.set_queue_attributes(QueueUrl=url, Attributes=differ)
    return url


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
        except ClientError as err:
            if err.response["Error"]["Code"] != "ResourceInUseException":
                raise
        # Also when another process created it a moment ago: its TTL is set next.
        ddb.get_waiter("table_exists").wait(TableName=table, WaiterConfig={"Delay": 0.2, "MaxAttempts": 50})
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


# What Sluice writes, by prefix (sluice/adapters/payload_store.py). The rules
# name these prefixes only: an existing bucket may hold other objects.
PAYLOAD_PREFIXES = (INPUTS_PREFIX, RESULTS_PREFIX)


def ensure_bucket(settings: Settings, apply: bool = True, changes: list[str] | None = None) -> None:
    s3 = client("s3", settings)
    try:
        s3.head_bucket(Bucket=settings.bucket)
    except ClientError:
        # Outside us-east-1 S3 refuses a bucket without its region named (on
        # the endpoint of a region, it must name that one: the client's).
        region = s3.meta.region_name
        where = {"CreateBucketConfiguration": {"LocationConstraint": region}} if region != "us-east-1" else {}
        try:
            s3.create_bucket(Bucket=settings.bucket, **where)
        except ClientError as err:
            if err.response["Error"]["Code"] != "BucketAlreadyOwnedByYou":  # another process made it meanwhile
                raise
    ensure_lifecycle(s3, settings, apply, [] if changes is None else changes)


def lifecycle_rules(settings: Settings) -> list[dict]:
    """Per prefix, as in the CDK stack (sluice.contract.payload_ttl_days)."""
    return [
        {
            "ID": f"sluice-expire-{prefix.rstrip('/')}",
            "Filter": {"Prefix": prefix},
            "Status": "Enabled",
            "Expiration": {"Days": payload_ttl_days(prefix, settings.result_ttl_days)},
            # No AbortIncompleteMultipartUpload, unlike the CDK rule: Sluice makes
            # no multipart uploads, and MinIO refuses or drops that element.
        }
        for prefix in PAYLOAD_PREFIXES
    ]


def ensure_lifecycle(s3, settings: Settings, apply: bool = True, changes: list[str] | None = None) -> None:
    """Sluice's expiry rules on the bucket, keeping any other rule it has. A store
    without lifecycle support gets a warning, not a failed bootstrap: Sluice runs
    the same without it, only its payloads are never deleted. A rule of ours
    that is missing is always added; one that differs is replaced where `apply`."""
    ours = lifecycle_rules(settings)
    changes = [] if changes is None else changes
    try:
        try:
            existing = s3.get_bucket_lifecycle_configuration(Bucket=settings.bucket)["Rules"]
        except ClientError as err:
            if err.response["Error"]["Code"] != "NoSuchLifecycleConfiguration":
                raise
            existing = []
        kept = [rule for rule in existing if rule.get("ID") not in {r["ID"] for r in ours}]
        if all(rule in existing for rule in ours):
            return
        by_id = {rule.get("ID"): rule for rule in existing}
        for rule in ours:
            was = by_id.get(rule["ID"])
            if was is not None and _expiry(was) != _expiry(rule):
                changes.append(f"bucket {settings.bucket}: {rule['Filter']['Prefix']} expire after "
                               f"{_expiry(was)[0]} -> {rule['Expiration']['Days']} days (SLUICE_RESULT_TTL_DAYS)")
        if not apply:
            if all(rule["ID"] in by_id for rule in ours):
                return
            ours = [by_id.get(rule["ID"], rule) for rule in ours]  # only the missing ones added
        s3.put_bucket_lifecycle_configuration(Bucket=settings.bucket, LifecycleConfiguration={"Rules": kept + ours})
    except ClientError as err:
        error = err.response.get("Error", {})
        log.warning("bucket %s: could not set its lifecycle rules (%s: %s); stored inputs and results "
                    "will not expire (results after %d days, inputs after %d), delete them from the store yourself",
                    settings.bucket, error.get("Code"), error.get("Message"), settings.result_ttl_days,
                    payload_ttl_days(INPUTS_PREFIX, settings.result_ttl_days))


def _expiry(rule: dict) -> tuple:
    return rule.get("Expiration", {}).get("Days"), rule.get("Status")
