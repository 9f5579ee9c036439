"""Which SQS clients a PriorityQueues builds, and when.

A client costs 50-150 ms of CPU to build (boto3 loads SQS's service model per
session). The API, the settler and the dispatcher send, and their Lambdas build
their PriorityQueues during the cold start: the receive's long-poll client
must wait for a receive. Building a client makes no call, so no emulator is
needed here."""

from __future__ import annotations

import uuid

from sluice import aws
from sluice.adapters.queues import PriorityQueues
from sluice.settings import Settings


def _long_poll_clients(region: str) -> list[tuple]:
    return [key for key in aws._clients if key[0] == "sqs" and key[3] == region and key[4]]


def test_the_long_poll_client_is_built_by_the_first_receive_not_before(monkeypatch):
    # A region of its own: the client cache is shared by the whole test session.
    region = f"test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("AWS_REGION", region)
    queues = PriorityQueues(Settings())
    assert _long_poll_clients(region) == []
    poller = queues.poller
    assert _long_poll_clients(region) != [] and queues.poller is poller
    assert poller.meta.config.read_timeout > queues.sqs.meta.config.read_timeout  # it waits out a long poll
