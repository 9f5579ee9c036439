"""The API's reading of queue depths: stale figures answer while a new one is read,
except near the cap, where the depth is read before answering."""

import threading

import pytest
from botocore.exceptions import EndpointConnectionError

from sluice.api.backlog import QueueBacklog
from sluice.contract import Priority

WAIT_S = 5


class Counter:
    """Stands in for GetQueueAttributes: answers `depth`, optionally held until released."""

    def __init__(self, depth: int):
        self.depth, self.calls = depth, 0
        self.release = threading.Event()
        self.release.set()
        self.answered = threading.Event()
        self.fail = False

    def __call__(self, _priority: Priority) -> int:
        self.calls += 1
        assert self.release.wait(WAIT_S), "the read was never released"
        try:
            if self.fail:
                raise EndpointConnectionError(endpoint_url="http://sqs")
            return self.depth
        finally:
            self.answered.set()


def renewed(backlog: QueueBacklog) -> None:
    """Returns once the renewal in flight has finished (renewals run one at a time)."""
    backlog._pool.submit(lambda: None).result(WAIT_S)


def test_the_first_depth_is_read_then_counted_with_what_was_sent():
    read = Counter(7)
    backlog = QueueBacklog(read, cap=1000, max_age_s=60)
    assert backlog.depth(Priority.normal) == 7
    backlog.sent(Priority.normal, 3)
    assert backlog.depth(Priority.normal) == 10
    assert read.calls == 1


def test_a_stale_depth_answers_at_once_while_a_new_one_is_read_in_the_background():
    read = Counter(7)
    backlog = QueueBacklog(read, cap=1000, max_age_s=0)
    assert backlog.depth(Priority.normal) == 7
    read.depth, read.answered = 50, threading.Event()
    read.release.clear()
    # The read is held: a submit that waited for it would not return.
    assert backlog.depth(Priority.normal) == 7
    assert backlog.depth(Priority.normal) == 7
    read.release.set()
    assert read.answered.wait(WAIT_S)
    renewed(backlog)
    assert read.calls == 2  # one renewal in flight at a time
    assert backlog.depth(Priority.normal) == 50


def test_near_the_cap_the_depth_is_read_before_answering():
    read = Counter(95)
    backlog = QueueBacklog(read, cap=100, max_age_s=60)
    assert backlog.depth(Priority.low) == 95
    read.depth = 100
    assert backlog.depth(Priority.low) == 100  # 95 is past 90% of the cap: read again, inline
    assert read.calls == 2


def test_a_failed_renewal_keeps_the_older_figure_and_a_later_submit_tries_again():
    read = Counter(4)
    backlog = QueueBacklog(read, cap=1000, max_age_s=0)
    assert backlog.depth(Priority.high) == 4
    read.fail, read.answered = True, threading.Event()
    assert backlog.depth(Priority.high) == 4
    assert read.answered.wait(WAIT_S)
    renewed(backlog)
    read.fail, read.depth, read.answered = False, 9, threading.Event()
    assert backlog.depth(Priority.high) == 4
    assert read.answered.wait(WAIT_S)
    renewed(backlog)
    assert backlog.depth(Priority.high) == 9


def test_an_unknown_depth_that_cannot_be_read_fails_the_cap_check_but_not_an_estimate():
    read = Counter(0)
    read.fail = True
    backlog = QueueBacklog(read, cap=1000)
    assert backlog.estimate(Priority.high) == 0
    with pytest.raises(EndpointConnectionError):
        backlog.depth(Priority.high)


def test_sends_before_the_first_reading_leave_it_to_that_reading():
    read = Counter(12)
    backlog = QueueBacklog(read, cap=1000, max_age_s=60)
    backlog.sent(Priority.normal, 5)
    assert backlog.depth(Priority.normal) == 12  # read, not 5 guessed from nothing
    assert read.calls == 1


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_successive_readings_measure_how_fast_workers_take_tasks():
    read, clock = Counter(100), Clock()
    backlog = QueueBacklog(read, cap=1000, max_age_s=1, clock=clock)
    assert backlog.depth(Priority.normal) == 100 and backlog.drain_rate() is None
    backlog.sent(Priority.normal, 20)
    clock.now += 2
    read.depth, read.answered = 60, threading.Event()
    backlog.depth(Priority.normal)  # stale: renewed in the background
    assert read.answered.wait(WAIT_S)
    renewed(backlog)
    assert backlog.drain_rate() == 30.0  # (100 + 20 sent - 60) tasks in 2 s
    clock.now += 2
    read.depth, read.answered = 60, threading.Event()
    backlog.depth(Priority.normal)
    assert read.answered.wait(WAIT_S)
    renewed(backlog)
    assert backlog.drain_rate() == 15.0  # nothing taken in the next 2 s: the rate halves


def test_a_reading_from_before_an_idle_spell_is_read_again_before_answering():
    read, clock = Counter(5), Clock()
    backlog = QueueBacklog(read, cap=1000, max_age_s=1, stale_s=10, clock=clock)
    assert backlog.estimate(Priority.high) == 5
    clock.now += 60
    read.depth = 0
    assert backlog.estimate(Priority.high) == 0  # not 5 from a minute ago
    assert read.calls == 2


