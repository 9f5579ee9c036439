"""Group commit: submits that arrive during a write share the next one."""

import threading
import time

import pytest

from sluice.api.group_commit import GroupCommit


def wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_lone_submit_writes_at_once_and_alone():
    groups = []
    commit = GroupCommit(lambda group: groups.append(group) or {})
    commit.submit("a")
    commit.submit("b")
    assert groups == [["a"], ["b"]]


def test_submits_during_a_write_share_the_next_groups_and_get_their_own_errors():
    groups, release = [], threading.Event()

    def write(group):
        groups.append(group)
        if len(groups) == 1:
            assert release.wait(5)
        return {i: ValueError(item) for i, item in enumerate(group) if item % 2}

    commit = GroupCommit(write, max_group=25)
    results: dict[int, str] = {}

    def submit(n):
        try:
            commit.submit(n)
            results[n] = "ok"
        except ValueError as exc:
            results[n] = f"error {exc}"

    # Daemons: a broken hand-off leaves submits waiting for ever, and the test
    # must fail, not keep the interpreter from exiting.
    first = threading.Thread(target=submit, args=(0,), daemon=True)
    first.start()
    wait_for(lambda: len(groups) == 1)  # the first write is in progress
    others = [threading.Thread(target=submit, args=(n,), daemon=True) for n in range(1, 31)]
    for t in others:
        t.start()
    wait_for(lambda: len(commit._pending) == 30)
    release.set()
    for t in [first, *others]:
        t.join(5)
        assert not t.is_alive()
    assert [len(g) for g in groups] == [1, 25, 5]
    assert sorted(x for g in groups for x in g) == list(range(31))
    assert results == {n: (f"error {n}" if n % 2 else "ok") for n in range(31)}


def test_a_write_that_raises_fails_its_group_only():
    calls = []

    def write(group):
        calls.append(group)
        if len(calls) == 1:
            raise ConnectionError("table down")
        return {}

    commit = GroupCommit(write)
    with pytest.raises(ConnectionError):
        commit.submit("a")
    commit.submit("b")
    assert calls == [["a"], ["b"]]
