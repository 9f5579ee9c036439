"""Resource creation for the embedded and on-prem profiles, on the emulator."""

import json

import boto3
import pytest
from pydantic import ValidationError

from sluice.bootstrap import ensure_queues
from sluice.contract import Priority
from sluice.settings import Settings


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


@pytest.mark.parametrize("bad", [0, 1001])
def test_max_attempts_outside_what_a_redrive_policy_takes_is_refused(bad):
    with pytest.raises(ValidationError, match="max_attempts"):
        Settings(max_attempts=bad)
