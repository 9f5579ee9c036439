"""DynamoDB tasks table.

Every status change is a conditional write, so a task only moves forward and a
duplicate delivery can never overwrite a finished result. Each update is a
Change, checked against the contract when it is made: it names only TaskRecord
fields, and its condition admits only statuses from which the contract's
ALLOWED_TRANSITIONS allow its new status (none that is final, for a change
that keeps the status). A batch's changes are
independent conditional UpdateItem calls issued in parallel, not one
TransactWriteItems: no change needs another to succeed, transactions cost twice
the write capacity on AWS, and moto's implementation copies the whole table on
every call and restores that copy on failure, reverting concurrent writers.
So one change's failed call (a throttle past the SDK's retries) is its own:
apply_each makes every other change all the same and says which failed.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from boto3.dynamodb.types import TypeDeserializer, TypeSerializer
from botocore.exceptions import ClientError
from pydantic import ValidationError

from sluice.aws import client
from sluice.contract import TaskRecord, TaskStatus, can_transition
from sluice.settings import Settings

_ser = TypeSerializer()
_de = TypeDeserializer()
_BATCH_WRITE_LIMIT = 25


class TaskExists(Exception):
    def __init__(self, existing: TaskRecord):
        super().__init__(existing.task_id)
        self.existing = existing


class Unprocessed(RuntimeError):
    """DynamoDB still left part of a batch unprocessed after every retry: its
    answer to throttling, so the table is busy (the API answers 503), not the
    request wrong."""


class TransitionRejected(Exception):
    """The task was not in a status that allows the requested change."""

    def __init__(self, current: TaskRecord | None):
        super().__init__(current.status.value if current else "missing")
        self.current = current


def to_item(record: TaskRecord) -> dict[str, Any]:
    plain = record.model_dump(mode="json", exclude_none=True)
    return {k: _ser.serialize(v) for k, v in plain.items()}


class UnreadableRecord(ValueError):
    """A record this release cannot read: a newer one wrote it (a status or a
    priority it adds), during a deploy or after a rollback. Never taken for a
    final or a missing task: left for a release that can read it."""

    def __init__(self, item: dict[str, Any], reason: str):
        self.task_id = item.get("task_id", {}).get("S")
        self.tenant_id = item.get("tenant_id", {}).get("S")  # whose it is: another tenant gets a 404
        self.status = item.get("status", {}).get("S")
        super().__init__(f"task {self.task_id}'s record is one this release cannot read: {reason}")


def from_item(item: dict[str, Any]) -> TaskRecord:
    try:
        return TaskRecord.model_validate({k: _plain(v) for k, v in item.items()})
    except ValidationError as exc:
        raise UnreadableRecord(item, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                               for e in exc.errors()[:3])) from None


def _plain(value: dict[str, Any]) -> Any:
    """One attribute's value as the record holds it."""
    plain = _de.deserialize(value)
    if hasattr(plain, "to_integral_value"):  # Decimal -> int; the record has no floats
        return int(plain)
    return plain


_SETTABLE = frozenset(TaskRecord.model_fields) - {"task_id"}  # the key is never updated
_REMOVABLE = frozenset(name for name, f in TaskRecord.model_fields.items() if not f.is_required())


