"""Reaping and lock-history statements, per dialect (part of :mod:`taskguard.dialects`)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import (
    Float,
    String,
    bindparam,
    insert,
    literal,
    literal_column,
    or_,
    select,
    text,
    union_all,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import func

from taskguard.dialects._parts import (
    EV,
    HOLDER_COLS,
    PG_QUICK_COMMIT,
    SQLITE_FMT,
    Flavor,
    Statement,
    compile_for,
)

__all__ = ["PG_REAP_START", "HistorySQL", "history_statements"]

_EVENT_COLS = ("at", "key", "slot", "event", "owner", "token", "duration", *HOLDER_COLS, "detail")
#: Events that end a grant: after one of them a takeover is not "taken_over".
_ENDINGS = ("released", "lost", "force_released", "reaped", "taken_over")

# Reaping: delete rows whose lease ended more than `grace` ago, in batches, re-checking
# expiry in the DELETE itself. Returns (deleted, scanned, cursor); cursor is NULL when
# nothing was left to scan, else what the next batch passes as :after.
#
# PostgreSQL walks the heap in physical order from the cursor (a ctid: TID Range Scan,
# PostgreSQL 14+), locks up to :batch_size expired rows FOR UPDATE SKIP LOCKED (rows an
# acquirer or another reaper holds are skipped), and deletes exactly those row versions
# by ctid (one Tid Scan over the sorted array, no index lookups). A locked row cannot
# move or change before the transaction ends, so its ctid is stable; a row a takeover
# made live between snapshot and lock fails the re-check in LockRows and again in the
# DELETE. The ctid cursor is only a position: a row that moved behind it waits for the
# next run. A batch commits without waiting for the WAL flush: a crash that loses it
# only brings back rows that are still expired (and their events, with history on), and
# a durable acquire behind it no longer waits for the flush of 5,000 deletions.
_PG_REAP = """
WITH batch AS (
    SELECT array_agg(ctid) AS ids, count(*) AS scanned, max(ctid) AS last
    FROM (
        SELECT ctid FROM task_locks
        WHERE ctid > CAST(:after AS tid)
          AND expires_at <= statement_timestamp() - :grace * interval '1 second'
        LIMIT :batch_size
        FOR UPDATE SKIP LOCKED
    ) AS locked
), gone AS (
    DELETE FROM task_locks AS t
    WHERE t.ctid = ANY(CAST((SELECT ids FROM batch) AS tid[]))
      AND t.expires_at <= statement_timestamp() - :grace * interval '1 second'
    RETURNING t.key, t.slot, t.owner, t.token
){events}
SELECT (SELECT count(*) FROM gone), scanned, CAST(last AS text)
FROM batch, (SELECT {quick}) AS quick_commit
"""
#: Where the first PostgreSQL reap batch starts (item numbers begin at 1).
PG_REAP_START = "(0,0)"
_PG_REAP_EVENTS = """, events AS (
    INSERT INTO task_lock_events (at, key, slot, event, owner, token)
    SELECT statement_timestamp(), key, slot, 'reaped', owner, token FROM gone
)"""

# SQLite runs one writer at a time, so select-then-delete in one statement is atomic.
# It walks the primary key (keyset pagination: each batch reads only its own range).
_SQLITE_REAP = f"""
DELETE FROM task_locks
WHERE rowid IN (
    SELECT rowid FROM task_locks
    WHERE (key, slot) > (:after_key, :after_slot)
      AND expires_at <= strftime('{SQLITE_FMT}', 'now', :grace)
    ORDER BY key, slot
    LIMIT :batch_size
)
RETURNING key, slot, owner, token
"""
# History of a SQLite reap batch (no data-modifying CTEs there): the deleted rows,
# passed back as one JSON array.
_SQLITE_REAPED_EVENTS = f"""
INSERT INTO task_lock_events (at, key, slot, event, owner, token)
SELECT strftime('{SQLITE_FMT}', 'now'), json_extract(value, '$[0]'),
       json_extract(value, '$[1]'), 'reaped', json_extract(value, '$[2]'),
       json_extract(value, '$[3]')
