"""SQLite (the standard library's sqlite3): everything taskguard does differently here.

* One writer at a time: a statement that reads then writes is atomic, so the
  lowest free slot is exact and a token can be read from a one-row high-water
  mark (``task_locks_token_counter``, raised by a trigger to every token written).
* Clock: ``strftime(..., 'now')``, fixed within one statement; timestamps are text
  in the layout SQLAlchemy uses for DateTime, so they compare in order.
* Files use WAL and a busy timeout so several processes can share one; an
  in-memory database is one connection shared by every thread, taking turns.
* No LISTEN/NOTIFY: waiters poll.
* Fencing is a no-op write that takes the database's write lock for the rest of
  the caller's transaction: no other writer, hence no takeover, until it ends.
"""

from __future__ import annotations

import sqlite3
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import (
    URL,
    ColumnElement,
    Engine,
    Executable,
    String,
    Table,
    bindparam,
    event,
    literal,
    literal_column,
    update,
)
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql import func

from taskguard.dialects.base import (
    RESERVE_GRACE,
    Dialect,
    Driver,
    ErrorKind,
    Flavor,
    ReapStep,
    T,
)
from taskguard.models import SQLITE_TOKEN_TABLE

__all__ = ["SQLite"]

#: Same text layout SQLAlchemy uses for DateTime.
FMT = "%Y-%m-%d %H:%M:%f000"
# SQLite waits this long for another process's write to finish before giving up.
BUSY_TIMEOUT = 30.0

_ACQUIRE_SLOTS = """
WITH RECURSIVE s(slot) AS (SELECT 0 UNION ALL SELECT slot + 1 FROM s WHERE slot + 1 < :n)
INSERT INTO task_locks ({cols})
SELECT :key, s.slot, :owner, (SELECT value + 1 FROM {counter}), {now}, {plus_ttl},
       :task_name, :task_id, :hostname, :pid, :phase, :n
FROM s
WHERE NOT EXISTS (
    SELECT 1 FROM task_locks AS t WHERE t.key = :key AND t.slot = s.slot AND NOT ({free_t})
)
ORDER BY s.slot LIMIT 1
ON CONFLICT (key, slot) DO UPDATE SET {takeover}
WHERE {free_row}
RETURNING slot, token, acquired_at, expires_at
"""

# Select-then-delete in one statement is atomic here. Walks the primary key (keyset
# pagination: each batch reads only its own range); :grace is a negative modifier.
_REAP = f"""
DELETE FROM task_locks
WHERE rowid IN (
    SELECT rowid FROM task_locks
    WHERE (key, slot) > (:after_key, :after_slot)
      AND expires_at <= strftime('{FMT}', 'now', :grace)
    ORDER BY key, slot
    LIMIT :batch_size
)
RETURNING key, slot, owner, token
"""
# History of a reap batch (no data-modifying CTEs here): the deleted rows, passed
# back as one JSON array.
_REAPED_EVENTS = f"""
INSERT INTO task_lock_events (at, key, slot, event, owner, token)
SELECT strftime('{FMT}', 'now'), json_extract(value, '$[0]'),
       json_extract(value, '$[1]'), 'reaped', json_extract(value, '$[2]'),
       json_extract(value, '$[3]')
FROM json_each(:rows)
"""
_OUTAGE = ("unable to open", "disk i/o", "database is full")


def _is_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:")


