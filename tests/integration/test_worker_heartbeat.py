"""The heartbeat's visibility extension never lands after a batch has set its
messages' visibility itself: a retry's backoff or a hand-back (0) would
otherwise become a whole visibility timeout. And its period leaves room for
one failed extension call."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from models.synthetic import SyntheticModel
from sluice.api.service import TaskService
from sluice.contract import Priority, SubmitRequest
from sluice.worker.main import Worker
from tests.reliability.harness import wait_until


def test_a_hand_back_during_an_extension_lands_after_it(settings, monkeypatch):
    service = TaskService(settings)
    task_id = service.submit("tenant-a", SubmitRequest(model="synthetic", inputs=["x"]), None).task_id
    worker = Worker(settings, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    [message] = worker.queues.receive(Priority.normal, 1, 2, 30)
    message.received_at -= 60  # due for an extension
    worker._held[message.receipt_handle] = message

    extending, let_go, waiting_for_lock = threading.Event(), threading.Event(), threading.Event()
    change_visibility = worker.queues.change_visibility_many
    landed = []  # (thread, visibility) in the order the changes landed

    def slow_extension(messages, timeout_s):
        if threading.current_thread().name == "extension":
            extending.set()
            assert let_go.wait(10), "the test never let the extension go"
        change_visibility(messages, timeout_s)
        landed.append((threading.current_thread().name, timeout_s))

    class ObservedLock:
        """The worker's extension lock, telling the test when the hand-back asks for it."""

        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if threading.current_thread().name == "hand-back":
                waiting_for_lock.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    monkeypatch.setattr(worker.queues, "change_visibility_many", slow_extension)
    monkeypatch.setattr(worker, "_extending", ObservedLock(worker._extending))
    extension = threading.Thread(target=worker._extend_held, args=(1.0,), name="extension", daemon=True)
    extension.start()
    assert extending.wait(10), "the extension never started"
    # Handing the message back (visibility 0) while the extension (30 s) is in flight.
    hand_back = threading.Thread(target=worker._give_back, args=([message],), name="hand-back", daemon=True)
    hand_back.start()
    # Either it queues behind the extension, or (without the lock) it changes
    # the visibility at once: wait for whichever happens, not for a while.
    wait_until(lambda: waiting_for_lock.is_set() or landed or not hand_back.is_alive(), 10,
               "the hand-back to wait for the extension's lock or to change the visibility", state=lambda: landed)
    assert landed == [] and hand_back.is_alive(), "the hand-back did not wait for the extension in flight"
    let_go.set()
    extension.join(10)
    hand_back.join(10)
    assert not extension.is_alive() and not hand_back.is_alive()
    assert landed == [("extension", settings.visibility_timeout_s), ("hand-back", 0)]

    again = worker.queues.receive(Priority.normal, 1, 2, 30)
    assert [m.task().task_id for m in again] == [task_id], "the hand-back was overridden by the extension"


def test_a_message_outlives_one_failed_extension_whenever_it_was_received(settings, monkeypatch):
    """The heartbeat's ticks run on their own clock, so a message may arrive at
    any point between two of them. Whatever that point, when the first
    extension it is due fails, the next tick still finds it with a quarter of
    its visibility timeout left."""
    worker = Worker(settings, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    visibility = settings.visibility_timeout_s
    period = worker.heartbeat_period_s
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr("sluice.worker.main.time", SimpleNamespace(monotonic=lambda: clock.now))
    attempts: list[float] = []  # when an extension of the message was asked for

    def failing_once(messages, timeout_s):
        attempts.append(clock.now)
        if len(attempts) == 1:
            raise ConnectionError("throttled")

    monkeypatch.setattr(worker.queues, "change_visibility_many", failing_once)
    steps = 20
    for step in range(steps):
        received = period * step / steps  # between the ticks at 0 and at one period
        attempts.clear()
        message = SimpleNamespace(receipt_handle="m", received_at=received)
        worker._held = {"m": message}
        tick = 0
        while len(attempts) < 2:
            tick += 1
            clock.now = tick * period
            assert clock.now < received + visibility, f"received at {received:.1f} s: the message lapsed"
            worker._extend_held(period)
        left = received + visibility - attempts[1]
        assert left >= visibility / 4 - 1e-9, f"received at {received:.1f} s: retried with only {left:.1f} s left"


class FakeDone:
    """Stands in for Worker._done on a fake clock: wait(t) advances it by t; set at `until`."""

    def __init__(self, clock, until):
        self.clock, self.until = clock, until

    def wait(self, timeout):
        self.clock.now += timeout
        return self.clock.now >= self.until


@pytest.mark.parametrize("failing_call_s", [12.1, 15.0])  # 12.1 s: a call to a stalled SQS (docs/reliability.md)
def test_a_slow_failed_extension_does_not_push_the_next_tick_back(settings, monkeypatch, failing_call_s):
    """The ticks keep their schedule whatever a call takes (up to a period): a
    tick that started after the failed call had returned would come a period
    plus the call's time later, when a message may have lapsed."""
    worker = Worker(settings, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    visibility = 60
    worker.settings = settings.model_copy(update={"visibility_timeout_s": visibility})
    period = worker.heartbeat_period_s
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr("sluice.worker.main.time", SimpleNamespace(monotonic=lambda: clock.now))
    attempts: list[float] = []

    def slow_to_fail_once(messages, timeout_s):
        attempts.append(clock.now)
        if len(attempts) == 1:
            clock.now += failing_call_s
            raise ConnectionError("read timeout")

    monkeypatch.setattr(worker.queues, "change_visibility_many", slow_to_fail_once)
    received = period + 0.01  # just after a tick: first extended two ticks later
    worker._held = {"m": SimpleNamespace(receipt_handle="m", received_at=received)}
    worker._done = FakeDone(clock, until=received + visibility + period)
    worker._heartbeat_loop()
    left = received + visibility - attempts[1]
    assert left >= visibility / 4 - 0.02, f"retried with {left:.2f} s of visibility left"