FROM json_each(:rows)
"""


@dataclass(frozen=True, slots=True)
class HistorySQL:
    """Reaping and history statements compiled for one dialect."""

    reap_batch: Statement
    reap_batch_history: Statement
    #: SQLite only: a reap batch's history, in a second statement.
    reaped_events: Statement | None
    record_event: Statement
    record_acquired: Statement
    events: Statement
    trim_events: Statement


def history_statements(dialect: Dialect, fl: Flavor) -> HistorySQL:
    """Compile the reaping and history statements for ``dialect``."""
    pg = dialect.name == "postgresql"
    now = fl.now
    event_values = {
        "at": now,
        **{c: bindparam(c) for c in ("key", "slot", "event", "owner", "token")},
        # Given (waited), or measured by the database clock from `since` (held).
        "duration": func.coalesce(
            bindparam("duration", type_=Float), fl.since(fl.ts_bind("since"))
        ),
        **{c: bindparam(c) for c in (*HOLDER_COLS, "detail")},
    }
    record_event = insert(EV).values(**event_values)
    # A grant, plus "taken_over" for the slot's previous grant if that one ended
    # without release (its holder crashed, stalled or lost the lease). Both index
    # lookups walk (key, at) from the newest end.
    prev = (
        select(EV)
        .where(
            EV.c.key == bindparam("key"),
            EV.c.slot == bindparam("slot"),
            EV.c.event == literal_column("'acquired'"),
        )
        .order_by(EV.c.at.desc(), EV.c.id.desc())
        .limit(1)
        .subquery("p")
    )
    ended = EV.alias("e")
    taken_over = select(
        now,
        prev.c.key,
        prev.c.slot,
        literal("taken_over", String),
        prev.c.owner,
        prev.c.token,
        fl.since(prev.c.at),
        *(prev.c[c] for c in HOLDER_COLS),
        literal("lease expired without release; taken over by owner ", String)
        + bindparam("owner", type_=String),
    ).where(
        prev.c.owner != bindparam("owner"),
        ~select(ended.c.id)
        .where(
            ended.c.key == prev.c.key,
            ended.c.at >= prev.c.at,
            ended.c.owner == prev.c.owner,
            # Literals: a precompiled statement cannot expand an IN parameter.
            or_(*(ended.c.event == literal_column(f"'{e}'") for e in _ENDINGS)),
        )
        .exists(),
    )
    granted = select(*(event_values[c] for c in _EVENT_COLS))
    record_acquired = insert(EV).from_select(list(_EVENT_COLS), union_all(taken_over, granted))
    events = (
        select(*(EV.c[c] for c in ("id", *_EVENT_COLS)))
        .where(EV.c.key == bindparam("key"))
        .order_by(EV.c.at.desc(), EV.c.id.desc())
        .limit(bindparam("limit"))
    )
    old = select(EV.c.id).where(EV.c.at < fl.plus("keep")).order_by(EV.c.at)
    trim_events = EV.delete().where(
        EV.c.id.in_(old.limit(bindparam("batch_size")).scalar_subquery())
    )
    reap = _PG_REAP.format(events="", quick=PG_QUICK_COMMIT) if pg else _SQLITE_REAP
    reap_history = (
        _PG_REAP.format(events=_PG_REAP_EVENTS, quick=PG_QUICK_COMMIT) if pg else _SQLITE_REAP
    )
    return HistorySQL(
        reap_batch=compile_for(text(reap), dialect),
        reap_batch_history=compile_for(text(reap_history), dialect),
        reaped_events=None if pg else compile_for(text(_SQLITE_REAPED_EVENTS), dialect),
        record_event=compile_for(record_event, dialect),
        record_acquired=compile_for(record_acquired, dialect),
        events=compile_for(events, dialect),
        trim_events=compile_for(trim_events, dialect),
    )
