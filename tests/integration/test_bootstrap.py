"""Resource creation for the embedded and on-prem profiles, on the emulator."""

import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest
from botocore.client import BaseClient
from botocore.exceptions import ClientError
from fastapi.testclient import TestClient

from sluice.adapters.api_keys import ApiKeys
from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.api.app import create_app
from sluice.bootstrap import ensure_bucket, ensure_queues, ensure_resources
from sluice.contract import MAX_DEADLINE_S, Priority, TaskMessage, now_ms
from sluice.lifecycle import Job, Outcome, plan_outcomes, record_outcomes
from sluice.settings import Settings, SettingsError

# The ceilings of SLUICE_INLINE_PAYLOAD_MAX_BYTES and SLUICE_INLINE_RESULT_MAX_BYTES (sluice/settings.py).
INLINE_PAYLOAD_LIMIT_BYTES = 100 * 1024
INLINE_RESULT_LIMIT_BYTES = 300_000


def fresh(settings: Settings, **update) -> Settings:
    """The same settings naming queues, tables and a bucket that do not exist yet."""
    tag = uuid.uuid4().hex[:8]
    return settings.model_copy(update={"queue_prefix": f"f{tag}", "tasks_table": f"f{tag}-tasks",
                                       "keys_table": f"f{tag}-keys", "bucket": f"f{tag}-payloads", **update})


def made(settings: Settings, region: str = "us-east-1") -> None:
    """Every queue, both tables and the bucket are there."""
    sqs = boto3.client("sqs", region_name=region)
    for p in Priority:
        for dlq in (False, True):
            sqs.get_queue_url(QueueName=settings.queue_name(p, dlq=dlq))
    ddb = boto3.client("dynamodb", region_name=region)
    for table in (settings.tasks_table, settings.keys_table):
        assert ddb.describe_table(TableName=table)["Table"]["TableStatus"] == "ACTIVE"
    boto3.client("s3", region_name=region).head_bucket(Bucket=settings.bucket)


def max_receive_counts(settings: Settings) -> set[int]:
    sqs = boto3.client("sqs")
    counts = set()
    for p in Priority:
        url = sqs.get_queue_url(QueueName=settings.queue_name(p))["QueueUrl"]
        policy = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])["Attributes"]
        counts.add(int(json.loads(policy["RedrivePolicy"])["maxReceiveCount"]))
    return counts


def test_each_queue_dead_letters_after_max_attempts_receives_even_when_it_changes(settings):
    # A task's last attempt releases its message for the next receive to dead-letter it.
    assert max_receive_counts(settings) == {settings.max_attempts}
    five = settings.model_copy(update={"max_attempts": 5})
    ensure_queues(five)  # queues that exist already take the new setting
    assert max_receive_counts(five) == {5}


def test_every_queue_keeps_a_message_longer_than_any_deadline(settings):
    # SQS deletes an expired message unseen: it never reaches a DLQ or settling.
    sqs = boto3.client("sqs")
    for p in Priority:
        for dlq in (False, True):
            url = sqs.get_queue_url(QueueName=settings.queue_name(p, dlq=dlq))["QueueUrl"]
            kept = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["MessageRetentionPeriod"])["Attributes"]
            assert int(kept["MessageRetentionPeriod"]) == 14 * 24 * 3600 > MAX_DEADLINE_S


@pytest.mark.parametrize("bad", [0, 1001])
def test_max_attempts_outside_what_a_redrive_policy_takes_is_refused(bad):
    with pytest.raises(SettingsError, match="SLUICE_MAX_ATTEMPTS"):
        Settings(max_attempts=bad)


def expiry(settings: Settings) -> dict[str, tuple[int, str]]:
    rules = boto3.client("s3").get_bucket_lifecycle_configuration(Bucket=settings.bucket)["Rules"]
    return {rule["Filter"].get("Prefix", ""): (rule.get("Expiration", {}).get("Days"), rule["Status"]) for rule in rules}