@dataclass
class Change:
    """One conditional update: set values, optionally add to the attempts
    (True adds one; -1 takes back a start that ran nothing), only from the
    given statuses. Raises ValueError when made against the contract (see the
    module's docstring): a mistake in the code, never a race.

    `returns_old`: the values it replaced come back with the same call
    (Applied.replaced), for a change that may have to be undone.
    `only_if`: values the record must hold as well (the undoing of a change
    made only while the record still shows it).
    `token`: a value unique to this change, written with it (the record's
    `claim_token`) and required not to be there already. The SDK resends a
    write whose answer was lost (a 5xx, a read timeout); were the first send
    applied, a resend of a change that adds an attempt would add it again.
    With a token the resend is refused, and apply_each knows it as landed.

    A change to a final status sets `finished_at`, and the store renews the
    record's TTL from it (`expires_at`, see `update`): every final outcome,
    whoever writes it (a worker, a cancel, an expiry, dead-letter settling),
    is kept for the result TTL from finishing, however long its task waited."""

    task_id: str
    set_values: dict[str, Any]
    allowed_from: tuple[TaskStatus, ...]
    add_attempt: int = 0
    remove: tuple[str, ...] = ()
    returns_old: bool = False
    only_if: dict[str, Any] = field(default_factory=dict)
    token: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None and "claim_token" in self.set_values.keys() | self.only_if.keys():
            raise ValueError("claim_token is the change's token: pass it as token")
        unknown = ((self.set_values.keys() | self.only_if.keys()) - _SETTABLE) | (set(self.remove) - _REMOVABLE)
        if unknown:
            raise ValueError(f"not task record fields that an update may change: {sorted(unknown)}")
        if not self.allowed_from:
            raise ValueError("a change applies from at least one status")
        target = self.set_values.get("status")
        if "expires_at" in self.set_values:
            raise ValueError("expires_at is the store's to set, from a final change's finished_at")
        if self.finishes and "finished_at" not in self.set_values:
            raise ValueError(f"a change to {target} sets finished_at")
        for source in self.allowed_from:
            if target is None:
                if source.is_terminal:
                    raise ValueError(f"a {source.value} task is final: its record is never written again")
            elif not can_transition(source, TaskStatus(target)):
                raise ValueError(f"no transition from {source.value} to {TaskStatus(target).value}")

    @property
    def finishes(self) -> bool:
        """Whether the change moves its task to a final status."""
        target = self.set_values.get("status")
        return target is not None and TaskStatus(target).is_terminal

    def written(self, result_ttl_s: int) -> dict[str, Any]:
        """The values the update sets: a final change's with its `expires_at`,
        one made with a token with its `claim_token`."""
        values = dict(self.set_values)
        if self.finishes:
            values["expires_at"] = self.set_values["finished_at"] // 1000 + result_ttl_s
        if self.token is not None:
            values["claim_token"] = self.token
        return values

    def update(self, table: str, result_ttl_s: int) -> dict[str, Any]:
        """The UpdateItem request; a final change's gets `expires_at`, the
        result TTL (seconds) from its `finished_at`."""
        names: dict[str, str] = {"#s": "status"}
        values: dict[str, Any] = {}
        sets = []
        for i, (attr, value) in enumerate(self.written(result_ttl_s).items()):
            names[f"#a{i}"] = attr
            values[f":v{i}"] = _ser.serialize(value)
            sets.append(f"#a{i} = :v{i}")
        expr = "SET " + ", ".join(sets) if sets else ""
        if self.add_attempt:
            expr += " ADD attempts :add"
            values[":add"] = {"N": str(int(self.add_attempt))}
        if self.remove:
            for j, attr in enumerate(self.remove):
                names[f"#r{j}"] = attr
            expr += " REMOVE " + ", ".join(f"#r{j}" for j in range(len(self.remove)))
        allowed = []
        for k, status in enumerate(self.allowed_from):
            values[f":from{k}"] = {"S": status.value}
            allowed.append(f":from{k}")
        condition = f"#s IN ({', '.join(allowed)})"
        for n, (attr, value) in enumerate(self.only_if.items()):
            names[f"#c{n}"] = attr
            values[f":c{n}"] = _ser.serialize(value)
            condition += f" AND #c{n} = :c{n}"
        if self.token is not None:
            names["#t"] = "claim_token"
            values[":t"] = _ser.serialize(self.token)
            condition += " AND (attribute_not_exists(#t) OR #t <> :t)"
        request = {
            "TableName": table,
            "Key": {"task_id": {"S": self.task_id}},
            "UpdateExpression": expr.strip(),
            "ConditionExpression": condition,
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
        }
        if self.returns_old:
            request["ReturnValues"] = "UPDATED_OLD"
        return request


@dataclass
class Applied:
    """What TaskStore.apply_each did with each change, by task id; a change in
    none of these was applied."""

    rejected: set[str] = field(default_factory=set)  # its condition failed: the record is left as it was
    # The call itself failed (throttled past the SDK's retries, a 5xx, no
    # answer). Whether it landed: see surely_not_applied.
    errored: dict[str, Exception] = field(default_factory=dict)
    # For an applied change made with returns_old: the values it replaced (an
    # attribute that was not set is absent). None for one whose answer was
    # lost, its resend refused by its token: they went with the lost answer.
    replaced: dict[str, dict[str, Any] | None] = field(default_factory=dict)


# DynamoDB's answers to a request over the table's or the account's throughput.
_THROTTLED = frozenset({"ProvisionedThroughputExceededException", "ThrottlingException", "RequestLimitExceeded"})


