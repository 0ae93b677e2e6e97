"""All lock SQL, per dialect, in one place.

Statements are built once with SQLAlchemy Core, compiled for the engine's
dialect, and executed as plain DBAPI calls by :mod:`taskguard._db` (no per-call
compilation or reflection on the hot path).

Invariants every dialect upholds:

* "now" is the database's clock, read per statement (PostgreSQL:
  ``statement_timestamp()``, never the transaction-frozen ``now()``; SQLite:
  ``'now'``, fixed within one statement).
* Acquire is one ``INSERT … ON CONFLICT (key, slot) DO UPDATE … WHERE <expired>``.
  The takeover condition is the ``where=`` of ``on_conflict_do_update``; there is
  no ``index_where`` (that would be the arbiter index predicate and would let a
  live lock be overwritten).
* Release/renew match ``key``, ``slot`` **and** ``owner`` and require the lease
  to be live.
* Fencing tokens come from a source that never goes back (PostgreSQL sequence;
  SQLite one-row high-water mark maintained by a trigger). On PostgreSQL the
  takeover branch draws a fresh ``nextval`` after it holds the row lock, so a
  grant's token is always above the token of the grant it replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    ClauseElement,
    ColumnElement,
    DateTime,
    Float,
    Table,
    and_,
    bindparam,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import func
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter

from taskguard.models import SQLITE_TOKEN_TABLE, TaskLock, token_sequence

__all__ = ["LockSQL", "Statement", "lock_sql_for"]

_t: Table = TaskLock.__table__  # type: ignore[assignment]
_HOLDER_COLS = ("task_name", "task_id", "hostname", "pid")
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
class Statement:
    """A statement compiled for one dialect: SQL text plus how to lay out params."""

    sql: str
    positional_names: tuple[str, ...] | None
    #: Values the compiler bound itself (e.g. SQLite's ``OFFSET 0``).
    defaults: tuple[tuple[str, Any], ...] = ()

    def params(self, values: dict[str, Any]) -> dict[str, Any] | tuple[Any, ...]:
        if self.defaults:
            values = {**dict(self.defaults), **values}
        if self.positional_names is None:
            return values
        return tuple(values[name] for name in self.positional_names)


def _compile(stmt: ClauseElement, dialect: Dialect) -> Statement:
    compiled = stmt.compile(dialect=dialect)
    assert isinstance(compiled, SQLCompiler)
    names: tuple[str, ...] | None = None
    if compiled.positional:
        names = tuple(compiled.positiontup or ())
    defaults = tuple((k, v) for k, v in compiled.params.items() if v is not None)
    return Statement(compiled.string, names, defaults)


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


# -- per-dialect building blocks ------------------------------------------------

_SQLITE_FMT = "%Y-%m-%d %H:%M:%f000"  # same text layout SQLAlchemy uses for DateTime


def _pg_now() -> ColumnElement[Any]:
    return func.statement_timestamp(type_=DateTime(timezone=True))


def _pg_plus(seconds_param: str) -> ColumnElement[Any]:
    return _pg_now() + bindparam(seconds_param, type_=Float) * literal_column("interval '1 second'")


def _pg_minus(seconds_param: str) -> ColumnElement[Any]:
    return _pg_now() - bindparam(seconds_param, type_=Float) * literal_column("interval '1 second'")


def _sqlite_now() -> ColumnElement[Any]:
    return func.strftime(literal_column(f"'{_SQLITE_FMT}'"), literal_column("'now'"))


def _sqlite_shift(modifier_param: str) -> ColumnElement[Any]:
    # The modifier is '+1.500 seconds' / '-300.000 seconds', built in seconds_param.
    return func.strftime(
        literal_column(f"'{_SQLITE_FMT}'"), literal_column("'now'"), bindparam(modifier_param)
    )


def _sqlite_seconds(seconds: float) -> str:
    return f"{seconds:+.3f} seconds"


def _pg_seconds(seconds: float) -> float:
    return seconds


def _neg(param: Callable[[float], Any]) -> Callable[[float], Any]:
    return lambda s: param(-s)


def _sqlite_datetime(value: Any) -> datetime:
    dt = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return dt.replace(tzinfo=timezone.utc) if dt.tzinfo is None else dt.astimezone(timezone.utc)


def _pg_datetime(value: Any) -> datetime:
    assert isinstance(value, datetime)
    return value.astimezone(timezone.utc)


def _build(
    dialect: Dialect,
    insert_fn: Any,
    now: ColumnElement[Any],
    plus_ttl: ColumnElement[Any],
    reap_sql: str,
    token_insert: ColumnElement[Any],
    token_takeover: Callable[[Any], ColumnElement[Any]],
    to_datetime: Callable[[Any], datetime],
    seconds_param: Callable[[float], Any],
) -> LockSQL:
    ins = insert_fn(_t).values(
        key=bindparam("key"),
        slot=bindparam("slot"),
        owner=bindparam("owner"),
        token=token_insert,
        acquired_at=now,
        expires_at=plus_ttl,
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
        where=_t.c.expires_at <= now,
    ).returning(_t.c.token, _t.c.acquired_at, _t.c.expires_at)

    mine = and_(
        _t.c.key == bindparam("key"),
        _t.c.slot == bindparam("slot"),
        _t.c.owner == bindparam("owner"),
        _t.c.expires_at > now,
    )
    release = update(_t).where(mine).values(expires_at=now)
    renew = (
        update(_t)
        .where(mine)
        .values(expires_at=plus_ttl)
        .returning(_t.c.token, _t.c.acquired_at, _t.c.expires_at)
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
        update(_t).where(_t.c.key == bindparam("key"), _t.c.expires_at > now).values(expires_at=now)
    )
    return LockSQL(
        dialect_name=dialect.name,
        acquire=_compile(acquire, dialect),
        release=_compile(release, dialect),
        renew=_compile(renew, dialect),
        get=_compile(get, dialect),
        get_owner=_compile(get_owner, dialect),
        held=_compile(held, dialect),
        held_all=_compile(held_all, dialect),
        force_release=_compile(force_release, dialect),
        reap_batch=_compile(text(reap_sql), dialect),
        db_now=_compile(select(now), dialect),
        to_datetime=to_datetime,
        seconds_param=seconds_param,
    )


# Reaping: delete rows whose lease ended more than `grace` ago, walking the primary
# key in batches (keyset pagination, so each batch reads only its own range) and
# re-checking expiry in the DELETE itself. Returns (deleted, last_key, last_slot);
# last_key is NULL when nothing was left to scan.
_PG_REAP = """
WITH batch AS (
    SELECT key, slot FROM task_locks
    WHERE (key, slot) > (:after_key, :after_slot)
      AND expires_at <= statement_timestamp() - :grace * interval '1 second'
    ORDER BY key, slot
    LIMIT :batch_size
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM task_locks AS t USING batch AS b
    WHERE t.key = b.key AND t.slot = b.slot
      AND t.expires_at <= statement_timestamp() - :grace * interval '1 second'
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone),
       (SELECT count(*) FROM batch),
       (SELECT key FROM batch ORDER BY key DESC, slot DESC LIMIT 1),
       (SELECT slot FROM batch ORDER BY key DESC, slot DESC LIMIT 1)
