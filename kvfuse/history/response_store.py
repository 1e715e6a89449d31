"""Stored responses of the Responses API: what ``previous_response_id`` resolves to.

A stored response is the response body as it was returned, the conversation up to and including
its answer (``history``: role/content messages, without ``instructions``, which OpenAI does not
carry over), the input items of its request, and the exact ids its KV holds: the engine's history
record (``kvfuse.history.records``), serialized with its entries' keys. A follow-up rebuilds its
messages from ``history`` and hands the record to the engine as a hint, so the stored KV is found
whatever happened to the in-memory history index; ``usage.input_tokens_details.cached_tokens``
says how much was reused.

Rows live in SQLite (one file, e.g. ``<kvfuse home>/responses.sqlite3``; WAL mode and a busy
timeout, so several server processes may share it). Each belongs to the tenant that created it:
another tenant's lookup is a plain "not found", never a hint that it exists. Rows expire
``ttl_s`` after creation (``responses.ttl``): an expired row is gone at its next lookup or at a
periodic purge. The entries a response owns are the keys of its record; deleting or expiring a
response returns the keys no other stored response refers to, for the caller to free in the
tiers (a child response shares its parent's leading chunks, so those stay while either lives).
The clock is injectable (tests drive expiry without sleeping).

What a store holds is bounded: each row records its size, and ``put`` refuses (``StoreLimits``)
a response larger than ``max_response_bytes`` or one that would take its tenant past its count
or bytes; the server answers those with a 413.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfuse.private import make_dirs, touch

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    previous_id TEXT,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    history TEXT NOT NULL,
    record BLOB,
    size INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS responses_expiry ON responses(expires_at);
CREATE INDEX IF NOT EXISTS responses_tenant ON responses(tenant, created_at);
CREATE TABLE IF NOT EXISTS response_entries (
    response_id TEXT NOT NULL,
    key TEXT NOT NULL,
    PRIMARY KEY (response_id, key)
);
CREATE INDEX IF NOT EXISTS response_entries_key ON response_entries(key);
"""


# A store made before sizes were counted gets the column, filled from what its rows hold.
_ADD_SIZE = """
ALTER TABLE responses ADD COLUMN size INTEGER NOT NULL DEFAULT 0;
UPDATE responses SET size = length(CAST(body AS BLOB)) + length(CAST(input_items AS BLOB))
    + length(CAST(history AS BLOB)) + coalesce(length(record), 0);
"""
_SIZE_INDEX = "CREATE INDEX IF NOT EXISTS responses_tenant_size ON responses(tenant, size)"


@dataclass(frozen=True)
class StoreLimits:
    """What one response may take (``max_response_bytes``: its body, history, input items and
    record together) and what one tenant may keep (responses, bytes); None: no limit."""

    max_response_bytes: int | None = None
    tenant_responses: int | None = None
    tenant_bytes: int | None = None


class ResponseRefused(ValueError):
    """A response too large to store, or beyond its tenant's responses or bytes (a 413)."""


def over_limits(size: int, used_responses: int, used_bytes: int, limits: StoreLimits) -> str | None:
    """Why a response of ``size`` bytes may not join a tenant holding ``used_responses`` of
    ``used_bytes``, or None. Pure: the rule ``ResponseStore.put`` and the server's check share."""
    if limits.max_response_bytes is not None and size > limits.max_response_bytes:
        return (
            f"the response would be stored as {size} bytes, more than "
            f"responses.max_response_bytes ({limits.max_response_bytes})"
        )
    if limits.tenant_responses is not None and used_responses + 1 > limits.tenant_responses:
        return (
            f"the tenant already stores {used_responses} responses "
            f"(responses.tenant_max_responses = {limits.tenant_responses}): delete some"
        )
    if limits.tenant_bytes is not None and used_bytes + size > limits.tenant_bytes:
        return (
            f"the tenant's stored responses take {used_bytes} bytes; {size} more would pass "
            f"responses.tenant_max_bytes ({limits.tenant_bytes}): delete some"
        )
    return None