def throttled(exc: Exception) -> bool:
    """Whether DynamoDB refused the request for throughput (botocore's standard
    retry mode reads these codes as throttling too): it surely did not land."""
    return isinstance(exc, ClientError) and _code(exc) in _THROTTLED


def surely_not_applied(exc: Exception) -> bool:
    """Whether a write that raised surely did not land: DynamoDB throttled it,
    or answered it with another client error. After a 5xx or no answer at all
    (a timeout, a reset connection) it may have been applied."""
    if not isinstance(exc, ClientError):
        return False
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return throttled(exc) or (status is not None and status < 500)


class TaskStore:
    def __init__(self, settings: Settings, ddb=None):
        self.table = settings.tasks_table
        self.result_ttl_s = settings.result_ttl_days * 86400
        # A caller may bring its own client (tests that must bypass a proxy).
        self.ddb = ddb or client("dynamodb", settings)
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="sluice-ddb")

    def create(self, record: TaskRecord, token: str | None = None) -> None:
        """`token` names the submit that wrote the record; only that submit's
        compensation may delete it (see delete_if_queued)."""
        item = to_item(record.model_copy(update={"submit_token": token}) if token else record)
        # Twice at most. An emulator that does not return the existing record
        # (dynalite) has it read back, and a submit's rollback may delete it in
        # between: the id is then free again, so the put is tried afresh.
        for _ in range(2):
            try:
                self.ddb.put_item(
                    TableName=self.table,
                    Item=item,
                    # A record past its TTL is gone (see _outlived): its id is free.
                    ConditionExpression="attribute_not_exists(task_id) OR expires_at < :now",
                    ExpressionAttributeValues={":now": {"N": str(int(time.time()))}},
                    ReturnValuesOnConditionCheckFailure="ALL_OLD",
                )
                return
            except ClientError as err:
                if _code(err) != "ConditionalCheckFailedException":
                    raise
                old = err.response.get("Item") or self.ddb.get_item(
                    TableName=self.table, Key=_key(record.task_id), ConsistentRead=True
                ).get("Item")
                if old and not _outlived(old):
                    raise TaskExists(from_item(old)) from None
                vanished = err
        # Taken at each put and gone at each read: a table in flux, answered
        # like any failed write (the caller rolls back its own and answers 503).
        raise vanished

    def create_many(self, records: list[TaskRecord], token: str | None = None) -> None:
        """Write fresh records (their ids are new, so no condition is needed).
        Raises if any could not be written; the caller rolls back what was."""
        if token:
            records = [r.model_copy(update={"submit_token": token}) for r in records]
        for chunk in _chunks(records, _BATCH_WRITE_LIMIT):
            request = {self.table: [{"PutRequest": {"Item": to_item(r)}} for r in chunk]}
            left = _until_processed(
                lambda r: self.ddb.batch_write_item(RequestItems=r).get("UnprocessedItems") or {}, request)
            if left:
                raise Unprocessed(f"{len(left[self.table])} task records were not written")

    def get(self, task_id: str) -> TaskRecord | None:
        item = self.ddb.get_item(TableName=self.table, Key=_key(task_id), ConsistentRead=True).get("Item")
        return from_item(item) if item and not _outlived(item) else None

    def get_many(self, task_ids: Iterable[str],
                 unreadable: dict[str, UnreadableRecord] | None = None) -> dict[str, TaskRecord]:
        """The records that exist. One this release cannot read raises
        UnreadableRecord; given `unreadable`, it goes there instead, by task
        id, and the others are returned all the same."""
        records: dict[str, TaskRecord] = {}
        for item in self._batch_get(task_ids):
            if _outlived(item):
                continue
            try:
                records[item["task_id"]["S"]] = from_item(item)
            except UnreadableRecord as exc:
                if unreadable is None:
                    raise
                unreadable[item["task_id"]["S"]] = exc
        return records

    def statuses(self, task_ids: Iterable[str], created: Mapping[str, int] | None = None,
                 unknown: set[str] | None = None) -> dict[str, TaskStatus]:
        """Only the status of each task that exists: what a worker's claim
        reads for every batch, without a record's result, error or metadata.
        `created`: the created_at each record must have, by task id; a record
        of another (a later task under the same Idempotency-Key) is left out.
        `unknown`: gets the ids of records in a status this release does not
        know (left out of the answer, which must not read as missing)."""
        projection = {"ProjectionExpression": "task_id, #s, created_at, expires_at",
                      "ExpressionAttributeNames": {"#s": "status"}}
        found: dict[str, TaskStatus] = {}
        for item in self._batch_get(task_ids, projection):
            task_id = item["task_id"]["S"]
            if _outlived(item) or (created is not None and int(item["created_at"]["N"]) != created[task_id]):
                continue
            try:
                found[task_id] = TaskStatus(item["status"]["S"])
            except ValueError:
                if unknown is None:
                    raise UnreadableRecord(item, f"status {item['status']['S']!r}") from None
                unknown.add(task_id)
        return found

    def _batch_get(self, task_ids: Iterable[str], options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        ids = list(dict.fromkeys(task_ids))
        items: list[dict[str, Any]] = []
        for chunk in _chunks(ids, 100):
            request = {self.table: {"Keys": [_key(t) for t in chunk], "ConsistentRead": True, **(options or {})}}

            def read(r: dict) -> dict:
                response = self.ddb.batch_get_item(RequestItems=r)
                items.extend(response["Responses"].get(self.table, []))
                return response.get("UnprocessedKeys") or {}

            left = _until_processed(read, request)
            if left:
                raise Unprocessed(f"{len(left[self.table]['Keys'])} task records could not be read")
        return items

    def delete_if_queued(self, task_id: str, token: str | None = None) -> bool:
        """Compensation when a submit could not enqueue its message. With a
        token, only while no later submit (an idempotent retry) has claimed it.
        Returns whether a record stays (claimed since, or not `queued`); False
        when none is left, deleted now or never there, where a write that got
        no answer may land yet (sluice.api.service.Compensator)."""
        condition = "#s = :q"
        values = {":q": {"S": TaskStatus.queued.value}}
        if token:
            condition += " AND submit_token = :t"
            values[":t"] = {"S": token}
        for _ in range(3):
            try:
                self.ddb.delete_item(
                    TableName=self.table,
                    Key=_key(task_id),
                    ConditionExpression=condition,
                    ExpressionAttributeNames={"#s": "status"},
                    ExpressionAttributeValues=values,
                    ReturnValuesOnConditionCheckFailure="ALL_OLD",
                )
                return False
            except ClientError as err:
                if _code(err) != "ConditionalCheckFailedException":
                    raise
                # moto answers a missing record with an empty item; dynalite with none: read to tell.
                item = err.response.get("Item") or self.ddb.get_item(
                    TableName=self.table, Key=_key(task_id), ConsistentRead=True).get("Item")
                if not item:
                    return False
                ours = item.get("status") == values[":q"] and (not token or item.get("submit_token") == values[":t"])
                if not ours:
                    return True
                # Refused, yet the record is one it deletes: the write landed
                # between the condition and the read (a late one): again.
        return True

    def apply(self, change: Change) -> TaskRecord:
        """One conditional update; returns the new record or raises TransitionRejected."""
        request = change.update(self.table, self.result_ttl_s)
        request.pop("TableName")
        request.pop("ReturnValues", None)  # this call returns the whole new record
        try:
            response = self.ddb.update_item(
                TableName=self.table,
                ReturnValues="ALL_NEW",
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
                **request,
            )
        except ClientError as err:
            if _code(err) == "ConditionalCheckFailedException":
                item = err.response.get("Item")
                raise TransitionRejected(from_item(item) if item else self.get(change.task_id)) from None
            raise
        return from_item(response["Attributes"])

    def apply_many(self, changes: list[Change]) -> set[str]:
        """Apply independent conditional updates; returns the task ids whose
        condition failed (those are left untouched, the rest are applied).
        Every change is tried; then the first call that failed, if any, is
        raised (apply_each reports each change's fate instead)."""
        applied = self.apply_each(changes)
        if applied.errored:
            raise next(iter(applied.errored.values()))
        return applied.rejected

    def apply_each(self, changes: list[Change]) -> Applied:
        """Apply independent conditional updates, one call each, in parallel.
        One change's failed call is its own: every other change is still
        made, and the result says which ones were rejected or failed."""
        unique = list({c.task_id: c for c in changes}.values())
        if len(unique) == 1:
            results = [self._apply_one(unique[0])]
        else:
            # _apply_one never raises, so map cancels nothing and each change gets its call.
            results = list(self._pool.map(self._apply_one, unique))
        applied = Applied()
        for change, result in zip(unique, results):
            if result is _REJECTED:
                applied.rejected.add(change.task_id)
            elif isinstance(result, Exception):
                applied.errored[change.task_id] = result
            elif change.returns_old:
                applied.replaced[change.task_id] = None if result is _LANDED else {
                    k: _plain(v) for k, v in result.get("Attributes", {}).items()}
        return applied

    def _apply_one(self, change: Change) -> dict[str, Any] | Exception | object:
        """The UpdateItem's response, _REJECTED when its condition failed, or
        the exception its call raised."""
        try:
            return self.ddb.update_item(**change.update(self.table, self.result_ttl_s),
                                        ReturnValuesOnConditionCheckFailure="ALL_OLD")
        except ClientError as err:
            if _code(err) == "ConditionalCheckFailedException":
                try:
                    return _LANDED if self._landed(change, err) else _REJECTED
                except Exception as exc:  # noqa: BLE001 - the read that would tell failed: its fate is unknown
                    return exc
            return err
        except Exception as exc:  # noqa: BLE001 - no answer (a timeout, a reset): this change's fate alone
            return exc

    def _landed(self, change: Change, err: ClientError) -> bool:
        """Whether a change refused by its condition was refused by itself: the
        SDK resends a write whose answer was lost (a 5xx, a read timeout), and
        when the first send landed the resend finds the status it set. Read as
        "another run won", a worker would delete the result object the record
        now names. The record holds every value the change sets: it landed.
        One made with a token: the record holds the token, which only a send
        of this change could have written. Without one, a
        change that adds an attempt or returns the old values has effects a
        resend cannot show, so it stays refused."""
        if (change.add_attempt or change.returns_old) and change.token is None:
            return False
        item = err.response.get("Item")
        if item is None:  # an emulator that does not return it (dynalite)
            item = self.ddb.get_item(TableName=self.table, Key=_key(change.task_id), ConsistentRead=True).get("Item")
        if not item:
            return False
        if change.token is not None:
            return item.get("claim_token") == _ser.serialize(change.token)
        written = change.written(self.result_ttl_s).items()
        holds = all(attr in item and _plain(item[attr]) == _plain(_ser.serialize(value)) for attr, value in written)
        return holds and not any(attr in item for attr in change.remove)


_REJECTED = object()  # _apply_one's answer for a change whose condition failed
_LANDED = object()  # and for one whose resend it failed, the first send having landed (_landed)


DEADLINE_EXCEEDED = "deadline_exceeded"


def expire(task_id: str, now: int, created_at: int | None = None) -> Change:
    """A task past its deadline without an outcome: the claim of a worker (or
    the dispatcher), an outcome that came after the deadline and the API's
    read of the task write the same change.
    `created_at`: only the record of the task created then (a message's)."""
    # The error says why the task has no result; a cancelled task needs none (the client did it).
    return Change(task_id, {"status": TaskStatus.expired.value, "finished_at": now, "error_code": DEADLINE_EXCEEDED,
                            "error_message": "its deadline passed before it finished"}, (TaskStatus.queued,),
                  only_if={"created_at": created_at} if created_at is not None else {})


def _until_processed(send: Callable[[dict], dict], request: dict, tries: int = 6) -> dict:
    """Send a batch request, then what DynamoDB left unprocessed (its answer to
    throttling, not an error), backing off as the SDK would. Returns what is
    still unprocessed after `tries` sends."""
    for attempt in range(tries):
        request = send(request)
        if not request:
            break
        time.sleep(0.05 * 2**attempt)
    return request


def _outlived(item: dict[str, Any]) -> bool:
    """Whether the record is past its TTL. DynamoDB deletes such an item only
    some time later (up to a few days), and moto and dynalite never do: each read
    and the create treat it as deleted already, so a record lasts as long as
    its TTL says wherever Sluice runs."""
    expires_at = item.get("expires_at")
    # Whole seconds, as the create's condition compares: within the second a
    # record expires, both see it alike.
    return expires_at is not None and int(expires_at["N"]) < int(time.time())


def _key(task_id: str) -> dict[str, Any]:
    return {"task_id": {"S": task_id}}


def _code(err: ClientError) -> str:
    return err.response.get("Error", {}).get("Code", "")


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]
