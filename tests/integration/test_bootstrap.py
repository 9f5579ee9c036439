"""Resource creation for the embedded and on-prem profiles, on the emulator."""

import json

import logging

import boto3
import pytest
from botocore.client import BaseClient
from botocore.exceptions import ClientError

from sluice.bootstrap import ensure_bucket, ensure_queues, ensure_resources
from sluice.contract import MAX_DEADLINE_S, Priority
from sluice.settings import Settings, SettingsError


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