def test_near_the_cap_readings_closer_than_the_rate_window_still_measure_the_drain():
    # Near the cap every submit reads the depth inline, so readings can come
    # 0.2 s apart; the rate is measured from the last reading a window back.
    read, clock = Counter(950), Clock()
    backlog = QueueBacklog(read, cap=1000, max_age_s=1, clock=clock)
    backlog.depth(Priority.low)
    for depth in (940, 930, 920, 910, 900):  # 10 tasks taken every 0.2 s: 50 a second
        clock.now += 0.2
        backlog.sent(Priority.low, 0)
        read.depth = depth
        backlog.depth(Priority.low)
    assert read.calls == 6
    assert backlog.drain_rate() is not None
    assert backlog.drain_rate() == pytest.approx(50.0)


def test_what_was_sent_between_close_readings_counts_in_the_drain_rate():
    read, clock = Counter(950), Clock()
    backlog = QueueBacklog(read, cap=1000, max_age_s=1, clock=clock)
    backlog.depth(Priority.low)
    clock.now += 0.3
    backlog.sent(Priority.low, 30)
    read.depth = 960  # 30 sent, 20 taken
    backlog.depth(Priority.low)
    clock.now += 0.3
    backlog.sent(Priority.low, 10)
    read.depth = 950  # 10 sent, 20 taken
    backlog.depth(Priority.low)
    assert backlog.drain_rate() == pytest.approx(40 / 0.6)


def measured_at_30_a_second(read, clock) -> QueueBacklog:
    """A backlog whose normal queue was seen drained at 30 tasks/s while it held a backlog, now at 60."""
    backlog = QueueBacklog(read, cap=1000, max_age_s=1, clock=clock)
    backlog.depth(Priority.normal)
    backlog.sent(Priority.normal, 20)
    clock.now += 2
    read.depth = 60
    backlog._read_now(Priority.normal)
    assert backlog.drain_rate() == 30.0
    return backlog


def test_a_queue_the_workers_keep_up_with_measures_no_drain_rate():
    # What left an empty queue is what arrived: the workers' pace is unknown, not
    # the arrival rate, which under light load made waits of seconds out of none.
    read, clock = Counter(0), Clock()
    backlog = QueueBacklog(read, cap=1000, max_age_s=1, clock=clock)
    backlog.depth(Priority.normal)
    backlog.sent(Priority.normal, 3)
    clock.now += 2
    backlog._read_now(Priority.normal)
    assert backlog.drain_rate() is None


def test_an_idle_spell_keeps_the_drain_rate_measured_under_load():
    read, clock = Counter(100), Clock()
    backlog = measured_at_30_a_second(read, clock)
    for _ in range(3):
        clock.now += 2
        read.depth = 0
        backlog._read_now(Priority.normal)
    assert backlog.drain_rate() == 30.0


def test_a_queue_position_counts_down_at_the_measured_pace_since_its_reading():
    read, clock = Counter(100), Clock()
    backlog = measured_at_30_a_second(read, clock)
    backlog.sent(Priority.normal, 10)
    clock.now += 0.5
    assert backlog.estimate(Priority.normal) == 55  # 60 read + 10 sent - 15 taken since, at 30/s
    assert backlog.depth(Priority.normal) == 70  # the cap is held against what may still be there
    clock.now += 0.4
    read.depth = 999  # no new reading under 1 s: the estimate alone answers
    assert backlog.estimate(Priority.normal) == 43


def test_a_renewal_that_lands_after_a_later_reading_leaves_the_later_one():
    # A background renewal's answer came late, after inline readings near the
    # cap: it put back an older depth and dropped the sends counted since, and
    # submits went on past the cap (189 for a cap of 100).
    queue = {"n": 0}
    clock = Clock()
    renewal_asked, renewal_answers = threading.Event(), threading.Event()

    def read(_priority):
        counted = queue["n"]
        if threading.current_thread().name.startswith("sluice-backlog"):
            renewal_asked.set()
            assert renewal_answers.wait(5)
        return counted

    backlog = QueueBacklog(read, cap=100, max_age_s=1.0, clock=clock)

    def submit() -> bool:  # what TaskService.submit does with the backlog
        if backlog.depth(Priority.normal) >= 100:
            return False
        queue["n"] += 1
        backlog.sent(Priority.normal, 1)
        return True

    assert submit()
    clock.now += 1.5  # old: the next submit renews it in the background
    assert submit()
    assert renewal_asked.wait(5)
    sum(submit() for _ in range(200))
    assert queue["n"] == 100
    renewal_answers.set()  # its count of 1 lands
    backlog._pool.submit(lambda: None).result(5)
    assert sum(submit() for _ in range(200)) == 0
    assert queue["n"] == 100


def test_what_is_sent_while_a_depth_is_read_counts_on_top_of_it():
    backlog = QueueBacklog(lambda _p: (backlog.sent(Priority.normal, 3), 10)[1], cap=1000, max_age_s=60)
    assert backlog.depth(Priority.normal) == 13
