"""PostgreSQL (psycopg 3): everything taskguard does differently here.

* Clock: ``statement_timestamp()``, never the transaction-frozen ``now()``.
* Tokens: the sequence ``task_locks_token_seq``; a takeover draws a fresh
  ``nextval`` while it holds the row lock, so it is above the replaced grant's.
* Releases and reap batches commit with ``synchronous_commit=off`` set inside the
  statement (no extra round trip): losing one in a crash only keeps a key taken
  until its expiry, and the next durable commit flushes it anyway.
* Waiters LISTEN on a dedicated connection; a trigger NOTIFYs only when a lease
  with waiters ends early.
* The reaper walks the heap by ctid (TID range scan, PostgreSQL 14+).
* Fencing reads the row ``FOR SHARE``: a takeover waits for the caller's commit.
* A refused acquire returns its holder in the same statement (a data-modifying
  CTE, :mod:`taskguard.dialects.postgresql_refusal`), except on connections that
  do not prepare statements (behind a pooler), where the plain acquire is sent.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from datetime import datetime, timezone
from typing import Any

import psycopg
from sqlalchemy import (
    URL,
    ColumnElement,
    Connection,
    DateTime,
    Engine,
    Executable,
    Float,
    Table,
    bindparam,
    event,
    literal_column,
    select,
    text,
)
from sqlalchemy.dialects import postgresql as pg
from sqlalchemy.engine import Dialect as SADialect
from sqlalchemy.sql import func

from taskguard.dialects import postgresql_refusal as refusal
from taskguard.dialects.base import (
    RESERVE_GRACE,
    Dialect,
    Driver,
    ErrorKind,
    Flavor,
    ReapStep,
    Statement,
    T,
    compile_for,
)
from taskguard.dialects.postgresql_connections import (
    ReleaseListener,
    backend_pid_is_real,
    prepare_when_direct,
    wait_cooperatively,
    warn_once,
    warn_pooled_once,
)
from taskguard.models import token_sequence

__all__ = ["PostgreSQL"]

log = logging.getLogger("taskguard")

_NOW = "statement_timestamp()"
#: Seconds libpq waits for a connection to open.
CONNECT_TIMEOUT = 10
#: Makes the statement's own (autocommit) transaction commit without waiting for the
#: WAL flush. Only for statements whose loss in a database crash is harmless.
QUICK_COMMIT = "set_config('synchronous_commit', 'off', true)"

# Concurrency limit. Prefer an expired row nobody else is claiming (SKIP LOCKED
# spreads concurrent acquirers over different rows), else a slot that has no row yet
# (picked at random to make collisions unlikely). A collision on a new slot loses
# the INSERT race: then `pick` has a row but `won` has none, which the caller reads
# as "retry once" rather than as a conflict.
_ACQUIRE_SLOTS = """
WITH expired AS MATERIALIZED (
    SELECT slot FROM task_locks AS t
    WHERE t.key = :key AND t.slot < :n AND {free_t}
    ORDER BY t.slot LIMIT 1
    FOR UPDATE SKIP LOCKED
), pick AS MATERIALIZED (
    SELECT c.slot FROM (
        SELECT slot, 0 AS pref FROM expired
        UNION ALL
        SELECT s.slot, 1 FROM generate_series(0, :n - 1) AS s(slot)
        WHERE NOT EXISTS (SELECT 1 FROM task_locks AS e WHERE e.key = :key AND e.slot = s.slot)
    ) AS c
    ORDER BY c.pref, random() LIMIT 1
), won AS (
    INSERT INTO task_locks AS task_locks ({cols})
    SELECT :key, pick.slot, :owner, nextval('task_locks_token_seq'), {now}, {plus_ttl},
           :task_name, :task_id, :hostname, :pid, :phase, :n
    FROM pick
    ON CONFLICT (key, slot) DO UPDATE SET {takeover}
    WHERE {free_row}
    RETURNING task_locks.slot, task_locks.token, task_locks.acquired_at, task_locks.expires_at
)
SELECT pick.slot, won.token, won.acquired_at, won.expires_at FROM pick LEFT JOIN won ON true
"""

#: Release a lease and take a marker key (e.g. "this task id finished") in one
#: statement: one round trip and one commit instead of two. rowcount is the release's.
#: Committed like a release, without waiting for the WAL flush: a durable commit
#: cost ~150 us more server CPU per task than the whole marker (measured, see
#: docs/evidence/benchmarks.md), and the next durable commit on the server (any grant)
#: flushes it too. Lost only if PostgreSQL crashes before that; then a late copy of
#: the finished task could run again, as without the record.
_RELEASE_MARKING = (
    """