def test_stored_payloads_expire_after_result_ttl_days_as_on_aws(settings):
    # As the CDK bucket (cdk/storage_construct.py): results after result_ttl_days;
    # inputs not before their task's message can no longer run (14 days in SQS).
    assert expiry(settings) == {"inputs/": (14, "Enabled"), "results/": (7, "Enabled")}
    s3 = boto3.client("s3")
    # An operator's own rule on a shared bucket survives; ours follow the setting.
    current = s3.get_bucket_lifecycle_configuration(Bucket=settings.bucket)["Rules"]
    operator = {"ID": "operator-logs", "Filter": {"Prefix": "logs/"}, "Status": "Enabled", "Expiration": {"Days": 30}}
    s3.put_bucket_lifecycle_configuration(Bucket=settings.bucket, LifecycleConfiguration={"Rules": [*current, operator]})
    three = settings.model_copy(update={"result_ttl_days": 3})
    ensure_bucket(three)
    ensure_bucket(three)  # idempotent: no rule twice
    assert expiry(settings) == {"inputs/": (14, "Enabled"), "results/": (3, "Enabled"), "logs/": (30, "Enabled")}
    ensure_bucket(settings.model_copy(update={"result_ttl_days": 30}))
    assert expiry(settings) == {"inputs/": (30, "Enabled"), "results/": (30, "Enabled"), "logs/": (30, "Enabled")}


def test_a_store_without_lifecycle_support_only_warns(settings, monkeypatch, caplog):
    real = BaseClient._make_api_call

    def refusing(client, operation, params):
        if operation == "PutBucketLifecycleConfiguration":
            raise ClientError({"Error": {"Code": "NotImplemented", "Message": "not supported"}}, operation)
        return real(client, operation, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", refusing)
    with caplog.at_level(logging.WARNING, logger="sluice.bootstrap"):
        ensure_resources(settings.model_copy(update={"result_ttl_days": 2}))
    assert "NotImplemented" in caplog.text and "will not expire" in caplog.text


def test_a_dlq_made_before_with_other_attributes_takes_ours_and_bootstrap_goes_on(moto_endpoint):
    # An earlier release's DLQ, or one an operator made: creating it again with
    # other attributes is refused, which once stopped bootstrap before the tables and bucket.
    settings = fresh(Settings(models="synthetic"))
    sqs = boto3.client("sqs")
    sqs.create_queue(QueueName=settings.queue_name(Priority.high, dlq=True),
                     Attributes={"MessageRetentionPeriod": "3600"})
    urls = ensure_resources(settings)
    kept = sqs.get_queue_attributes(QueueUrl=urls["high-dlq"], AttributeNames=["MessageRetentionPeriod"])
    assert int(kept["Attributes"]["MessageRetentionPeriod"]) == 14 * 24 * 3600
    made(settings)
    assert ensure_resources(settings) == urls  # and again, all there


def test_bootstrap_makes_the_bucket_outside_us_east_1(moto_endpoint, monkeypatch):
    # S3 refuses a bucket without a LocationConstraint anywhere but us-east-1:
    # bootstrap once stopped there, after making the queues and tables.
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    settings = fresh(Settings(models="synthetic"), region="eu-west-1")
    ensure_resources(settings)
    made(settings, "eu-west-1")
    s3 = boto3.client("s3", region_name="eu-west-1")
    assert s3.get_bucket_location(Bucket=settings.bucket)["LocationConstraint"] == "eu-west-1"
    ensure_resources(settings)  # and again


def test_ten_messages_at_the_inline_inputs_ceiling_go_in_one_batch(settings):
    # The API sends ten messages to a SendMessageBatch, and SQS takes 1 MiB a
    # batch: SLUICE_INLINE_PAYLOAD_MAX_BYTES at its ceiling still fits them.
    at_ceiling = settings.model_copy(update={"inline_payload_max_bytes": INLINE_PAYLOAD_LIMIT_BYTES,
                                             "max_body_bytes": 4 * 1024 * 1024})
    inputs = ["a" * 8000] * 13
    inputs[-1] = "a" * (len(inputs[-1]) - (len(json.dumps(inputs)) - INLINE_PAYLOAD_LIMIT_BYTES))
    assert len(json.dumps(inputs).encode()) == INLINE_PAYLOAD_LIMIT_BYTES  # what the API measures: inline
    key = ApiKeys(settings).create("t" * 64)[0]  # the longest tenant id, in every message
    api = TestClient(create_app(at_ceiling), raise_server_exceptions=False)
    tasks = [{"model": "synthetic", "inputs": inputs, "priority": "low", "deadline_s": MAX_DEADLINE_S,
              "metadata": {"k": "v"}} for _ in range(10)]
    reply = api.post("/v1/tasks/batch", json={"tasks": tasks}, headers={"x-api-key": key})
    assert reply.status_code == 202, reply.text[:300]
    received = []
    queues = PriorityQueues(settings)
    while len(received) < 10:
        got = queues.receive(Priority.low, 10, 1, 30)
        assert got, f"{len(received)} of the 10 messages came back"
        received += got
    assert all(TaskMessage.model_validate_json(m.body).inputs == inputs for m in received)


def test_a_result_at_the_inline_ceiling_fits_its_record_beside_the_largest_metadata(api, settings):
    # A DynamoDB item holds 400 KB: a result inline at SLUICE_INLINE_RESULT_MAX_BYTES's
    # ceiling must still leave room for the rest of the record.
    at_ceiling = settings.model_copy(update={"inline_result_max_bytes": INLINE_RESULT_LIMIT_BYTES})
    wide = "\U0001d11e"  # four bytes in UTF-8
    metadata = {f"{i:02d}{wide * 62}": wide * 256 for i in range(16)}
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["x"], "metadata": metadata},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    (delivery,) = PriorityQueues(settings).receive(Priority.normal, 10, 1, 30)
    result = {"r": "b" * (INLINE_RESULT_LIMIT_BYTES - len('{"r":""}'))}
    plan = plan_outcomes([Outcome(Job(delivery.task(), [delivery]), result=result)], now_ms(), at_ceiling)
    assert not plan.uploads  # inline, at the ceiling exactly
    with ThreadPoolExecutor(2) as pool:
        applied = record_outcomes(TaskStore(settings), PayloadStore(settings), plan, pool)
    assert not applied.rejected and not applied.errored
    record = TaskStore(settings).get(task_id)
    assert record.status.value == "succeeded" and len(record.result_json.encode()) == INLINE_RESULT_LIMIT_BYTES
    assert record.metadata == metadata
    # moto does not hold an update to DynamoDB's limit: measure the item as DynamoDB does.
    item = boto3.client("dynamodb").get_item(TableName=settings.tasks_table, Key={"task_id": {"S": task_id}})["Item"]
    assert item_bytes(item) + 1000 * 4 <= 400 * 1024  # and an error message (up to 1,000 characters) beside it


