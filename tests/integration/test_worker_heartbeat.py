"""The heartbeat's visibility extension never lands after a batch has set its
messages' visibility itself: a retry's backoff or a hand-back (0) would
otherwise become a whole visibility timeout."""

from __future__ import annotations

import threading

from models.synthetic import SyntheticModel
from sluice.api.service import TaskService
from sluice.contract import Priority, SubmitRequest
from sluice.worker.main import Worker


def test_a_hand_back_during_an_extension_lands_after_it(settings, monkeypatch):
    service = TaskService(settings)
    task_id = service.submit("tenant-a", SubmitRequest(model="synthetic", inputs=["x"]), None).task_id
    worker = Worker(settings, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    [message] = worker.queues.receive(Priority.normal, 1, 2, 30)
    message.received_at -= 60  # due for an extension
    worker._held[message.receipt_handle] = message

    extending, let_go = threading.Event(), threading.Event()
    change_visibility = worker.queues.change_visibility_many

    def slow_extension(messages, timeout_s):
        if threading.current_thread().name == "extension":
            extending.set()
            assert let_go.wait(10), "the test never let the extension go"
        change_visibility(messages, timeout_s)

    monkeypatch.setattr(worker.queues, "change_visibility_many", slow_extension)
    extension = threading.Thread(target=worker._extend_held, args=(1.0,), name="extension")
    extension.start()
    assert extending.wait(10), "the extension never started"
    # Handing the message back (visibility 0) while the extension (30 s) is in flight.
    hand_back = threading.Thread(target=worker._give_back, args=([message],))
    hand_back.start()
    hand_back.join(1)  # it cannot finish before the extension does; without the lock it would by now
    let_go.set()
    extension.join(10)
    hand_back.join(10)
    assert not extension.is_alive() and not hand_back.is_alive()

    again = worker.queues.receive(Priority.normal, 1, 2, 30)
    assert [m.task().task_id for m in again] == [task_id], "the hand-back was overridden by the extension"
