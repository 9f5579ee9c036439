"""SageMaker dispatcher: SQS event source -> Dispatcher -> partial batch response.

The batch is dispatched as a whole (claims read and written together, endpoint
calls in parallel); Powertools' BatchProcessor then reports each message that
must be retried in batchItemFailures, so Lambda deletes only the finished ones.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import boto3
from aws_lambda_powertools import Logger, Tracer
from aws_lambda_powertools.logging.utils import copy_config_to_registered_loggers
from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord
from botocore.config import Config

from lambdas.dispatcher.dispatch import Delivery, Dispatcher
from sluice.adapters.queues import Received
from sluice.contract import Priority
from sluice.settings import Settings
from sluice.worker.metrics import WorkerMetrics

logger = Logger(service="sluice-dispatcher")
# Sluice's own modules log through logging.getLogger("sluice.*"): their lines get
# this logger's JSON and Lambda context (request id, correlation id) too.
copy_config_to_registered_loggers(source_logger=logger, include={"sluice"})
tracer = Tracer(service="sluice-dispatcher")
processor = BatchProcessor(event_type=EventType.SQS, raise_on_entire_batch_failure=False)

_dispatcher: Dispatcher | None = None


class RetryLater(Exception):
    """Raised for a message SQS must deliver again."""


def dispatcher() -> Dispatcher:
    """Built on first use, so one container reuses its clients across invocations."""
    global _dispatcher
    if _dispatcher is None:
        timeout = int(os.environ.get("SLUICE_INVOKE_TIMEOUT_S", "60"))
        runtime = boto3.session.Session().client(
            "sagemaker-runtime",
            # One try: SQS redelivery is the retry. A second try of a timed-out
            # invocation would outlast the function's own timeout.
            # total_max_attempts: botocore's max_attempts counts retries alone (1 made two calls).
            config=Config(read_timeout=timeout + 5, connect_timeout=5,
                          retries={"mode": "standard", "total_max_attempts": 1}),
        )
        settings = Settings()
        _dispatcher = Dispatcher(
            settings,
            os.environ["SLUICE_SAGEMAKER_ENDPOINT"],
            runtime,
            WorkerMetrics(settings=settings),
            concurrency=int(os.environ.get("SLUICE_DISPATCH_CONCURRENCY", "8")),
            give_up_s=timeout + 5,
        )
    return _dispatcher


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def handler(event, context):
    d = dispatcher()
    records = [SQSRecord(r) for r in event.get("Records", [])]
    retry = d.dispatch(
        [Delivery(r.message_id, r.body, int(r.attributes.approximate_receive_count or 1)) for r in records],
        time_left_s=lambda: context.get_remaining_time_in_millis() / 1000,
    )
    if d.metrics:
        d.metrics.flush()
    _back_off(d, records, retry)

    def record_handler(record: SQSRecord) -> None:
        reason = retry.get(record.message_id)
        if reason:
            raise RetryLater(reason)

    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)


def _back_off(d: Dispatcher, records: list[SQSRecord], retry: dict[str, str]) -> None:
    """Lambda's SQS trigger leaves a message it reports failed hidden for the
    rest of its visibility timeout (180 s on this stack): a retry would wait
    that long, three times the high queue's oldest-message alarm. It comes
    back as on the EKS worker instead: after 2^receives s, at most 30."""
    by_name = {d.settings.queue_name(p): p for p in Priority}
    by_delay: dict[int, list[Received]] = defaultdict(list)
    for r in records:
        if r.message_id not in retry:
            continue
        priority = by_name.get(r.event_source_arn.rsplit(":", 1)[-1])
        if priority is None:
            logger.warning("a retried message of %s, not a queue of SLUICE_QUEUE_PREFIX: it comes back after its "
                           "visibility timeout", r.event_source_arn)
        else:
            receives = int(r.attributes.approximate_receive_count or 1)
            by_delay[min(30, 2**receives)].append(
                Received(priority, r.message_id, r.receipt_handle, r.body, receives, time.monotonic()))
    for delay_s, messages in by_delay.items():
        try:
            d.queues.change_visibility_many(messages, delay_s)
        except Exception as exc:  # noqa: BLE001 - they come back after their visibility timeout all the same
            logger.warning("could not shorten the wait of %d retried messages: %s", len(messages), type(exc).__name__)