def item_bytes(attributes: dict) -> int:
    """A DynamoDB item's size by DynamoDB's rules: names and strings in UTF-8, a
    number at most 21 bytes, a map or list 3 bytes and 1 per element on top."""
    def size(value: dict) -> int:
        (kind, v), = value.items()
        if kind == "S":
            return len(v.encode())
        if kind == "N":
            return 21
        if kind in ("BOOL", "NULL"):
            return 1
        if kind == "M":
            return 3 + sum(len(k.encode()) + size(e) + 1 for k, e in v.items())
        if kind == "L":
            return 3 + sum(size(e) + 1 for e in v)
        raise AssertionError(f"no size rule for {kind}")
    return sum(len(name.encode()) + size(value) for name, value in attributes.items())


def _queue_settings(settings: Settings) -> tuple[int, int]:
    sqs = boto3.client("sqs")
    url = sqs.get_queue_url(QueueName=settings.queue_name(Priority.normal))["QueueUrl"]
    got = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["VisibilityTimeout", "RedrivePolicy"])["Attributes"]
    return int(got["VisibilityTimeout"]), int(json.loads(got["RedrivePolicy"])["maxReceiveCount"])


def test_an_operator_s_bootstrap_leaves_live_settings_alone_unless_told(moto_endpoint, monkeypatch, capsys):
    # Run from a shell without the deployment's settings, `sluice bootstrap`
    # once set Settings' defaults on live queues and expired results sooner.
    from sluice import cli

    deployed = fresh(Settings(models="synthetic"), visibility_timeout_s=300, max_attempts=5, result_ttl_days=30)
    ensure_resources(deployed)
    for name in ("queue_prefix", "tasks_table", "keys_table", "bucket"):
        monkeypatch.setenv(f"SLUICE_{name.upper()}", getattr(deployed, name))
    assert cli.main(["bootstrap"]) == 0
    assert _queue_settings(deployed) == (300, 5)
    assert expiry(deployed)["results/"] == (30, "Enabled")
    said = capsys.readouterr().err
    normal = deployed.queue_name(Priority.normal)
    assert f"queue {normal}: VisibilityTimeout 300 -> 60 (SLUICE_VISIBILITY_TIMEOUT_S)" in said
    assert f"queue {normal}: RedrivePolicy maxReceiveCount 5 -> maxReceiveCount 3 (SLUICE_MAX_ATTEMPTS)" in said
    assert "results/ expire after 30 -> 7 days (SLUICE_RESULT_TTL_DAYS)" in said
    assert "--apply-settings" in said
    # Told to, as compose's init service is, with the deployment's settings.
    assert cli.main(["bootstrap", "--apply-settings"]) == 0
    assert _queue_settings(deployed) == (60, 3)
    assert expiry(deployed)["results/"] == (7, "Enabled")
    assert cli.main(["bootstrap"]) == 0
    assert capsys.readouterr().err.count("differs") == 0  # nothing left to tell
