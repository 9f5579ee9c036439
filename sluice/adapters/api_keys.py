"""API keys, stored as SHA-256 hashes with their tenant id."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict

from botocore.exceptions import ClientError

from sluice.aws import client
from sluice.contract import ApiKeyRecord, now_ms
from sluice.settings import Settings

KEY_PREFIX = "sk_"
# Unknown keys are remembered briefly and apart from known ones: enough to spare
# the table a client retrying a bad key, too little for guesses to crowd out
# valid keys, and a key created meanwhile works within seconds.
UNKNOWN_TTL_S = 2.0
UNKNOWN_CACHE_SIZE = 1_000


_MISS = object()

# A tenant id names who owns tasks: an empty one (an unset $TEAM in a script),
# spaces or slashes would make tenants by accident, or two that look alike.
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_tenant(tenant_id: str) -> str:
    """The tenant id if it is 1-64 letters, digits, '_', '.' or '-', starting
    with a letter or digit; else ValueError."""
    if not isinstance(tenant_id, str) or not _TENANT.fullmatch(tenant_id):
        raise ValueError(f"tenant {tenant_id!r}: must be 1-64 letters, digits, '_', '.' or '-', "
                         "starting with a letter or digit")
    return tenant_id


def _valid(record: ApiKeyRecord | None, digest: str) -> ApiKeyRecord | None:
    # The lookup is by hash; the compare is constant-time anyway so that no
    # timing difference depends on how much of a guessed key matched.
    if record is None or record.revoked or not hmac.compare_digest(record.key_hash, digest):
        return None
    return record


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def carriable(key: str) -> bool:
    """Whether a request can carry the key: the API reads a header's bytes as
    Latin-1 and strips its ends, and keys are stored by the hash of their
    UTF-8 bytes, so any other key would be answered 403 however it was sent."""
    return key.isascii() and key.isprintable() and key == key.strip()


class ApiKeys:
    def __init__(self, settings: Settings, cache_size: int = 10_000):
        self.table = settings.keys_table
        self.ddb = client("dynamodb", settings)
        self.cache_ttl_s = settings.key_cache_s
        self.cache_size = cache_size
        # Least recently used first: past its size, the oldest entry goes.
        self._known: OrderedDict[str, tuple[float, ApiKeyRecord]] = OrderedDict()
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, tenant_id: str, key: str | None = None) -> tuple[str, ApiKeyRecord]:
        check_tenant(tenant_id)
        if key is not None and not carriable(key):
            raise ValueError("an API key is printable ASCII without spaces at either end")
        key = key or KEY_PREFIX + secrets.token_urlsafe(32)
        record = ApiKeyRecord(
            key_hash=hash_key(key), tenant_id=tenant_id, key_id=secrets.token_hex(8), created_at=now_ms()
        )
        item = {
            "key_hash": {"S": record.key_hash},
            "tenant_id": {"S": record.tenant_id},
            "key_id": {"S": record.key_id},
            "created_at": {"N": str(record.created_at)},
            "revoked": {"BOOL": False},
        }
        try:
            self.ddb.put_item(TableName=self.table, Item=item, ConditionExpression="attribute_not_exists(key_hash)")
        except ClientError as err:
            # Re-registering the same key (make run with a fixed SLUICE_API_KEY) keeps its tenant.
            if err.response["Error"]["Code"] != "ConditionalCheckFailedException":
                raise
            existing = self._load(record.key_hash)
            if existing is None or existing.tenant_id != tenant_id:
                raise ValueError("this key is already registered to another tenant") from None
            if existing.revoked:
                raise ValueError("this key was revoked: choose another") from None
            return key, existing
        return key, record

    def revoke(self, key_or_id: str) -> ApiKeyRecord:
        """Revoke a key given itself or its id (what `create` prints; an
        operator seldom holds the secret). Raises LookupError if there is none.
        Anything not shaped like a generated key is looked up as an id first,
        then as a key: one registered as given (make run's SLUICE_API_KEY)
        need not start with KEY_PREFIX."""
        if key_or_id.startswith(KEY_PREFIX):
            digest, named = hash_key(key_or_id), "no such API key"
        else:
            digest = self._hash_of_id(key_or_id) or hash_key(key_or_id)
            named = f"no API key with id or value {key_or_id}"
        try:
            item = self.ddb.update_item(
                TableName=self.table,
                Key={"key_hash": {"S": digest}},
                UpdateExpression="SET revoked = :t",
                ConditionExpression="attribute_exists(key_hash)",
                ExpressionAttributeValues={":t": {"BOOL": True}},
                ReturnValues="ALL_NEW",
            )["Attributes"]
        except ClientError as err:
            if err.response["Error"]["Code"] == "ConditionalCheckFailedException":
                raise LookupError(named) from None
            raise
        with self._lock:
            self._known.pop(digest, None)
        return _record(item)

    def _hash_of_id(self, key_id: str) -> str | None:
        # Keys are stored by hash alone: an id is found by a scan, fine for an
        # operator's command on a table of one item per key.
        for page in self.ddb.get_paginator("scan").paginate(
            TableName=self.table, FilterExpression="key_id = :id",
            ExpressionAttributeValues={":id": {"S": key_id}}, ProjectionExpression="key_hash",
        ):
            for item in page.get("Items", []):
                return item["key_hash"]["S"]
        return None

    def authenticate(self, key: str) -> ApiKeyRecord | None:
        """The key's record if it is known and not revoked; else None."""
        digest = hash_key(key)
        cached = self._cached(digest)
        if cached is _MISS:
            cached = self._load(digest)
            self._remember(digest, cached)
        return _valid(cached, digest)

    def authenticate_cached(self, key: str) -> ApiKeyRecord | None:
        """As authenticate, from the cache alone; raises LookupError when the
        key must be read from the table (a call an event loop must not make)."""
        digest = hash_key(key)
        cached = self._cached(digest)
        if cached is _MISS:
            raise LookupError("not cached")
        return _valid(cached, digest)

    def _cached(self, digest: str):
        now = time.monotonic()
        with self._lock:
            known = self._known.get(digest)
            if known and now - known[0] < self.cache_ttl_s:
                self._known.move_to_end(digest)
                return known[1]
            unknown_at = self._unknown.get(digest)
            if unknown_at is not None and now - unknown_at < min(self.cache_ttl_s, UNKNOWN_TTL_S):
                return None
        return _MISS

    def _remember(self, digest: str, record: ApiKeyRecord | None) -> None:
        entries, size = (self._unknown, UNKNOWN_CACHE_SIZE) if record is None else (self._known, self.cache_size)
        with self._lock:
            entries[digest] = time.monotonic() if record is None else (time.monotonic(), record)
            entries.move_to_end(digest)
            while len(entries) > size:
                entries.popitem(last=False)

    def _load(self, digest: str) -> ApiKeyRecord | None:
        item = self.ddb.get_item(TableName=self.table, Key={"key_hash": {"S": digest}}, ConsistentRead=True).get("Item")
        return _record(item) if item else None


def _record(item: dict) -> ApiKeyRecord:
    return ApiKeyRecord(
        key_hash=item["key_hash"]["S"],
        tenant_id=item["tenant_id"]["S"],
        key_id=item["key_id"]["S"],
        created_at=int(item["created_at"]["N"]),
        revoked=item.get("revoked", {}).get("BOOL", False),
    )
