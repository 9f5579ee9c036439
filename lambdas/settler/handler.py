"""Dead-letter settler for the SageMaker backend, run on a schedule.

On EKS every worker settles dead-lettered tasks in a thread (sluice.dlq); the
SageMaker backend has no worker process, so this function does the same round:
a task whose message was dead-lettered without an outcome is failed or requeued.
"""

from __future__ import annotations

import time

from aws_lambda_powertools import Logger
from aws_lambda_powertools.logging.utils import copy_config_to_registered_loggers

from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.contract import Priority
from sluice.dlq import settle_dead
from sluice.settings import Settings

logger = Logger(service="sluice-settler")
# Sluice's own modules log through logging.getLogger("sluice.*"): their lines get
# this logger's JSON and Lambda context (request id, correlation id) too.
copy_config_to_registered_loggers(source_logger=logger, include={"sluice"})
settings = Settings()
queues = PriorityQueues(settings)
store = TaskStore(settings)
# Kept while the execution environment is warm: final tasks' records are read once.
known_final: set[tuple[str, int]] = set()


# Of the function's time, what a round keeps for after its receives: hiding the
# dead letters it passed (up to 1000 a priority, ten a call) and showing again
# the ones it kept. A timeout would skip that, and the next round would start
# at the same head.
AFTER_RECEIVING_S = 20.0


@logger.inject_lambda_context
def handler(event, context) -> dict[str, int]:
    until = time.monotonic() + context.get_remaining_time_in_millis() / 1000 - AFTER_RECEIVING_S
    counts = settle_dead(queues, store, list(Priority), settings.max_attempts, known_final=known_final, until=until)
    logger.info("dead-lettered tasks settled", extra=counts)
    return counts
