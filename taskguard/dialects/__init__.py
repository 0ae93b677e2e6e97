"""All lock SQL, per dialect, in one place.

Statements are built once with SQLAlchemy Core (or as text where Core cannot say
it), compiled for the engine's dialect, and executed as plain DBAPI calls by
:mod:`taskguard._db` (no per-call compilation or reflection on the hot path).

Invariants every dialect upholds:

* "now" is the database's clock, read per statement (PostgreSQL:
  ``statement_timestamp()``, never the transaction-frozen ``now()``; SQLite:
  ``'now'``, fixed within one statement).
* Acquire is one ``INSERT … ON CONFLICT (key, slot) DO UPDATE … WHERE <free>``.
  The takeover condition is the ``where=`` of ``on_conflict_do_update``; there is
  no ``index_where`` (that would be the arbiter index predicate and would let a
  live lock be overwritten). A row is *free* when its lease ended and it is not
  reserved for the longest-waiting waiter (see :data:`RESERVE_GRACE`).
* Release/renew match ``key``, ``slot`` **and** ``owner`` and require the lease
  to be live.
* Fencing tokens come from a source that never goes back (PostgreSQL sequence;
  SQLite one-row high-water mark maintained by a trigger). On PostgreSQL the
  takeover branch draws a fresh ``nextval`` after it holds the row lock, so a
  grant's token is always above the token of the grant it replaced; slots of a
  concurrency-limited key draw from the same source.
* A concurrency limit of N is the primary key: slots ``0..N-1``, one row each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    ClauseElement,
    ColumnElement,
    Executable,
    and_,
    bindparam,
    case,
    func,
    literal_column,
    null,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import BindParameter

from taskguard.dialects._history import history_statements
from taskguard.dialects._parts import (
    HOLDER_COLS,
    PG_QUICK_COMMIT,
    RESERVE_GRACE,
    Flavor,
    Statement,
    T,
    compile_for,
    pg_datetime,
    pg_flavor,
    pg_seconds,
    sqlite_datetime,
    sqlite_flavor,
    sqlite_seconds,
    sqlite_ts,
)
from taskguard.dialects._slots import (
    INSERT_COLS,
    PG_ACQUIRE_SLOTS,
    SQLITE_ACQUIRE_SLOTS,
    TAKEOVER_SET,
    free,
    free_sql,
)
from taskguard.models import SQLITE_TOKEN_TABLE, token_sequence

__all__ = [
    "RESERVE_GRACE",
    "SUPPORTED_DIALECTS",
    "LockSQL",
    "Statement",
    "fence_statement",
    "lock_sql_for",
]

_t = T
_HOLDER_COLS = HOLDER_COLS
_ROW_COLS = (
    _t.c.key,
    _t.c.slot,
    _t.c.owner,
    _t.c.token,
    _t.c.acquired_at,
    _t.c.expires_at,
    _t.c.task_name,
    _t.c.task_id,
    _t.c.hostname,
    _t.c.pid,
)


@dataclass(frozen=True, slots=True)
class LockSQL:
    """The compiled statements for one dialect, and how to read its timestamps."""

    dialect_name: str
    acquire: Statement
    release: Statement
    renew: Statement
    get: Statement
    get_owner: Statement
    held: Statement
    held_all: Statement
    force_release: Statement
    reap_batch: Statement
    db_now: Statement
    to_datetime: Callable[[Any], datetime]
    #: How a ttl/grace in seconds is passed (SQLite wants a date modifier string).
    seconds_param: Callable[[float], Any]
    #: Concurrency limit: any free slot of 0..n-1 -> (slot, token or NULL on a lost race, ...).
    acquire_slots: Statement
    #: Throttle window: release/renew that keep the key until acquired_at + hold.
    release_hold: Statement
    renew_hold: Statement
    #: Waiting: announce a waiter on a key's rows / withdraw it.
    announce: Statement
    withdraw: Statement
    #: History (opt-in): see taskguard.dialects._history.
    reap_batch_history: Statement
    reaped_events: Statement | None
    record_event: Statement
    record_acquired: Statement
    events: Statement
    trim_events: Statement
    #: How a Python datetime is passed where SQL compares it with stored timestamps.
    ts_param: Callable[[datetime], Any]


def _build(
    dialect: Dialect,
    fl: Flavor,
    insert_fn: Any,
    token_insert: ColumnElement[Any],
    token_takeover: Callable[[Any], ColumnElement[Any]],
    slots_sql: str,
    takeover_sql: str,
    to_datetime: Callable[[Any], datetime],
    seconds_param: Callable[[float], Any],
    ts_param: Callable[[datetime], Any],
    relax_commit: ColumnElement[bool] | None = None,
) -> LockSQL:
    now = fl.now
    ins = insert_fn(_t).values(
        key=bindparam("key"),
        slot=bindparam("slot"),
        owner=bindparam("owner"),
        token=token_insert,
        acquired_at=now,
        expires_at=fl.plus("ttl"),
        **{c: bindparam(c) for c in _HOLDER_COLS},
    )
    acquire = ins.on_conflict_do_update(
        index_elements=[_t.c.key, _t.c.slot],
        set_={
            "owner": ins.excluded.owner,
            "token": token_takeover(ins),
            "acquired_at": ins.excluded.acquired_at,
            "expires_at": ins.excluded.expires_at,
            **{c: getattr(ins.excluded, c) for c in _HOLDER_COLS},
        },
        # The takeover condition. NOT index_where (see module docstring).
        where=free(fl, ins.excluded.owner),
    ).returning(_t.c.token, _t.c.acquired_at, _t.c.expires_at)
    acquire_slots = text(
        slots_sql.format(
            cols=INSERT_COLS,
            counter=SQLITE_TOKEN_TABLE,
            now=fl.now_sql,
            plus_ttl=fl.plus_sql("ttl"),
            free_t=free_sql(fl, "t", ":owner"),
            free_row=free_sql(fl, "task_locks", "excluded.owner"),
            takeover=TAKEOVER_SET.format(token=takeover_sql),
        )
    )

    mine = and_(
        _t.c.key == bindparam("key"),
        _t.c.slot == bindparam("slot"),
        _t.c.owner == bindparam("owner"),
        _t.c.expires_at > now,
    )
    lease_cols = (_t.c.token, _t.c.acquired_at, _t.c.expires_at)
    # Releases only end a lease: one lost in a database crash keeps the key taken
    # until its expiry, never lets two hold it. So (PostgreSQL) they commit without
    # waiting for the WAL flush; a later durable commit flushes them anyway. Grants
    # and renewals always wait (they must survive a crash).
    quick = [relax_commit] if relax_commit is not None else []
    release = update(_t).where(mine, *quick).values(expires_at=now)
    renew = update(_t).where(mine).values(expires_at=fl.plus("ttl")).returning(*lease_cols)
    held_until = fl.add(_t.c.acquired_at, "hold")
    release_hold = update(_t).where(mine, *quick).values(expires_at=fl.greatest(now, held_until))
    renew_hold = (
        update(_t)
        .where(mine)
        .values(expires_at=fl.greatest(fl.plus("ttl"), held_until))
        .returning(*lease_cols)
    )

    # Waiters: every waiter raises wanted_until (a release before it NOTIFYs); the
    # one that has waited longest becomes next_owner (see _free).
    since = func.coalesce(fl.ts_bind("since"), now)
    until = fl.plus("wait")
    lead = or_(
        _t.c.next_owner.is_(None),
        _t.c.next_owner == bindparam("owner"),
        _t.c.next_owner == _t.c.owner,
        _t.c.next_until <= now,
        _t.c.next_since > since,
    )
    announce = (
        update(_t)
        .where(
            _t.c.key == bindparam("key"),
            _t.c.slot >= bindparam("first"),
            _t.c.slot < bindparam("n"),
            _t.c.expires_at > fl.grace_ago,
        )
        .values(
            wanted_until=fl.greatest(func.coalesce(_t.c.wanted_until, until), until),
            next_owner=case((lead, bindparam("owner")), else_=_t.c.next_owner),
            next_since=case((lead, since), else_=_t.c.next_since),
            next_until=case((lead, until), else_=_t.c.next_until),
        )
        .returning(_t.c.slot, _t.c.owner, _t.c.expires_at, _t.c.next_owner, now)
    )
    withdraw = (
        update(_t)
        .where(
            _t.c.key == bindparam("key"),
            _t.c.next_owner == bindparam("owner"),
            _t.c.owner != bindparam("owner"),
        )
        .values(next_owner=null(), next_since=null(), next_until=null())
    )

    row_and_now = (*_ROW_COLS, now.label("read_at"))
    get = select(*row_and_now).where(_t.c.key == bindparam("key")).order_by(_t.c.slot)
    get_owner = select(*row_and_now).where(
        _t.c.key == bindparam("key"),
        _t.c.slot == bindparam("slot"),
        _t.c.owner == bindparam("owner"),
    )
    # substr() rather than LIKE: no wildcard escaping, and SQLite's LIKE ignores case.
    prefix: BindParameter[str] = bindparam("prefix")
    prefix_match = func.substr(_t.c.key, 1, func.length(prefix)) == prefix
    held = (
        select(*row_and_now)
        .where(prefix_match, _t.c.expires_at > now)
        .order_by(_t.c.key, _t.c.slot)
        .limit(bindparam("limit"))
    )
    held_all = (
        select(*row_and_now)
        .where(prefix_match)
        .order_by(_t.c.key, _t.c.slot)
        .limit(bindparam("limit"))
    )
    force_release = (
        update(_t)
        .where(_t.c.key == bindparam("key"), _t.c.expires_at > now)
        .values(expires_at=now)
        .returning(_t.c.slot, _t.c.owner, _t.c.token, *(_t.c[c] for c in _HOLDER_COLS))
    )

    def c(stmt: ClauseElement) -> Statement:
        return compile_for(stmt, dialect)

    hist = history_statements(dialect, fl)

    return LockSQL(
        dialect_name=dialect.name,
        acquire=c(acquire),
        release=c(release),
        renew=c(renew),
        get=c(get),
        get_owner=c(get_owner),
        held=c(held),
        held_all=c(held_all),
        force_release=c(force_release),
        reap_batch=hist.reap_batch,
        db_now=c(select(now)),
        to_datetime=to_datetime,
        seconds_param=seconds_param,
        acquire_slots=c(acquire_slots),
        release_hold=c(release_hold),
        renew_hold=c(renew_hold),
        announce=c(announce),
        withdraw=c(withdraw),
        reap_batch_history=hist.reap_batch_history,
        reaped_events=hist.reaped_events,
        record_event=hist.record_event,
        record_acquired=hist.record_acquired,
        events=hist.events,
        trim_events=hist.trim_events,
        ts_param=ts_param,
    )


def _postgresql(dialect: Dialect) -> LockSQL:
    return _build(
        dialect,
        pg_flavor(),
        postgresql.insert,
        token_insert=token_sequence.next_value(),
        # A fresh value taken while holding the row lock: above the replaced grant's.
        token_takeover=lambda ins: token_sequence.next_value(),
        slots_sql=PG_ACQUIRE_SLOTS,
        takeover_sql="nextval('task_locks_token_seq')",
        to_datetime=pg_datetime,
        seconds_param=pg_seconds,
        ts_param=lambda dt: dt,
        # An uncorrelated subquery: evaluated once, before the row is touched. Inline
        # text, so the hot release binds no extra parameters.
        relax_commit=select(literal_column(PG_QUICK_COMMIT)).scalar_subquery().is_not(None),
    )


def _sqlite(dialect: Dialect) -> LockSQL:
    # One writer at a time: reading the high-water mark inside the statement is safe;
    # the trigger created by the migration raises it to every token written.
    next_token: ColumnElement[Any] = literal_column(f"(SELECT value + 1 FROM {SQLITE_TOKEN_TABLE})")
    return _build(
        dialect,
        sqlite_flavor(),
        sqlite.insert,
        token_insert=next_token,
        token_takeover=lambda ins: ins.excluded.token,
        slots_sql=SQLITE_ACQUIRE_SLOTS,
        takeover_sql="excluded.token",
        to_datetime=sqlite_datetime,
        seconds_param=sqlite_seconds,
        ts_param=sqlite_ts,
    )


_BUILDERS: dict[str, Callable[[Dialect], LockSQL]] = {
    "postgresql": _postgresql,
    "sqlite": _sqlite,
}

SUPPORTED_DIALECTS: Sequence[str] = tuple(_BUILDERS)


def lock_sql_for(dialect: Dialect) -> LockSQL:
    """Compile taskguard's statements for ``dialect``; raises ``NotImplementedError``
    naming the supported dialects for anything else."""
    try:
        builder = _BUILDERS[dialect.name]
    except KeyError:
        raise NotImplementedError(
            f"taskguard supports {', '.join(SUPPORTED_DIALECTS)}; not {dialect.name!r}"
        ) from None
    return builder(dialect)


@cache
def fence_statement(dialect_name: str) -> Executable:
    """The statement :func:`taskguard.fencing.fence` runs *inside the caller's
    transaction*: the lease's row if ``owner`` still holds it by the database clock,
    returning its token.

    PostgreSQL reads it ``FOR SHARE``: a takeover (which must lock the row) waits
    until the caller's transaction ends. SQLite has no row locks, so the check is a
    no-op write that takes the database's write lock for the rest of the transaction.
    """
    # Not named after columns: executed through the caller's Session, an UPDATE's
    # parameters named like columns would become SET values.
    mine = [
        _t.c.key == bindparam("lease_key"),
        _t.c.slot == bindparam("lease_slot"),
        _t.c.owner == bindparam("lease_owner"),
    ]
    if dialect_name == "postgresql":
        now = pg_flavor().now
        return select(_t.c.token).where(*mine, _t.c.expires_at > now).with_for_update(read=True)
    if dialect_name == "sqlite":
        now = sqlite_flavor().now
        return (
            update(_t)
            .where(*mine, _t.c.expires_at > now)
            .values(expires_at=_t.c.expires_at)
            .returning(_t.c.token)
        )
    raise NotImplementedError(
        f"taskguard supports {', '.join(SUPPORTED_DIALECTS)}; not {dialect_name!r}"
    )