"""

# SQLite runs one writer at a time, so select-then-delete in one statement is atomic.
_SQLITE_REAP = f"""
DELETE FROM task_locks
WHERE rowid IN (
    SELECT rowid FROM task_locks
    WHERE (key, slot) > (:after_key, :after_slot)
      AND expires_at <= strftime('{_SQLITE_FMT}', 'now', :grace)
    ORDER BY key, slot
    LIMIT :batch_size
)
RETURNING key, slot
"""


def _postgresql(dialect: Dialect) -> LockSQL:
    return _build(
        dialect,
        postgresql.insert,
        _pg_now(),
        _pg_plus("ttl"),
        _PG_REAP,
        token_insert=token_sequence.next_value(),
        # A fresh value taken while holding the row lock: above the replaced grant's.
        token_takeover=lambda ins: token_sequence.next_value(),
        to_datetime=_pg_datetime,
        seconds_param=_pg_seconds,
    )


def _sqlite(dialect: Dialect) -> LockSQL:
    # One writer at a time: reading the high-water mark inside the statement is safe;
    # the trigger created by the migration raises it to every token written.
    next_token: ColumnElement[Any] = literal_column(f"(SELECT value + 1 FROM {SQLITE_TOKEN_TABLE})")
    return _build(
        dialect,
        sqlite.insert,
        _sqlite_now(),
        _sqlite_shift("ttl"),
        _SQLITE_REAP,
        token_insert=next_token,
        token_takeover=lambda ins: ins.excluded.token,
        to_datetime=_sqlite_datetime,
        seconds_param=_sqlite_seconds,
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
