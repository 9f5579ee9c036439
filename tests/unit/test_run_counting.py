"""A run's number (lifecycle.Job.attempts) from a batch's deliveries of one task."""

from dataclasses import dataclass

from sluice.contract import Priority, TaskMessage
from sluice.lifecycle import gather


@dataclass
class Delivery:
    receive_count: int


def message(runs_before: int | None = None) -> TaskMessage:
    return TaskMessage(task_id="t1", tenant_id="t", model="m", priority=Priority.normal, input_count=1,
                       inputs=["x"], enqueued_at=1, runs_before=runs_before)


def test_a_requeued_message_counts_the_runs_before_it():
    jobs = {}
    gather(jobs, message(runs_before=2), Delivery(receive_count=1))
    assert jobs["t1"].attempts == 3


def test_a_first_message_and_its_re_send_in_one_batch_each_count_their_own_runs():
    # The re-send carries the runs the first message's receives stand for: added
    # to the first message's receive count, they would count those runs twice.
    jobs = {}
    assert gather(jobs, message(), Delivery(receive_count=2)) == []
    assert gather(jobs, message(runs_before=1), Delivery(receive_count=1)) == []
    assert jobs["t1"].attempts == 2
    jobs = {}
    gather(jobs, message(runs_before=1), Delivery(receive_count=2))
    gather(jobs, message(), Delivery(receive_count=1))
    assert jobs["t1"].attempts == 3