class SQLite(Dialect):
    name = "sqlite"
    label = "SQLite"
    drivers = {"pysqlite": Driver("sqlite3", "sqlite", "Python's sqlite3 module")}
    naive_timestamps = True
    statement_errors = (sqlite3.IntegrityError, sqlite3.DataError, sqlite3.ProgrammingError)
    acquire_slots_sql = _ACQUIRE_SLOTS
    takeover_token_sql = "excluded.token"
    connect_timeout_floor = None  # a local file: nothing to wait for

    def flavor(self) -> Flavor:
        fmt: ColumnElement[str] = literal_column(f"'{FMT}'")
        now_sql = f"strftime('{FMT}', 'now')"
        grace = f"strftime('{FMT}', 'now', '-{RESERVE_GRACE:.3f} seconds')"
        # Durations are '+1.500 seconds' modifier strings (seconds_param).
        return Flavor(
            now=func.strftime(fmt, literal_column("'now'")),
            now_sql=now_sql,
            plus=lambda p: func.strftime(fmt, literal_column("'now'"), bindparam(p)),
            plus_sql=lambda p: f"strftime('{FMT}', 'now', :{p})",
            add=lambda col, p: func.strftime(fmt, col, bindparam(p)),
            since=lambda col: (
                (func.julianday(literal_column("'now'")) - func.julianday(col)) * literal(86400.0)
            ),
            greatest=func.max,
            grace_ago=literal_column(grace),
            grace_ago_sql=grace,
            ts_bind=lambda n: bindparam(n, type_=String),
        )

    def insert(self, table: Table) -> Any:
        return sqlite_dialect.insert(table)

    def token_insert(self) -> ColumnElement[Any]:
        # One writer at a time: reading the high-water mark inside the statement is safe.
        return literal_column(f"(SELECT value + 1 FROM {SQLITE_TOKEN_TABLE})")

    def token_takeover(self, ins: Any) -> ColumnElement[Any]:
        return ins.excluded.token  # type: ignore[no-any-return]

    def reap_sql(self, history: bool) -> str:
        return _REAP

    def reaped_events_sql(self) -> str:
        return _REAPED_EVENTS

    def fence_statement(self) -> Executable:
        t = T
        return (
            update(t)
            .where(
                t.c.key == bindparam("lease_key"),
                t.c.slot == bindparam("lease_slot"),
                t.c.owner == bindparam("lease_owner"),
                t.c.expires_at > self.flavor().now,
            )
            .values(expires_at=t.c.expires_at)
            .returning(t.c.token)
        )

    def to_datetime(self, value: Any) -> datetime:
        dt = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
        return dt.replace(tzinfo=timezone.utc) if dt.tzinfo is None else dt.astimezone(timezone.utc)

    def seconds_param(self, seconds: float) -> str:
        return f"{seconds:+.3f} seconds"

    def ts_param(self, value: datetime) -> str:
        return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")

    def engine_options(self, url: URL, options: dict[str, Any]) -> None:
        connect_args = options.setdefault("connect_args", {})
        connect_args.setdefault("timeout", BUSY_TIMEOUT)
        if _is_memory(url):
            # One shared in-memory database for every thread of the process.
            connect_args.setdefault("check_same_thread", False)
            options.setdefault("poolclass", StaticPool)

    def configure_engine(self, engine: Engine, url: URL, *, durable: bool) -> None:
        if _is_memory(url):
            return

        @event.listens_for(engine, "connect")
        def _wal(dbapi_conn: Any, _record: Any) -> None:
            # WAL persists in the file, so only the first connection ever switches. The
            # switch needs an exclusive lock and ignores the busy timeout: processes
            # opening a freshly migrated file together must take turns, not fail.
            cur = dbapi_conn.cursor()
            try:
                deadline = time.monotonic() + BUSY_TIMEOUT
                while cur.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    try:
                        cur.execute("PRAGMA journal_mode=WAL")
                    except sqlite3.OperationalError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.01)
            finally:
                cur.close()

    def missing_database(self, url: URL) -> str | None:
        if _is_memory(url) or "uri" in url.query:
            return None
        path = Path(str(url.database))
        if path.exists():
            return None
        return (
            f"no SQLite database at {str(path.resolve())!r}: check the path, or create it "
            "with taskguard db upgrade"
        )

    def serializes_threads(self, url: URL) -> bool:
        return _is_memory(url)

    def classify(self, exc: BaseException, text: str) -> ErrorKind | None:
        low = text.lower()
        if "no such column" in low:
            return ErrorKind.SCHEMA_OLD
        if "no such table" in low:
            return ErrorKind.SCHEMA_MISSING
        if "readonly database" in low or "permission denied" in low:
            return ErrorKind.PERMISSION
        if "database is locked" in low:
            return ErrorKind.LOCKED
        if any(marker in low for marker in _OUTAGE):
            return ErrorKind.OUTAGE
        return None

    def reap_start(self) -> dict[str, Any]:
        return {"after_key": "", "after_slot": -1}

    def reap_step(self, rows: list[tuple[Any, ...]], after: dict[str, Any]) -> ReapStep:
        if rows:
            last_key, last_slot = max((r[0], r[1]) for r in rows)
            after = {"after_key": str(last_key), "after_slot": int(last_slot)}
        return ReapStep(len(rows), len(rows), after, rows)
