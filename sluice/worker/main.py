"""The worker process: receivers -> prefetch buffer -> batch pipeline.

On SIGTERM it stops receiving, hands back the messages it had prefetched
(visibility 0) once its receives in flight have returned, finishes the batch
in inference and exits 0. It
stops the same way, exiting 1, once the model fails every task of several
batches in a row (sluice.isolation.BROKEN_AFTER), and exiting
EXIT_QUEUE_MISSING (75) once a queue it receives from has not existed for
Settings.queue_missing_exit_s, where a restart recreates it (SLUICE_BOOTSTRAP_ON_START:
an on-prem LocalStack restarted and lost its queues). Elsewhere (AWS, where SQS
also says "does not exist" to a role that may not use the queue) a restart
cannot help: it says so at ERROR and goes on trying. Other receive errors
(throttling, an endpoint that refuses connections) are retried for as long as
they last.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from botocore.exceptions import ClientError

from sluice.adapters.queues import PriorityQueues, Received
from sluice.bootstrap import ensure_resources_on_start
from sluice.contract import Priority
from sluice.dlq import settle_loop
from sluice.settings import Settings, SettingsError, log_level
from sluice.starting import stop_at_once_until_ready
from sluice.worker.batcher import PrefetchBuffer
from sluice.worker.metrics import WorkerMetrics
from sluice.worker.policy import WeightedPriorityPolicy
from sluice.worker.runner import UNCLAIM_ON_EXIT_S, BatchRunner, Pipeline, hand_back, run_within

log = logging.getLogger("sluice.worker")

# Settings.queue_missing_exit_s: how long a receiver goes on finding its queue
# missing, with no receive that worked in between, before the worker exits with
# this, so that its orchestrator restarts it.
EXIT_QUEUE_MISSING = 75  # EX_TEMPFAIL: a restart may well succeed
# How long a stopping worker waits, after its own hand-back, for stop()'s.
HAND_BACK_ON_EXIT_S = 15.0
# A queue that does not exist, as botocore reports it: the error's Code, and its
# QueryErrorCode (SQS's JSON protocol carries both; AWS, LocalStack and moto alike).
QUEUE_MISSING_CODES = frozenset({"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"})


def queue_missing(exc: BaseException) -> bool:
    """Whether a receive failed because its queue does not exist (not a throttle,
    not an endpoint that cannot be reached: those are retried for ever)."""
    if not isinstance(exc, ClientError):
        return False
    error = exc.response.get("Error", {})
    return bool(QUEUE_MISSING_CODES & {error.get("Code"), error.get("QueryErrorCode")})


class Worker:
    def __init__(self, settings: Settings, models: dict):
        self.settings = settings
        # Only where a restart recreates a missing queue does a missing queue end the worker.
        self.restart_recreates_queues = settings.bootstrap_on_start
        self.queues_missing = False  # run() then returns EXIT_QUEUE_MISSING
        self.queues = PriorityQueues(settings)
        self.policy = WeightedPriorityPolicy(settings.weights())
        # Prefetch about one batch (of inputs) per priority: enough to keep the model
        # busy, little enough that a flood of `low` cannot crowd out a later `high`.
        self.buffer = PrefetchBuffer(capacity_per_priority=max(10, settings.max_batch_size))
        self.metrics = WorkerMetrics(settings=settings)
        self.runner = BatchRunner(settings, models, self.metrics)
        self.stopping = threading.Event()
        self._done = threading.Event()
        self._held: dict[str, Received] = {}
        self._receivers: dict[Priority, threading.Thread] = {}
        self._handing_back: threading.Thread | None = None  # stop()'s hand-back of the buffer
        self._held_lock = threading.Lock()
        # Held by the heartbeat across its extension call, and taken by every
        # release: once a batch's messages are released, no extension of them
        # is in flight, so the batch's own visibility change (a retry's
        # backoff, 0 for the DLQ or a hand-back) is the last one to land.
        self._extending = threading.Lock()
        self.pipeline = Pipeline(self.runner, self._take_batch, self._release, self._give_back, on_broken=self.stop)
        self.exit = os._exit  # the watchdog's way out (a test stands in for it)

    # ----------------------------------------------------------- receiving
    def _receive_loop(self, priority: Priority) -> None:
        backoff = 0.2
        missing_since: float | None = None  # the first of the receives in a row that found the queue missing
        while not self.stopping.is_set():
            room = self.buffer.room(priority)
            if room <= 0:
                self.buffer.wait_for_room(priority, 0.5)
                continue
            try:
                messages = self.queues.receive(
                    priority, room, self.settings.receive_wait_s, self.settings.visibility_timeout_s
                )
                backoff = 0.2
                missing_since = None
            except Exception as exc:
                if queue_missing(exc):
                    now = time.monotonic()
                    missing_since = now if missing_since is None else missing_since
                    if now - missing_since >= self.settings.queue_missing_exit_s:
                        if self.restart_recreates_queues:
                            self._queue_gone(priority, now - missing_since, exc)
                            return
                        log.error("receives from the %s queue have found it missing, or not this role's to use, "
                                  "for %.0f s (%s): create it (`sluice bootstrap`, or the CDK stack on AWS), grant "
                                  "this role sqs:ReceiveMessage on it, or correct SLUICE_QUEUE_URL_%s / "
                                  "SLUICE_QUEUE_PREFIX; still trying", priority.value, now - missing_since, exc,
                                  priority.value.upper())
                        missing_since = now  # said once a window, not at every retry
                log.warning("receive from %s failed (%s); retrying in %.1fs", priority.value, exc, backoff)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            with self._held_lock:
                for m in messages:
                    self._held[m.receipt_handle] = m
            if self.stopping.is_set():
                self._give_back(messages)
                return
            self.buffer.put(messages)

    def _queue_gone(self, priority: Priority, for_s: float, exc: Exception) -> None:
        # Retrying cannot bring a queue back: the restart's bootstrap recreates it.
        log.error("receives from the %s queue have found it missing for %.0f s (%s): exiting %d so that the "
                  "worker is restarted and its bootstrap (SLUICE_BOOTSTRAP_ON_START) recreates the queues",
                  priority.value, for_s, exc, EXIT_QUEUE_MISSING)
        self.queues_missing = True
        self.stop()

    def _take_batch(self) -> list[Received]:
        if self.stopping.is_set():
            self.pipeline.stopping.set()
            return []
        return self.buffer.take_batch(
            self.policy,
            max_inputs=self.settings.max_batch_size,
            max_wait_s=self.settings.max_wait_ms / 1000,
            idle_wait_s=0.5,
        )

    def _release(self, messages: list[Received]) -> None:
        with self._extending, self._held_lock:
            for m in messages:
                self._held.pop(m.receipt_handle, None)

    def _give_back(self, messages: list[Received], delay_s: int = 0) -> None:
        if not messages:
            return
        if self.stopping.is_set():
            self._wait_for_receives({m.priority for m in messages})
        self._release(messages)  # first, so that no extension lands after the hand-back
        hand_back(self.queues, messages, delay_s)

    def _wait_for_receives(self, priorities: set[Priority]) -> None:
        """A stopping worker hands messages back only once the receive in flight
        on their queue has returned (within the long poll's wait): SQS answers
        a long poll the moment a message is visible, so a poll still open would
        take them straight back, and spend a receive of each on the way to the
        DLQ. A receiver handing back what its own last poll brought has ended it."""
        for priority in priorities:
            receiver = self._receivers.get(priority)
            if receiver is not None and receiver is not threading.current_thread():
                receiver.join(self.settings.receive_wait_s + 5)

    # ----------------------------------------------------------- heartbeat
    @property
    def heartbeat_period_s(self) -> float:
        # A message is first extended between one and two periods after it was
        # received. At a quarter of the visibility timeout that leaves it a
        # quarter or more when the next tick comes, so one failed extension
        # call (a throttle, a blip, up to a period long) never lets a held
        # message lapse.
        return max(1.0, self.settings.visibility_timeout_s / 4)

    def _heartbeat_loop(self) -> None:
        """Keep every held message invisible while it waits or runs."""
        period = self.heartbeat_period_s
        # Ticks keep their schedule, whatever a call takes: a failed call to a
        # stalled SQS takes its retries' timeouts (about 12 s), and a next tick
        # counted from its return would come that much later, when a message
        # whose extension failed may have lapsed. One that overran its period
        # is followed by the next tick at once.
        next_tick = time.monotonic() + period
        while not self._done.wait(max(0.0, next_tick - time.monotonic())):
            self._extend_held(period)
            next_tick = max(next_tick + period, time.monotonic())

    def _extend_held(self, older_than_s: float) -> None:
        with self._extending:
            with self._held_lock:
                held = [m for m in self._held.values() if time.monotonic() - m.received_at >= older_than_s]
            if held:
                try:
                    self.queues.change_visibility_many(held, self.settings.visibility_timeout_s)
                except Exception as exc:
                    log.warning("visibility extension failed: %s", exc)

    # ------------------------------------------------------------ watchdog
    def _watchdog_loop(self) -> None:
        limit = self.settings.inference_timeout_s
        while not self._done.wait(min(5.0, limit / 2)):
            since = self.pipeline.inferring_since
            if since is not None and time.monotonic() - since > limit:
                # A hung kernel does not come back, and the heartbeat would keep
                # this batch and every prefetched message hidden for ever. They go
                # back now; the orchestrator restarts the worker. A batch that
                # hangs every worker reaches the DLQ by its receive count.
                log.error("a batch has been in inference for over %d s (SLUICE_INFERENCE_TIMEOUT_S): handing "
                          "back the messages held and exiting", limit)
                # Stopped first: no receive, batch or claim after the hand-back
                # (they would hold messages hidden, spend their receives and
                # record starts until the visibility timeout, unrun).
                self.stopping.set()
                self.pipeline.stopping.set()
                self.buffer.close()  # its messages are held: handed back below
                with self._held_lock:
                    held = list(self._held.values())
                self._give_back(held)
                self._take_back_unrun_starts()
                self.exit(70)
                return

    def _take_back_unrun_starts(self) -> None:
        """The batches prepared behind the stuck one never ran: take back the
        starts their claims recorded, for dead-letter settling counts them.
        After the hand-back, so that the messages are back whatever the table
        does (another worker's claim of them adds its own start, which this
        leaves alone: lifecycle.unclaim), and for a few seconds at most: the
        process is ending, and a start not taken back only counts a run too many."""
        run_within(UNCLAIM_ON_EXIT_S, self.pipeline.unclaim_waiting)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        self._receivers = {
            p: threading.Thread(target=self._receive_loop, args=(p,), name=f"sluice-recv-{p.value}", daemon=True)
            for p in Priority
        }
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="sluice-heartbeat", daemon=True)
        watchdog = threading.Thread(target=self._watchdog_loop, name="sluice-watchdog", daemon=True)
        # Gives an outcome to tasks whose message was dead-lettered without one (sluice/dlq.py).
        dead = threading.Thread(target=settle_loop, args=(self.queues, self.runner.store, self.settings.max_attempts,
                                                          self._done, self.settings.dlq_settle_s),
                                name="sluice-dlq", daemon=True)
        for t in self._receivers.values():
            t.start()
        heartbeat.start()
        watchdog.start()
        dead.start()
        self.metrics.start()
        log.info("worker ready", extra={"pid": os.getpid(), "models": list(self.runner.models)})
        self.pipeline.run()  # returns once stopping is set and the batches in hand are done
        self._wait_for_receives(set(Priority))
        self._give_back(self.buffer.close())
        if self._handing_back is not None:
            # main() exits when this returns, ending daemon threads: a hand-back
            # cut off there leaves the buffer's messages hidden until their
            # visibility timeout. Bounded: a stalled SQS costs its retries (~12 s).
            self._handing_back.join(HAND_BACK_ON_EXIT_S)
        self._done.set()
        self.metrics.stop()  # publishes what is left
        if self.queues_missing:
            return EXIT_QUEUE_MISSING
        return 1 if self.pipeline.broken else 0

    def stop(self, *_):
        if not self.stopping.is_set():
            log.info("stopping: finishing the batch in hand")
            self.stopping.set()
            self.pipeline.stopping.set()
            # Not in the signal handler itself: the main thread may hold the
            # buffer's or the heartbeat's lock right where the signal landed.
            self._handing_back = threading.Thread(target=lambda: self._give_back(self.buffer.close()),
                                                  name="sluice-stop", daemon=True)
            self._handing_back.start()


def main() -> int:
    stop_at_once_until_ready()  # PID 1 in a container: a SIGTERM without a handler is dropped
    try:
        level = log_level()
    except SettingsError as exc:  # before logging exists: one line, no traceback
        print(f"worker: refused settings: {exc}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s worker[%(process)d] %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("botocore").setLevel(logging.WARNING)
    try:
        settings = Settings()
    except SettingsError as exc:
        log.error("refused settings:\n%s", exc)
        return 2
    ensure_resources_on_start(settings)  # on-prem only (SLUICE_BOOTSTRAP_ON_START=1)
    from models.registry import load_models

    worker = Worker(settings, load_models(settings.model_names(), settings.torch_threads))
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