def stored_size(r: StoredResponse) -> int:
    """The bytes ``r`` takes in the store (its JSON columns and record)."""
    return (
        len(json.dumps(r.body).encode())
        + len(json.dumps(r.input_items).encode())
        + len(json.dumps(r.history).encode())
        + len(r.record or b"")
    )


# Expired responses removed per statement and transaction: SQLite bounds a statement's variables
# (250000 in Python's build), and one purge must not hold the store for long.
PURGE_BATCH = 500


class ResponseNotFound(KeyError):
    """No response with this id for this tenant (unknown, deleted, or another tenant's)."""


class ResponseExpired(ResponseNotFound):
    """The response existed but expired; it is removed now. ``keys``: its entries to free."""

    def __init__(self, response_id: str, keys: list[str]):
        super().__init__(response_id)
        self.keys = keys


@dataclass
class StoredResponse:
    """One stored response (see the module docstring)."""

    id: str
    tenant: str
    created_at: float
    body: dict[str, Any]
    history: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)
    previous_id: str | None = None
    record: bytes | None = None  # kvfuse.history.records.encode_record of its KV's history
    keys: list[str] = field(default_factory=list)  # the entries of that record
    expires_at: float | None = None


class ResponseStore:
    """Stored responses in SQLite at ``path`` (None: in memory, for tests and ``store`` off)."""

    def __init__(
        self,
        path: str | Path | None,
        ttl_s: float | None = 30 * 86400.0,
        clock: Callable[[], float] = time.time,
        purge_every_s: float = 60.0,
    ) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"the responses ttl must be > 0 seconds, got {ttl_s}")
        self.path = Path(path) if path is not None else None
        self.ttl_s = ttl_s
        self.clock = clock
        self.purge_every_s = purge_every_s
        self._last_purge = float("-inf")
        if self.path is not None:  # 0600 / 0700 (kvfuse.private): it holds conversations' text
            make_dirs(self.path.parent)
            # made 0600 before SQLite makes it 0644; SQLite gives its -wal and -shm files the
            # database file's mode
            touch(self.path)
        self._db = sqlite3.connect(
            str(self.path) if self.path is not None else ":memory:",
            timeout=10.0,
            check_same_thread=False,
            isolation_level=None,
        )
        self._lock = threading.Lock()
        with self._lock:
            if self.path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA busy_timeout=10000")
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
            if "size" not in columns:
                self._db.executescript(_ADD_SIZE)
            self._db.execute(_SIZE_INDEX)

    # -- writes ---------------------------------------------------------------------------------

    def put(self, r: StoredResponse, limits: StoreLimits = StoreLimits()) -> None:
        """Save ``r`` (its ``expires_at`` set from ``ttl_s`` when not given). ResponseRefused
        (nothing saved) when it is larger than ``limits`` allow, or its tenant's responses would
        pass theirs."""
        if r.expires_at is None and self.ttl_s is not None:
            r.expires_at = r.created_at + self.ttl_s
        size = stored_size(r)
        with self._lock, self._tx():
            count, used = self._usage(r.tenant, r.id)
            if (why := over_limits(size, count, used, limits)) is not None:
                raise ResponseRefused(why)
            self._db.execute(
                "INSERT OR REPLACE INTO responses (id, tenant, created_at, expires_at, "
                "previous_id, body, input_items, history, record, size) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    r.id,
                    r.tenant,
                    r.created_at,
                    r.expires_at,
                    r.previous_id,
                    json.dumps(r.body),
                    json.dumps(r.input_items),
                    json.dumps(r.history),
                    r.record,
                    size,
                ),
            )
            self._db.execute("DELETE FROM response_entries WHERE response_id = ?", (r.id,))
            self._db.executemany(
                "INSERT OR IGNORE INTO response_entries VALUES (?, ?)",
                [(r.id, k) for k in dict.fromkeys(r.keys)],
            )

    def usage(self, tenant: str) -> tuple[int, int]:
        """The tenant's stored responses and their bytes (expired ones not yet purged count)."""
        with self._lock:
            return self._usage(tenant)

    def _usage(self, tenant: str, but: str | None = None) -> tuple[int, int]:
        count, used = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses WHERE tenant = ? AND id != ?",
            (tenant, but or ""),
        ).fetchone()
        return count, used

    def delete(self, tenant: str, response_id: str) -> list[str]:
        """Remove the tenant's response; the keys of its entries that no other response refers to
        (to free). ResponseNotFound if the tenant has no such response."""
        with self._lock, self._tx():
            row = self._db.execute(
                "SELECT tenant FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
            if row is None or row[0] != tenant:
                raise ResponseNotFound(response_id)
            return self._remove([response_id])

    def purge(self, force: bool = True) -> tuple[int, list[str]]:
        """Remove every expired response: how many, and the keys to free. Without ``force`` only
        when ``purge_every_s`` passed since the last purge."""
        now = self.clock()
        if not force and now - self._last_purge < self.purge_every_s:
            return 0, []
        self._last_purge = now
        removed, free = 0, []
        while True:  # in batches: one statement's variables are bounded, and so is each lock hold
            with self._lock, self._tx():
                ids = [
                    r[0]
                    for r in self._db.execute(
                        "SELECT id FROM responses WHERE expires_at IS NOT NULL AND expires_at <= ? "
                        "LIMIT ?",
                        (now, PURGE_BATCH),
                    )
                ]
                if not ids:
                    return removed, free
                removed += len(ids)
                free += self._remove(ids)

    def _remove(self, ids: list[str]) -> list[str]:
        """Delete rows ``ids`` (inside a transaction); the keys only they referred to."""
        marks = ",".join("?" * len(ids))
        keys = [
            r[0]
            for r in self._db.execute(
                f"SELECT DISTINCT key FROM response_entries WHERE response_id IN ({marks})", ids
            )
        ]
        self._db.execute(f"DELETE FROM response_entries WHERE response_id IN ({marks})", ids)
        self._db.execute(f"DELETE FROM responses WHERE id IN ({marks})", ids)
        free = []
        for k in keys:
            if (
                self._db.execute(
                    "SELECT 1 FROM response_entries WHERE key = ? LIMIT 1", (k,)
                ).fetchone()
                is None
            ):
                free.append(k)
        return free

    # -- reads ----------------------------------------------------------------------------------

    def get(self, tenant: str, response_id: str) -> StoredResponse:
        """The tenant's response. ResponseNotFound (unknown, or another tenant's), ResponseExpired
        (removed now: its ``keys`` are to be freed)."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
            if row is None or row[1] != tenant:
                raise ResponseNotFound(response_id)
            r = self._row(row)
            if r.expires_at is not None and r.expires_at <= self.clock():
                with self._tx():
                    keys = self._remove([response_id])
                raise ResponseExpired(response_id, keys)
            r.keys = [
                k
                for (k,) in self._db.execute(
                    "SELECT key FROM response_entries WHERE response_id = ?", (response_id,)
                )
            ]
            return r

    def list(self, tenant: str | None = None, limit: int = 100) -> list[StoredResponse]:
        """The newest ``limit`` responses (of ``tenant``, or of everyone), newest first."""
        query, args = "SELECT * FROM responses", []
        if tenant is not None:
            query, args = query + " WHERE tenant = ?", [tenant]
        with self._lock:
            rows = self._db.execute(
                query + " ORDER BY created_at DESC LIMIT ?", [*args, limit]
            ).fetchall()
        return [self._row(r) for r in rows]

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    @staticmethod
    def _row(row) -> StoredResponse:
        rid, tenant, created, expires, previous, body, items, history, record = row[:9]
        return StoredResponse(
            rid,
            tenant,
            created,
            json.loads(body),
            json.loads(history),
            json.loads(items),
            previous,
            record,
            [],
            expires,
        )

    def _tx(self):
        return _Transaction(self._db)

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an exception), for a connection in autocommit mode."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, value, tb) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