WITH marked AS (
    INSERT INTO task_locks AS task_locks ({cols})
    VALUES (:mark_key, 0, :mark_owner, nextval('task_locks_token_seq'), {now}, {plus_mark_ttl},
            :task_name, :task_id, :hostname, :pid, NULL, 1)
    ON CONFLICT (key, slot) DO UPDATE SET {takeover}
    WHERE {free_row}
)
UPDATE task_locks SET expires_at = {now}
WHERE key = :key AND slot = :slot AND owner = :owner AND expires_at > {now}
  AND """
    + QUICK_COMMIT
    + """ IS NOT NULL
"""
)

# Reaping: delete rows whose lease ended more than `grace` ago (:grace is negative
# seconds), in batches, re-checking expiry in the DELETE itself. Returns (deleted,
# scanned, cursor); the cursor is what the next batch passes as :after.
#
# Walks the heap in physical order from the cursor (a ctid: TID Range Scan), locks up
# to :batch_size expired rows FOR UPDATE SKIP LOCKED (rows an acquirer or another
# reaper holds are skipped), and deletes exactly those row versions by ctid. A locked
# row cannot move or change before the transaction ends, so its ctid is stable; a row
# a takeover made live between snapshot and lock fails the re-check in LockRows and
# again in the DELETE. The ctid cursor is only a position: a row that moved behind it
# waits for the next run.
_REAP = """
WITH batch AS (
    SELECT array_agg(ctid) AS ids, count(*) AS scanned, max(ctid) AS last
    FROM (
        SELECT ctid FROM task_locks
        WHERE ctid > CAST(:after AS tid)
          AND expires_at <= statement_timestamp() + :grace * interval '1 second'
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    ) AS locked
), gone AS (
    DELETE FROM task_locks AS t
    WHERE t.ctid = ANY(CAST((SELECT ids FROM batch) AS tid[]))
      AND t.expires_at <= statement_timestamp() + :grace * interval '1 second'
    RETURNING t.key, t.slot, t.owner, t.token
){events}
SELECT (SELECT count(*) FROM gone), scanned, CAST(last AS text)
FROM batch, (SELECT {quick}) AS quick_commit
"""
_REAP_EVENTS = """, events AS (
    INSERT INTO task_lock_events (at, key, slot, event, owner, token)
    SELECT statement_timestamp(), key, slot, 'reaped', owner, token FROM gone
)"""
#: Where the first reap batch starts (item numbers begin at 1).
REAP_START = "(0,0)"

# SQLSTATE classes that mean "the server or the connection is in trouble" (retryable):
# connection exception, operator intervention, insufficient resources, system error,
# transaction rollback (serialization failure / deadlock).
_OUTAGE_CLASSES = ("08", "57", "53", "58", "40")


def _seconds(name: str) -> ColumnElement[Any]:
    return bindparam(name, type_=Float) * literal_column("interval '1 second'")


def _now() -> ColumnElement[Any]:
    return func.statement_timestamp(type_=DateTime(timezone=True))


#: (object, kind, privileges) the lock statements need; see docs/reliability.md,
#: "Least privilege". The history table and its sequence are opt-in: not checked.
_PRIVILEGES = (
    ("task_locks", "table", "SELECT, INSERT, UPDATE, DELETE"),
    ("task_locks_token_seq", "sequence", "USAGE"),
)

#: Executions before psycopg prepares a statement, above which a connection counts as
#: one that parses and plans every statement (:meth:`PostgreSQL.prepares`).
PREPARES_WITHIN = 100


class PostgreSQL(Dialect):
    name = "postgresql"
    label = "PostgreSQL"
    drivers = {
        "psycopg": Driver("psycopg", "postgresql+psycopg", "psycopg 3, installed with taskguard")
    }
    pins_connections = True
    relaxed_durability = True
    statement_errors = (psycopg.DataError, psycopg.IntegrityError, psycopg.ProgrammingError)
    acquire_slots_sql = _ACQUIRE_SLOTS
    takeover_token_sql = "nextval('task_locks_token_seq')"
    release_marking_sql = _RELEASE_MARKING
    lean_acquire = True

    def flavor(self) -> Flavor:
        grace = f"{_NOW} - interval '{RESERVE_GRACE} seconds'"
        return Flavor(
            now=_now(),
            now_sql=_NOW,
            plus=lambda p: _now() + _seconds(p),
            plus_sql=lambda p: f"{_NOW} + :{p} * interval '1 second'",
            add=lambda col, p: col + _seconds(p),
            since=lambda col: func.extract("epoch", _now() - col),
            greatest=func.greatest,
            grace_ago=literal_column(grace, DateTime(timezone=True)),
            grace_ago_sql=grace,
            ts_bind=lambda n: bindparam(n, type_=DateTime(timezone=True)),
        )

    def insert(self, table: Table) -> Any:
        return pg.insert(table)

    def token_insert(self) -> ColumnElement[Any]:
        return token_sequence.next_value()

    def reading_refusal(
        self, acquire: Any, fl: Flavor, unless: bool, sa_dialect: SADialect
    ) -> Statement:
        # Behind a pooler the longer statement's parse and plan on every execution
        # cost a grant more than the round trip it saves a refusal (measured: pairs
        # 15-25% slower): the plain acquire is sent there.
        reading = compile_for(refusal.reading_refusal(acquire, fl.now, unless), sa_dialect)
        return dataclasses.replace(reading, unprepared=compile_for(acquire, sa_dialect))

    def prepares(self, cursor: Any) -> bool:
        # None: never (behind a pooler); a threshold in the millions (a way to say
        # "never" without our direct-connection probe undoing it) is the same in effect.
        threshold = cursor.connection.prepare_threshold
        return threshold is not None and threshold <= PREPARES_WITHIN

    def granted(
        self, rows: list[tuple[Any, ...]], owner: str, slots: bool
    ) -> list[tuple[Any, ...]]:
        return rows if slots else refusal.granted_rows(rows)

    def holders(self, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return refusal.holder_rows(rows)

    def token_takeover(self, ins: Any) -> ColumnElement[Any]:
        # A fresh value taken while holding the row lock: above the replaced grant's.
        return token_sequence.next_value()

    def quick_commit(self) -> ColumnElement[bool]:
        # A plain condition, evaluated for the rows the statement matches (a no-op
        # elsewhere: a statement that changes nothing commits nothing). As a scalar
        # subquery it cost each release an InitPlan to set up: about 8,500 of its
        # server's instructions, 3% of a pair. Inline text: no extra parameters.
        return literal_column(QUICK_COMMIT).is_not(None)

    def reap_sql(self, history: bool) -> str:
        return _REAP.format(events=_REAP_EVENTS if history else "", quick=QUICK_COMMIT)

    def fence_statement(self) -> Executable:
        t = T
        return (
            select(t.c.token)
            .where(
                t.c.key == bindparam("lease_key"),
                t.c.slot == bindparam("lease_slot"),
                t.c.owner == bindparam("lease_owner"),
                t.c.expires_at > _now(),
            )
            .with_for_update(read=True)
        )

    def to_datetime(self, value: Any) -> datetime:
        assert isinstance(value, datetime)
        return value.astimezone(timezone.utc)

    def engine_options(self, url: URL, options: dict[str, Any]) -> None:
        if url.get_driver_name() != "psycopg":
            return
        options["connect_args"] = {**self.connect_args(url), **options.get("connect_args", {})}

    #: libpq rounds a shorter connect_timeout up to 2 seconds.
    connect_timeout_floor = 2

    def connect_args(self, url: URL) -> dict[str, Any]:
        """psycopg options for any engine taskguard creates (locks, migrations, checks).

        * ``prepare_threshold=None``: no named server-side prepared statement until
          the connection is known to be direct (see :meth:`configure_engine`).
          Through a transaction pooler (PgBouncer before 1.21, or without
          ``max_prepared_statements``) a name reaches whichever server connection
          the next transaction gets: "prepared statement "_pg3_0" does not exist",
          or another client's statement run with our parameters.
        * ``connect_timeout``: libpq would otherwise wait for the OS (minutes) on a
          host that does not answer.
        """
        return {"prepare_threshold": None, "connect_timeout": CONNECT_TIMEOUT}

    def missing_privileges(self, conn: Connection) -> list[str]:
        missing: list[str] = []
        for name, kind, privileges in _PRIVILEGES:
            fn = "has_table_privilege" if kind == "table" else "has_sequence_privilege"
            for privilege in privileges.split(", "):
                allowed = conn.execute(
                    text(f"SELECT {fn}(CAST(:name AS text), CAST(:priv AS text))"),
                    {"name": name, "priv": privilege},
                ).scalar()
                if not allowed:
                    missing.append(f"{privilege} on {kind} {name}")
        return missing

    def socket_of(self, dbapi_conn: Any) -> int | None:
        try:
            return int(dbapi_conn.pgconn.socket)
        except Exception:  # closed or broken: nothing to watch
            return None

    def configure_engine(self, engine: Engine, url: URL, *, durable: bool) -> None:
        if engine.dialect.driver == "psycopg":
            wait_cooperatively()
            event.listen(engine, "connect", prepare_when_direct)
        if durable:
            return

        @event.listens_for(engine, "connect")
        def _relaxed(dbapi_conn: Any, _record: Any) -> None:
            prev = dbapi_conn.autocommit
            dbapi_conn.autocommit = True
            try:
                with self.setting_up(dbapi_conn):
                    if not backend_pid_is_real(dbapi_conn):
                        # Behind a pooler a session SET lands on a shared server
                        # connection: it would make *other* clients' commits
                        # non-durable, and miss ours.
                        warn_once(
                            url,
                            "durable=False on %s ignored: the URL goes through a connection "
                            "pooler, where a session SET would leak to other clients",
                        )
                        return
                    dbapi_conn.execute("SET synchronous_commit TO off")
            finally:
                dbapi_conn.autocommit = prev

    def listener(self, engine: Engine, *, pooled_ok: bool = False) -> ReleaseListener | None:
        if engine.dialect.driver != "psycopg":
            return None
        listener = ReleaseListener(engine)
        if pooled_ok or not listener.pooled:
            return listener
        listener.close()
        warn_pooled_once(engine)
        return None

    def classify(self, exc: BaseException, text: str) -> ErrorKind | None:
        orig = getattr(exc, "orig", None)
        sqlstate = getattr(exc, "sqlstate", None) or getattr(orig, "sqlstate", None)
        low = text.lower()
        if sqlstate is None and "fatal:" in low:  # refused at connect (libpq's text)
            if re.search(r'fatal:\s+database ".*" does not exist', low):
                return ErrorKind.NO_DATABASE
            if "password authentication failed" in low or (
                "role" in low and "does not exist" in low
            ):
                return ErrorKind.LOGIN
        if sqlstate == "42703" or (
            sqlstate is None and "column" in low and "does not exist" in low
        ):
            # A column a newer migration adds: the code was deployed before the upgrade.
            return ErrorKind.SCHEMA_OLD
        if sqlstate == "42P01" or (
            "does not exist" in low and ("task_locks" in low or "relation" in low)
        ):
            return ErrorKind.SCHEMA_MISSING
        if sqlstate == "42501" or "permission denied" in low:
            return ErrorKind.PERMISSION
        if sqlstate is None:
            return None
        return ErrorKind.OUTAGE if sqlstate[:2] in _OUTAGE_CLASSES else ErrorKind.STATEMENT

    def reap_start(self) -> dict[str, Any]:
        return {"after": REAP_START}

    def reap_step(self, rows: list[tuple[Any, ...]], after: dict[str, Any]) -> ReapStep:
        deleted, scanned, last = rows[0]
        return ReapStep(
            int(deleted), int(scanned), after if last is None else {"after": str(last)}, []
        )
