"""Group commit for single submits.

Concurrent `POST /v1/tasks` calls in one API process are written together: one
BatchWriteItem for their records and one SendMessageBatch per queue for their
messages, instead of a PutItem and a SendMessage each. It adds no waiting: a
submit that finds no write in progress writes at once (alone, at low load);
submits that arrive during a write are taken together by the next one. Under
Lambda every invocation holds one request, so each writes alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

# BatchWriteItem takes 25 items per call.
MAX_GROUP = 25


@dataclass
class _Entry:
    item: Any
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    lead: bool = False  # handed the next write


class GroupCommit:
    def __init__(self, write: Callable[[list[Any]], dict[int, BaseException]], max_group: int = MAX_GROUP):
        """`write` takes a group and returns {index in the group: error} for the items it did not write."""
        self._write = write
        self._max_group = max_group
        self._lock = threading.Lock()
        self._pending: list[_Entry] = []
        self._writing = False

    def submit(self, item: Any) -> None:
        """Returns once the item is written; raises the error that kept it from being written."""
        entry = _Entry(item)
        with self._lock:
            self._pending.append(entry)
            lead = not self._writing
            self._writing = True
        if not lead:
            entry.done.wait()
            if not entry.lead:
                return self._result(entry)
        self._write_next()
        return self._result(entry)

    def _write_next(self) -> None:
        with self._lock:
            group = self._pending[: self._max_group]
            del self._pending[: self._max_group]
        errors: dict[int, BaseException] = {}
        try:
            errors = self._write([e.item for e in group])
        except Exception as exc:  # each submitter of the group gets the error
            errors = dict.fromkeys(range(len(group)), exc)
        except BaseException as exc:
            # An interrupt is re-raised by this thread alone; the others only
            # learn that their write did not happen.
            errors = {i: RuntimeError("the group write was interrupted") for i in range(len(group))}
            raise exc
        finally:
            with self._lock:
                if self._pending:
                    # The oldest waiting submit writes the next group.
                    successor = self._pending[0]
                    successor.lead = True
                    successor.done.set()
                else:
                    self._writing = False
            for i, e in enumerate(group):
                e.error = errors.get(i)
                e.lead = False
                e.done.set()

    @staticmethod
    def _result(entry: _Entry) -> None:
        if entry.error is not None:
            raise entry.error
