from collections import Counter

import pytest

from sluice.contract import Priority
from sluice.worker.policy import WeightedPriorityPolicy

H, N, L = Priority.high, Priority.normal, Priority.low
ALL = [H, N, L]


def test_shares_follow_weights_when_all_busy():
    policy = WeightedPriorityPolicy({H: 6, N: 3, L: 1})
    picks = Counter(policy.pick(ALL) for _ in range(1000))
    assert picks == {H: 600, N: 300, L: 100}


def test_low_is_served_within_every_window_of_the_total_weight():
    policy = WeightedPriorityPolicy({H: 6, N: 3, L: 1})
    picks = [policy.pick(ALL) for _ in range(100)]
    for start in range(0, 100, 10):
        assert L in picks[start : start + 10]


def test_high_goes_first():
    policy = WeightedPriorityPolicy({H: 6, N: 3, L: 1})
    assert policy.pick(ALL) is H


def test_idle_priority_share_goes_to_others():
    policy = WeightedPriorityPolicy({H: 6, N: 3, L: 1})
    picks = Counter(policy.pick([N, L]) for _ in range(400))
    assert picks == {N: 300, L: 100}


def test_single_ready_priority_always_wins():
    policy = WeightedPriorityPolicy({H: 6, N: 3, L: 1})
    assert {policy.pick([L]) for _ in range(10)} == {L}


def test_rejects_zero_weight():
    with pytest.raises(ValueError):
        WeightedPriorityPolicy({H: 1, N: 0, L: 1})


def test_a_refunded_pick_leaves_no_trace():
    policy, untouched = WeightedPriorityPolicy({H: 6, N: 3, L: 1}), WeightedPriorityPolicy({H: 6, N: 3, L: 1})
    picks = []
    for i in range(30):
        if i % 4 == 0:
            policy.refund(policy.pick([N, L]), [N, L])
        picks.append(policy.pick(ALL))
    assert picks == [untouched.pick(ALL) for _ in range(30)]


def test_shares_are_shares_of_inputs_when_tasks_differ_in_size():
    # Counted in messages, 32-input normal and low tasks took as many inputs as
    # 1-input high ones (94% of the messages were high, a third of the inputs).
    policy = WeightedPriorityPolicy({H: 6, N: 3, L: 1})
    size = {H: 1, N: 32, L: 32}
    inputs = Counter()
    for _ in range(20_000):
        p = policy.pick(ALL, cost=size.get)
        inputs[p] += size[p]
    total = sum(inputs.values())
    assert inputs[H] / total == pytest.approx(0.6, abs=0.01)
    assert inputs[N] / total == pytest.approx(0.3, abs=0.01)
    assert inputs[L] / total == pytest.approx(0.1, abs=0.01)


def test_a_refunded_pick_of_many_turns_leaves_no_trace():
    policy, untouched = WeightedPriorityPolicy({H: 6, N: 3, L: 1}), WeightedPriorityPolicy({H: 6, N: 3, L: 1})
    picks = []
    for i in range(30):
        if i % 4 == 0:
            policy.refund(policy.pick([N, L], cost=lambda p: 7), [N, L], 7)
        picks.append(policy.pick(ALL))
    assert picks == [untouched.pick(ALL) for _ in range(30)]
