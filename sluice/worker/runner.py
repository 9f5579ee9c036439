"""Runs batches: claim the tasks, run the model, record outcomes, ack messages.

A batch passes three stages, each on its own thread, so that the table and
queue calls of one batch overlap the model's forward pass of the next:

    prepare (one BatchGetItem checking the batch's tasks, inputs from S3 per task)
      -> infer (the model, on the main thread)
      -> finish (S3 for large results, a conditional update per outcome, DeleteMessageBatch)

A batch that goes back without running (a worker stopping hands back the
batches prepared behind the one in inference; the infer stage fails; its
preparation fails after the claim) has the starts its claim recorded taken
back (lifecycle.unclaim), and so has a task whose outcome's write the table
throttled: dead-letter settling counts recorded starts as runs. A stopping
worker hands the messages back first and gives the take-back a few seconds
at most (UNCLAIM_ON_EXIT_S): the hand-back is what must land within the
grace period, and a start not taken back only counts a run too many.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pydantic import ValidationError

from models.base import ModelInputError, predict_all
from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues, Received
from sluice.adapters.task_store import TaskStore
from sluice.contract import now_ms, sent_by
from sluice.isolation import BROKEN_AFTER, BrokenModelWatch, run_isolating
from sluice.lifecycle import (
    Job, Outcome, OutcomePlan, claim, gather, load_inputs, plan_outcomes, record_outcomes, refused, sqs_dead_letters,
    unclaim, unclaim_unwritten,
)
from sluice.settings import Settings

log = logging.getLogger("sluice.worker")

# How long a stopping worker (SIGTERM, or its watchdog giving up on a stuck
# batch) waits to take back the starts of the batches it hands back unrun:
# one parallel round of UpdateItem calls, after the hand-back.
UNCLAIM_ON_EXIT_S = 5.0


@dataclass
class Prepared:
    jobs: list[Job]
    ack: list[Received]  # messages to delete whatever happens to the batch
    # Outcomes settled before inference: tasks whose inputs could not be read.
    unreadable: list[Outcome] = field(default_factory=list)
    # Messages to dead-letter whatever happens to the batch: tasks past max_attempts (lifecycle.claim).
    spent: list[Received] = field(default_factory=list)

    @property
    def claimed(self) -> list[Job]:
        """The jobs whose start the claim may have recorded: what unclaim takes
        back if the batch goes back unrun (expired and gone ones recorded none)."""
        return self.jobs + [o.job for o in self.unreadable]


class BatchRunner:
    def __init__(self, settings: Settings, models: dict[str, Any], metrics=None):
        self.settings = settings
        self.models = models
        self.store = TaskStore(settings)
        self.payloads = PayloadStore(settings)
        self.queues = PriorityQueues(settings)
        self.metrics = metrics
        self.io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sluice-io")

    # ------------------------------------------------------------- prepare
    def prepare(self, batch: list[Received], give_back=None) -> Prepared:
        """`give_back(messages, delay_s)` hands back the messages that go back
        unclaimed (the worker's own, which first stops extending them);
        without it they are handed back here."""
        ack: list[Received] = []
        unserved: dict[str, list[Received]] = {}  # by model
        unparsed: list[Received] = []
        jobs: dict[str, Job] = {}
        now = now_ms()
        for received in batch:
            try:
                message = received.task()
            except ValidationError as exc:
                log.error("handing back a message this release cannot read (%d errors, first at %s)",
                          exc.error_count(), ".".join(map(str, exc.errors()[0]["loc"])) or "the body",
                          extra={"message_id": received.message_id, "task_id": sent_by(received.body)[0]})
                unparsed.append(received)
                continue
            # Past its deadline, the claim expires it whatever its model: handed
            # back, it would circle until a worker with the model came, if any.
            if message.model not in self.models and not message.past_deadline(now):
                unserved.setdefault(message.model, []).append(received)
                continue
            ack += gather(jobs, message, received)
        give_back = give_back or partial(hand_back, self.queues)
        if unserved:
            log.warning("handing back %d tasks for models this worker does not serve (%s) for %ds",
                        sum(map(len, unserved.values())), ", ".join(sorted(unserved)), self._hand_back_delay_s)
        if unserved or unparsed:
            self._hand_back_unrun([m for group in unserved.values() for m in group] + unparsed, give_back)

        # If it raises, it took back its starts.
        claimed = claim(self.store, list(jobs.values()), now, self.settings.max_attempts)
        if claimed.unknown:
            log.error("handing back %d tasks whose records are in a status this release does not know (%s)",
                      len(claimed.unknown), ", ".join(j.message.task_id for j in claimed.unknown))
            self._hand_back_unrun([d for job in claimed.unknown for d in job.deliveries], give_back)
        ack += [d for job in claimed.expired + claimed.gone for d in job.deliveries]
        if claimed.spent:
            log.warning("not running %d tasks past their %d attempts, each ended without an outcome (%s): to the "
                        "dead-letter queue, for settling", len(claimed.spent), self.settings.max_attempts,
                        ", ".join(j.message.task_id for j in claimed.spent))
        try:
            # Per task: an unreadable inputs object is its task's outcome, not the batch's failure.
            runnable, unreadable = load_inputs(self.payloads, claimed.runnable, self.io)
        except Exception:  # the batch goes back unrun (Pipeline)
            unclaim(self.store, claimed.runnable)
            raise
        return Prepared(runnable, ack, unreadable, [d for job in claimed.spent for d in job.deliveries])

    @property
    def _hand_back_delay_s(self) -> int:
        # Hidden a while, not at once: workers without the model would take it
        # straight back, spending a receive each time.
        return min(30, max(1, self.settings.visibility_timeout_s // 4))

    def _hand_back_unrun(self, messages: list[Received], give_back) -> None:
        """The API and the workers read SLUICE_MODELS apart: in a rolling deploy
        an API may take a model minutes before this worker serves it. That is
        no attempt of the task, so nothing is written (no start, no error),
        and the message goes back for a worker that serves the model. So does
        a message this release cannot read (a value or rule of a newer release,
        or no task at all; or its record's status), for a worker that can.
        Each hand-back still counts a receive, so the message may reach the
        DLQ: settling (sluice.dlq) requeues a task with no recorded start, and
        leaves one that its release cannot parse there, for a release that
        can or for operators (`sluice dlq list`).
        A task past its deadline is not handed back: prepare's claim expires it."""
        give_back(messages, self._hand_back_delay_s)
        if self.metrics:
            self.metrics.record_handed_back(len(messages))

    # --------------------------------------------------------------- infer
    def infer(self, jobs: list[Job]) -> list[Outcome]:
        # A prepared batch may wait behind the one in inference: the task starts
        # now, so that its queue time counts that wait and start to finish is
        # its inference and its outcome's write.
        started = now_ms()
        for job in jobs:
            job.started_at = started
        outcomes: list[Outcome] = []
        by_model: dict[str, list[Job]] = {}
        for job in jobs:
            by_model.setdefault(job.message.model, []).append(job)
        for name, group in by_model.items():
            outcomes += self._run_isolating(self.models[name], group)  # prepare handed back the others
        return outcomes

    def _run_isolating(self, model, jobs: list[Job]) -> list[Outcome]:
        started = time.perf_counter()
        outcomes = run_isolating(
            lambda group: self._run(model, group),
            jobs,
            lambda job, exc: _failure(job, exc, model.version),
        )
        if self.metrics:
            # One batch as it came, timed whole: the failed runs of one that
            # bisection split took the model's time too (left out, Throughput
            # read 3 x the model's pace), and its halves are not batches.
            self.metrics.record_batch(sum(len(job.inputs) for job in jobs), (time.perf_counter() - started) * 1000)
        return outcomes

    def _run(self, model, jobs: list[Job]) -> list[Outcome]:
        flat = [text for job in jobs for text in job.inputs]
        limit = min(self.settings.max_batch_size, model.max_batch_size)
        started = time.perf_counter()
        outputs = predict_all(model, flat, limit)
        elapsed_ms = (time.perf_counter() - started) * 1000
        outcomes, offset = [], 0
        for job in jobs:
            n = len(job.inputs)
            outcomes.append(
                Outcome(
                    job,
                    result=model.result_for_task(outputs[offset : offset + n]),
                    inference_ms=int(elapsed_ms),
                    batch_size=len(flat),
                    model_version=model.version,
                )
            )
            offset += n
        return outcomes

    # -------------------------------------------------------------- finish
    def acknowledge(self, messages: list[Received]) -> None:
        """Delete the messages of tasks settled without running (expired,
        already final) when their batch goes back unrun. A failed
        delete is logged: the message comes back after its visibility timeout,
        and its next receive acknowledges it."""
        if not messages:
            return
        try:
            self.queues.delete_many(messages)
        except Exception as exc:  # noqa: BLE001 - the stop goes on; nothing is lost
            log.warning("could not delete %d settled messages: %s", len(messages), type(exc).__name__)

    def finish(self, prepared: Prepared, outcomes: list[Outcome], release=None) -> None:
        """`release` is told which messages the queue calls below settle, just
        before them, so that nothing extends their visibility afterwards."""
        outcomes = prepared.unreadable + outcomes
        now = now_ms()
        plan = plan_outcomes(outcomes, now, self.settings)
        # A rejected outcome's task is final already: its message is
        # acknowledged whatever this attempt's outcome was.
        written = record_outcomes(self.store, self.payloads, plan, self.io)
        rejected = written.rejected
        settled = plan.succeeded + plan.unrunnable + plan.expired + [
            o for o in plan.retry + plan.failed if o.job.message.task_id in rejected]
        failed = [o for o in plan.failed if o.job.message.task_id not in rejected]
        retry = [o for o in plan.retry if o.job.message.task_id not in rejected]
        done = list(prepared.ack) + [d for o in settled for d in o.job.deliveries]
        to_dlq = list(prepared.spent) + [d for o in failed for d in o.job.deliveries]
        to_retry = [d for o in retry for d in o.job.deliveries]
        unwritten = [d for o in plan.unwritten for d in o.job.deliveries]
        if release:
            release(done + to_dlq + to_retry + unwritten)
        # Each step is made whatever the one before did (a failed delete comes
        # back and is acknowledged by its next receive); the first error is
        # raised after all of them.
        steps = []
        if done:
            steps.append(lambda: self.queues.delete_many(done))
        if to_dlq:
            steps.append(lambda: self.dead_letter(to_dlq))
        if to_retry:
            steps.append(lambda: self.queues.change_visibility_many(to_retry, _backoff_s(retry)))
        if plan.unwritten:
            steps.append(lambda: self._hand_back_unwritten(plan, written.errored))
        if self.metrics:  # the plan's lists: a result that could not be stored is a failed attempt
            steps.append(lambda: self.metrics.record_outcomes(plan.counted(), now, plan.dropped(rejected)))
        errors = []
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - raised below, once every step was made
                errors.append(exc)
        if errors:
            raise errors[0]

    def dead_letter(self, messages: list[Received]) -> None:
        """To the dead-letter queue. SQS moves a message whose receive count
        reached maxReceiveCount (max_attempts) at its next receive: made
        visible at once, not deleted. A requeued task's (sluice.dlq), younger,
        is moved here. Raises the first failure after trying both."""
        by_sqs = [m for m in messages if sqs_dead_letters(m, self.settings.max_attempts)]
        here = [m for m in messages if not sqs_dead_letters(m, self.settings.max_attempts)]
        errors = []
        for call, group in ((partial(self.queues.change_visibility_many, timeout_s=0), by_sqs),
                            (self.queues.dead_letter, here)):
            try:
                if group:
                    call(group)
            except Exception as exc:  # noqa: BLE001 - raised below, once both were tried
                errors.append(exc)
        if errors:
            raise errors[0]

    def _hand_back_unwritten(self, plan: OutcomePlan, errored: dict[str, Exception]) -> None:
        """Outcomes the table would not take (throttled past the SDK's retries,
        a 5xx, no answer, another error): one task's, never its batch's. Its
        message comes back after a retry's backoff, its start taken back
        where the write was throttled (lifecycle.unclaim_unwritten)."""
        error = next(iter(errored.values()))
        log.warning("could not record the outcome of %d tasks (%s), handing them back: %s", len(plan.unwritten),
                    ", ".join(o.job.message.task_id for o in plan.unwritten), error)
        unclaim_unwritten(self.store, plan, errored)
        hand_back(self.queues, [d for o in plan.unwritten for d in o.job.deliveries], _backoff_s(plan.unwritten))
        if self.metrics:
            self.metrics.record_handed_back(len(plan.unwritten))


def _backoff_s(outcomes: list[Outcome]) -> int:
    """How long a failed attempt's message stays hidden: 2^attempt s, at most 30."""
    return min(30, 2 ** max(o.job.attempts for o in outcomes))


def hand_back(queues: PriorityQueues, messages: list[Received], delay_s: int = 0) -> None:
    """Make messages visible again after delay_s, for this worker or another."""
    try:
        queues.change_visibility_many(messages, delay_s)
    except Exception as exc:  # they come back after their visibility timeout anyway
        log.warning("could not hand back %d messages: %s", len(messages), type(exc).__name__)


def unclaim_within(store: TaskStore, jobs: list[Job]) -> None:
    """lifecycle.unclaim for a stopping worker: UNCLAIM_ON_EXIT_S at most."""
    if any(job.recorded_start is not None for job in jobs):
        run_within(UNCLAIM_ON_EXIT_S, unclaim, store, jobs)


def run_within(limit_s: float, work, *args) -> None:
    """work(*args) on a thread of its own, waited on for limit_s at most; past
    that it goes on alone (a daemon: it never holds up the process's exit)."""
    thread = threading.Thread(target=work, args=args, name="sluice-unclaim", daemon=True)
    thread.start()
    thread.join(limit_s)


def _failure(job: Job, exc: Exception, model_version: str) -> Outcome:
    if isinstance(exc, ModelInputError):
        return refused(job, str(exc), model_version)
    return Outcome(job, error=f"{type(exc).__name__}: {exc}", model_version=model_version)


class Pipeline:
    """Runs prepare -> infer -> finish with bounded hand-offs between stages."""

    def __init__(self, runner: BatchRunner, take_batch, on_done, give_back, on_broken=None):
        self.runner = runner
        self.take_batch = take_batch
        self.on_done = on_done  # receives the messages a batch no longer holds
        # give_back(messages, delay_s=0) makes messages visible again: a batch
        # not started when stopping (at once, for another worker), the tasks
        # for a model this worker does not serve (after a delay).
        self.give_back = give_back
        self._prepared: queue.Queue = queue.Queue(maxsize=1)
        self._finished: queue.Queue = queue.Queue(maxsize=2)
        self.stopping = threading.Event()
        self.failures = 0
        self.inferring_since: float | None = None  # time.monotonic() when the batch in inference began
        self.on_broken = on_broken  # told once BROKEN_AFTER batches in a row failed every task
        self.broken = False
        self._model_watch = BrokenModelWatch()
        # Batches prepared and not yet taken for inference, by id(): claimed,
        # not run. The watchdog takes their starts back (unclaim_waiting).
        self._waiting: dict[int, Prepared] = {}
        self._waiting_changed = threading.Condition()  # guards _waiting and _preparing
        self._preparing = False  # a batch in prepare: its claim may be recording starts

    def run(self) -> None:
        preparer = threading.Thread(target=self._prepare_loop, name="sluice-prepare", daemon=True)
        finisher = threading.Thread(target=self._finish_loop, name="sluice-finish", daemon=True)
        preparer.start()
        finisher.start()
        while True:
            item = self._prepared.get()
            if item is None:
                break
            batch, prepared = item
            self._taken(prepared)
            if self.stopping.is_set():
                # Only the batch in inference finishes within the grace period;
                # the ones prepared behind it go back rather than run after it:
                # at once, then their starts are taken back (a claim another
                # worker makes meanwhile keeps its own: lifecycle.unclaim).
                # What prepare settled stays settled: the messages of tasks
                # expired or already final are deleted, and those handed back
                # for another worker's model keep their delay.
                self.give_back([d for job in prepared.claimed for d in job.deliveries])
                unclaim_within(self.runner.store, prepared.claimed)
                self.on_done(batch)
                self.runner.acknowledge(prepared.ack)
                try:
                    self.runner.dead_letter(prepared.spent)
                except Exception as exc:  # noqa: BLE001 - they come back, spent again
                    log.warning("could not dead-letter %d spent tasks' messages: %s", len(prepared.spent),
                                type(exc).__name__)
                continue
            self.inferring_since = time.monotonic()
            try:
                outcomes = self.runner.infer(prepared.jobs)
            except Exception:
                log.exception("inference stage failed; messages will be redelivered")
                unclaim(self.runner.store, prepared.claimed)  # no outcome: no run to count
                self.on_done(batch)
                continue
            finally:
                self.inferring_since = None
            self._finished.put((batch, prepared, outcomes))
            self._watch_the_model(outcomes)
        self._finished.put(None)
        finisher.join()
        preparer.join()

    def _watch_the_model(self, outcomes: list[Outcome]) -> None:
        by_model: dict[str, list[str | None]] = {}
        for o in outcomes:
            by_model.setdefault(o.job.message.model, []).append(o.error_code if o.error else None)
        broken = [model for model, codes in by_model.items() if self._model_watch.saw(model, codes)]
        if broken and not self.broken:
            log.error("model %s failed every task of %d batches in a row: stopping this worker (exit 1) rather "
                      "than fail the rest of the queue", broken[0], BROKEN_AFTER)
            self.broken = True
            self.stopping.set()
            if self.on_broken:
                self.on_broken()

    def _prepare_loop(self) -> None:
        backoff = 0.1
        while not self.stopping.is_set():
            batch = self.take_batch()
            if not batch:
                continue
            with self._waiting_changed:
                # Checked under the lock that unclaim_waiting takes: once it
                # has seen no batch in prepare, no claim starts after it.
                self._preparing = not self.stopping.is_set()
            if not self._preparing:  # stopping since the batch was taken: back unclaimed
                self.give_back(batch)
                break
            prepared = None
            try:
                prepared = self.runner.prepare(batch, self.give_back)
                backoff = 0.1
            except Exception:
                # A dependency is down: the messages come back after their
                # visibility timeout; back off rather than spin.
                log.exception("prepare failed; backing off %.1fs", backoff)
                self.failures += 1
                self.on_done(batch)
            finally:
                with self._waiting_changed:
                    if prepared is not None:
                        self._waiting[id(prepared)] = prepared
                    self._preparing = False
                    self._waiting_changed.notify_all()
            if prepared is None:
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self._prepared.put((batch, prepared))
        self._prepared.put(None)

    def _taken(self, prepared: Prepared) -> None:
        with self._waiting_changed:
            self._waiting.pop(id(prepared), None)

    def unclaim_waiting(self) -> None:
        """Take back the starts recorded by the batches prepared behind the one
        in inference, for a worker giving up on that one (its watchdog) once
        `stopping` is set: they never ran. A batch in prepare is waited for,
        its claim's starts being among them (the caller bounds the wait). The
        batch in inference keeps its starts: it is running, and a task that
        hangs every worker must reach its limit."""
        with self._waiting_changed:
            self._waiting_changed.wait_for(lambda: not self._preparing)
            waiting, self._waiting = list(self._waiting.values()), {}
        unclaim(self.runner.store, [job for prepared in waiting for job in prepared.claimed])

    def _finish_loop(self) -> None:
        while True:
            item = self._finished.get()
            if item is None:
                return
            batch, prepared, outcomes = item
            try:
                self.runner.finish(prepared, outcomes, self.on_done)
            except Exception:
                log.exception("finish failed; messages will be redelivered")
                self.failures += 1
            finally:
                self.on_done(batch)
