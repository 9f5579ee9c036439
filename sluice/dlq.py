"""Dead-letter queues: inspection, redrive, and settling tasks left without an outcome.

A message reaches a DLQ after max_attempts receives (its maxReceiveCount), or
sooner when a requeued task's runs reach max_attempts (sluice.lifecycle). A task whose last
attempt failed in the model is already `failed` when that happens. But every
receive counts, including ones that ended without an outcome: a worker killed
mid-batch, messages handed back on SIGTERM, a reply lost on the network. Such a
task would stay `queued` for ever; `settle_dead` (run by every
worker now and then, and by `sluice dlq settle`) gives it one.

Messages of tasks that are already final stay in the DLQ for operators
(`sluice dlq list` and `redrive`, the DLQ alarm), for its 14-day retention. So
a settling round cannot stop at the first messages SQS hands it: moto returns
them in insertion order and LocalStack by creation time, and AWS samples, so
the same ones would come back every round and a task behind them would never
be reached. A round keeps what it leaves in place hidden until it ends, so each
receive reaches the messages behind, and shows them again when it is done.
A round that stopped before the end of its queue (at `scan` messages, or out
of time) keeps those with nothing to settle (their task final, or gone)
hidden for _PASSED_S more, so the next rounds start past them rather than at
the same head: with a few hundred such dead letters ahead, a task behind them
was never reached on moto or LocalStack, whose receives keep queue order.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time

from sluice.adapters.queues import PriorityQueues, sqs_safe
from sluice.adapters.task_store import Change, TaskStore, TransitionRejected, UnreadableRecord
from sluice.contract import Priority, TaskMessage, TaskRecord, TaskStatus, now_ms, sent_by

log = logging.getLogger("sluice.dlq")

_ACTIVE = (TaskStatus.queued,)

# A settling round hides what it received for _HIDE_S and stops receiving once
# half of that has passed, so it shows its kept messages again before they
# would reappear on their own (and be received twice in one round).
_HIDE_S = 30
_SCAN = 1000  # messages a round looks at per priority, kept ones included
# How long a round that stopped short hides the dead letters it found nothing
# to settle for. About twenty rounds of a worker (every ~30 s) reach past them
# before they show again, so settling reaches ~20 x _SCAN messages deep; `sluice
# dlq list` counts them as hidden meanwhile, and the DLQ alarms count them all.
_PASSED_S = 600
_KNOWN_FINAL_MAX = 100_000  # task ids a settling process remembers as final


def _receive_all(queues: PriorityQueues, url: str, limit: int, hide_s: int = 30) -> list[dict]:
    """Up to `limit` messages. Each receive hides what it got for `hide_s`, so
    the next one sees others (receiving with visibility 0 returns the same ten
    every time); the caller makes visible again what it leaves in place.

    An empty answer ends it, so each receive long-polls for a second: a short
    poll asks only a sample of SQS's servers and can answer empty while
    messages wait. A long poll answers as soon as it has any, so only the last
    receive waits."""
    found: list[dict] = []
    while len(found) < limit:
        response = queues.sqs.receive_message(
            QueueUrl=url, MaxNumberOfMessages=min(10, limit - len(found)), VisibilityTimeout=hide_s,
            WaitTimeSeconds=1, MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
        )
        messages = response.get("Messages", [])
        if not messages:
            break
        found += messages
    return found


def _batches(messages: list[dict]):
    for i in range(0, len(messages), 10):
        yield messages[i:i + 10]


def _show_again(queues: PriorityQueues, url: str, messages: list[dict]) -> None:
    _hide(queues, url, messages, 0)


def _hide(queues: PriorityQueues, url: str, messages: list[dict], seconds: int) -> None:
    for chunk in _batches(messages):
        queues.sqs.change_message_visibility_batch(QueueUrl=url, Entries=[
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"], "VisibilityTimeout": seconds}
            for i, m in enumerate(chunk)])


def _move(queues: PriorityQueues, source: str, target: str, messages: list[dict]) -> list[dict]:
    """Send first, then delete: a failure in between duplicates a message
    rather than losing it (a worker runs a task only once). SendMessageBatch
    reports an entry it did not store in `Failed` without raising: only the
    stored ones are deleted. Returns the messages left in `source`, still
    hidden: the caller shows them again."""
    left: list[dict] = []
    for chunk in _batches(messages):
        stored = queues.send_bodies(target, [m["Body"] for m in chunk])
        left += [m for i, m in enumerate(chunk) if i not in stored]
        _delete(queues, source, [m for i, m in enumerate(chunk) if i in stored])
    return left


def _delete(queues: PriorityQueues, url: str, messages: list[dict]) -> list[dict]:
    """Delete received messages; returns those not deleted, still hidden."""
    left: list[dict] = []
    for chunk in _batches(messages):  # an empty list makes no call
        failed = queues.sqs.delete_message_batch(QueueUrl=url, Entries=[
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(chunk)]).get("Failed", [])
        left += [chunk[int(f["Id"])] for f in failed]
    return left


def _record_of(records: dict[str, TaskRecord], body: str) -> TaskRecord | None:
    """The record of the task that sent this message: one of a later submit
    under the same id (its Idempotency-Key reused once the task outlived its
    TTL, while this message waited out its 14 days here) is another task's."""
    task_id, enqueued_at = sent_by(body)
    record = records.get(task_id) if task_id else None
    if record is None or (enqueued_at is not None and record.created_at != enqueued_at):
        return None
    return record


def list_dead(queues: PriorityQueues, priorities: list[Priority], limit: int = 100, store=None) -> list[dict]:
    """DLQ messages, left where they are. With a TaskStore, each also names its
    task and that task's status: a redriven message of a task that is already
    final is acknowledged without running again (its outcome stands)."""
    found: list[dict] = []
    for priority in priorities:
        url = queues.dlq_url(priority)
        messages = _receive_all(queues, url, limit - len(found))
        _show_again(queues, url, messages)
        found += [{"priority": priority.value, "message_id": m["MessageId"], "body": m["Body"],
                   "attributes": m.get("Attributes", {}), "task_id": sent_by(m["Body"])[0]} for m in messages]
    if store is not None:
        unreadable: dict[str, UnreadableRecord] = {}
        records = store.get_many([i["task_id"] for i in found if i["task_id"]], unreadable)
        for item in found:
            record = _record_of(records, item["body"])
            item["task_status"] = record.status.value if record else None
            if item["task_id"] in unreadable:  # as a newer release wrote it
                item["task_status"] = unreadable[item["task_id"]].status
    return found


def dead_counts(queues: PriorityQueues, priorities: list[Priority]) -> tuple[int, int]:
    """(visible, hidden): messages in these DLQs as SQS approximates them;
    hidden ones are held by another reader (a worker's settling round)."""
    visible = hidden = 0
    for priority in priorities:
        attributes = queues.sqs.get_queue_attributes(QueueUrl=queues.dlq_url(priority), AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
        visible += int(attributes["ApproximateNumberOfMessages"])
        hidden += int(attributes["ApproximateNumberOfMessagesNotVisible"])
    return visible, hidden


def max_receive_count(queues: PriorityQueues, priority: Priority) -> int | None:
    """The receives after which SQS moved a message of this priority to its
    DLQ (its main queue's RedrivePolicy), what a task's runs are counted
    against; None if the queue has no such policy."""
    policy = queues.sqs.get_queue_attributes(
        QueueUrl=queues.url(priority), AttributeNames=["RedrivePolicy"]).get("Attributes", {}).get("RedrivePolicy")
    try:
        return int(json.loads(policy)["maxReceiveCount"]) if policy else None
    except (ValueError, KeyError, TypeError):
        return None


def redrive(queues: PriorityQueues, priorities: list[Priority], limit: int = 100) -> int:
    """Move DLQ messages back to their source queue, without the runs so far
    that a requeued or dead-lettered task's message carries (`runs_before`):
    SQS counts their receives from 1 again, so a task not final yet gets runs
    anew (an operator reruns tasks whose cause is fixed); settle_dead requeues
    with the runs so far instead."""
    moved = 0
    for priority in priorities:
        dlq = queues.dlq_url(priority)
        messages = _receive_all(queues, dlq, limit - moved)
        messages = [{**m, "Body": _counting_runs(m["Body"], 0)} for m in messages]
        left = _move(queues, dlq, queues.url(priority), messages)
        _show_again(queues, dlq, left)
        moved += len(messages) - len(left)
    return moved


def settle_dead(queues: PriorityQueues, store: TaskStore, priorities: list[Priority], max_attempts: int,
                limit: int = 100, scan: int = _SCAN,
                known_final: set[tuple[str, int]] | None = None, until: float | None = None) -> dict[str, int]:
    """For each dead-lettered message whose task has no outcome yet: a task that
    started `max_attempts` times (and never finished: each run took its worker
    down) is failed with a readable error; any other goes back to its queue
    as a new message, which SQS counts from 1 again: it carries the task's
    runs so far (`runs_before`), so that the task still runs at most
    `max_attempts` times (sluice.lifecycle). A task with several dead
    letters in a round is requeued once; the others are deleted once that
    requeue is stored. Messages of final tasks stay for operators.

    Per priority, a round settles up to `limit` messages and looks at up to
    `scan` (those it keeps included): it receives until the queue yields
    nothing new, `scan` is reached or half of `_HIDE_S` has passed, keeping
    what it leaves in place hidden meanwhile, then shows those again.

    `known_final`: tasks found final in earlier rounds, kept by the caller
    (and bounded here), each as (task id, created_at): a final task stays
    final, so their records are not read again, but a later task under the
    same id (an Idempotency-Key reused once the first outlived its TTL) is
    another task.

    `until`: when (time.monotonic()) the whole round stops receiving, for a
    caller with a deadline of its own (the settler Lambda's timeout): what it
    then hides and shows again must still fit, or the next round starts at
    the same head."""
    known_final = set() if known_final is None else known_final
    if len(known_final) > _KNOWN_FINAL_MAX:
        known_final.clear()
    counts = {"failed": 0, "requeued": 0}
    for priority in priorities:
        dlq = queues.dlq_url(priority)
        seen: set[str] = set()
        copies: dict[tuple[str, int], list[dict]] = {}  # by each task requeued: its other dead letters
        keep: list[dict] = []
        passed: list[dict] = []  # nothing to settle for their task: final, or gone
        settled = 0
        reached_end = False  # or stopped at `limit`: not at `scan` or out of time
        stop_at = min(time.monotonic() + _HIDE_S / 2, until if until is not None else float("inf"))
        try:
            while len(seen) < scan and time.monotonic() < stop_at:
                want = min(100, scan - len(seen))
                received_at = time.monotonic()
                got = _receive_all(queues, dlq, want, _HIDE_S)
                new = [m for m in got if m["MessageId"] not in seen]
                keep += [m for m in got if m["MessageId"] in seen]  # its hide ran out: show it again too
                if not new:
                    reached_end = True
                    break
                seen.update(m["MessageId"] for m in new)
                # One this release cannot parse stays for a release that can
                # (its settling requeues it) or for operators; its id is not
                # read either: it may be one no table takes as a key.
                readable: list[dict] = []
                for m in new:
                    (readable if _readable(m["Body"]) else passed).append(m)
                new = readable
                ids = {t for t, sent in (sent_by(m["Body"]) for m in new) if t and (t, sent) not in known_final}
                # One this release cannot read is left out: passed, as a gone one.
                records = store.get_many(ids, unreadable={}) if ids else {}
                requeue, spent = [], []
                for m in new:
                    record = _record_of(records, m["Body"])
                    if record is not None and record.status.is_terminal:
                        known_final.add((record.task_id, record.created_at))
                    if record is None or record.status.is_terminal:
                        passed.append(m)
                        continue
                    task = (record.task_id, record.created_at)
                    if task in copies:
                        # Another dead letter of a task this round requeues:
                        # requeued too, it would run the same runs left again.
                        copies[task].append(m)
                        continue
                    if settled >= limit:
                        keep.append(m)
                        continue
                    settled += 1
                    if record.runs() >= max_attempts:
                        keep.append(m)
                        spent.append(record)
                    else:
                        copies[task] = []
                        requeue.append({**m, "Body": _counting_runs(m["Body"], record.runs()), "task": task})
                # A requeue is sent while its dead letter is surely still hidden:
                # once the hide runs out, another worker's round can requeue the
                # same task, and each copy would run the runs it has left. So it
                # goes before the failures' writes (one call each), and a pass
                # slowed past half the hide (a throttled or hung table) leaves
                # its requeues to the next round.
                if time.monotonic() - received_at > _HIDE_S / 2:
                    left = requeue
                else:
                    left = _move(queues, dlq, queues.url(priority), requeue)
                keep += left
                counts["requeued"] += len(requeue) - len(left)
                for m in left:  # not requeued: its copies wait with it for the next round
                    keep += copies.pop(m["task"])
                keep += _delete(queues, dlq, [c for t in copies.values() for c in t])
                copies = {t: [] for t in copies}
                for record in spent:  # their dead letters stay, failed or not: no other round can run them twice
                    counts["failed"] += _fail_dead_lettered(store, record)
                if len(got) < want:
                    reached_end = True  # the queue has nothing more to give
                    break
                if settled >= limit:
                    # The round has done its share: what lies behind is not
                    # out of reach, so the next round may start at the head.
                    reached_end = True
                    break
        finally:
            if reached_end:
                keep += passed
            else:
                _hide(queues, dlq, passed, _PASSED_S)
            _show_again(queues, dlq, keep)
    return counts


def _readable(body: str) -> bool:
    try:
        TaskMessage.model_validate_json(body)
    except ValueError:
        return False
    return True


def _counting_runs(body: str, runs: int) -> str:
    """The body of a requeued task's new message: it carries the runs so far,
    which SQS's receive count restarts from 1 without (sluice.lifecycle); 0:
    none (a redrive). Changed as JSON, not through TaskMessage: a field of a
    newer release, which this one's model ignores, stays in it."""
    try:
        message = TaskMessage.model_validate_json(body)
    except ValueError:  # settling requeues none such (_readable)
        return body
    if runs < 1 and message.runs_before is None:
        return body
    fields = json.loads(body)
    fields.pop("runs_before", None)
    if runs >= 1:
        fields["runs_before"] = runs
    return sqs_safe(json.dumps(fields, ensure_ascii=False, separators=(",", ":")))


def _fail_dead_lettered(store: TaskStore, record: TaskRecord) -> int:
    """1 if the task is now failed, 0 if it got an outcome meanwhile."""
    runs = record.runs()
    # The failure replaces the task's last error: the message keeps it.
    why = (f"the last error recorded: {record.error_code}: {record.error_message}" if record.error_code
           else "the worker running it stopped each time")
    try:
        store.apply(Change(record.task_id, {
            "status": TaskStatus.failed.value, "finished_at": now_ms(), "error_code": "dead_lettered",
            "error_message": f"no outcome after {runs} attempt{'s' if runs > 1 else ''} ({why}); "
                             "its message is in the dead-letter queue"},
            # Adds the first delivery's start where it is missing, to whatever starts are recorded by now.
            _ACTIVE, add_attempt=runs - record.attempts))
    except (TransitionRejected, UnreadableRecord):  # a newer release rewrote it since it was read: that release settles it
        return 0
    return 1


def settle_loop(queues: PriorityQueues, store: TaskStore, max_attempts: int, done: threading.Event,
                every_s: float) -> None:
    """settle_dead about every `every_s` seconds (jittered by half either way) until `done`."""
    known_final: set[tuple[str, int]] = set()
    while not done.wait(every_s * random.uniform(0.5, 1.5)):
        try:
            counts = settle_dead(queues, store, list(Priority), max_attempts, known_final=known_final)
        except Exception as exc:  # a dependency is down: next round
            log.warning("settling dead-lettered tasks failed: %s", type(exc).__name__)
            continue
        if any(counts.values()):
            log.info("dead-lettered tasks without an outcome: %d failed, %d requeued",
                     counts["failed"], counts["requeued"])
