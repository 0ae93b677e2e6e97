"""Building blocks of taskguard's SQL: how statements are compiled and laid out,
and how each dialect spells time arithmetic. The statements themselves are in
:mod:`taskguard.dialects` (lease operations) and
:mod:`taskguard.dialects.history` (reaping and lock history)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    ClauseElement,
    ColumnElement,
    DateTime,
    Float,
    String,
    Table,
    bindparam,
    literal,
    literal_column,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import func
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter

from taskguard.models import TaskLock, TaskLockEvent

#: For this long after a lease ends, only the longest-waiting waiter may take the row.
RESERVE_GRACE = 0.5
#: PostgreSQL: the statement's own (autocommit) transaction commits without waiting for
#: the WAL flush. Only for statements whose loss in a database crash is harmless (a
#: release, a reap batch); a later durable commit flushes them anyway.
PG_QUICK_COMMIT = "set_config('synchronous_commit', 'off', true)"

T: Table = TaskLock.__table__  # type: ignore[assignment]
EV: Table = TaskLockEvent.__table__  # type: ignore[assignment]
HOLDER_COLS = ("task_name", "task_id", "hostname", "pid")


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


def compile_for(stmt: ClauseElement, dialect: Dialect) -> Statement:
    compiled = stmt.compile(dialect=dialect)
    assert isinstance(compiled, SQLCompiler)
    names: tuple[str, ...] | None = None
    if compiled.positional:
        names = tuple(compiled.positiontup or ())
    defaults = tuple((k, v) for k, v in compiled.params.items() if v is not None)
    return Statement(compiled.string, names, defaults)


SQLITE_FMT = "%Y-%m-%d %H:%M:%f000"  # same text layout SQLAlchemy uses for DateTime


@dataclass(frozen=True, slots=True)
class Flavor:
    """How one dialect spells time arithmetic, in Core and in text."""

    now: ColumnElement[Any]
    now_sql: str
    #: now + <seconds param>, Core / text.
    plus: Callable[[str], ColumnElement[Any]]
    plus_sql: Callable[[str], str]
    #: <timestamp expression> + <seconds param>.
    add: Callable[[ColumnElement[Any], str], ColumnElement[Any]]
    #: Seconds from a timestamp expression to now.
    since: Callable[[ColumnElement[Any]], ColumnElement[Any]]
    greatest: Callable[..., ColumnElement[Any]]
    #: now - RESERVE_GRACE, Core / text.
    grace_ago: ColumnElement[Any]
    grace_ago_sql: str
    ts_bind: Callable[[str], BindParameter[Any]]


def pg_flavor() -> Flavor:
    now_sql = "statement_timestamp()"
    grace = f"{now_sql} - interval '{RESERVE_GRACE} seconds'"

    def secs(name: str) -> ColumnElement[Any]:
        return bindparam(name, type_=Float) * literal_column("interval '1 second'")

    return Flavor(
        now=func.statement_timestamp(type_=DateTime(timezone=True)),
        now_sql=now_sql,
        plus=lambda p: func.statement_timestamp(type_=DateTime(timezone=True)) + secs(p),
        plus_sql=lambda p: f"{now_sql} + :{p} * interval '1 second'",
        add=lambda col, p: col + secs(p),
        since=lambda col: func.extract(
            "epoch", func.statement_timestamp(type_=DateTime(timezone=True)) - col
        ),
        greatest=func.greatest,
        grace_ago=literal_column(grace, DateTime(timezone=True)),
        grace_ago_sql=grace,
        ts_bind=lambda n: bindparam(n, type_=DateTime(timezone=True)),
    )


def sqlite_flavor() -> Flavor:
    fmt: ColumnElement[str] = literal_column(f"'{SQLITE_FMT}'")
    now_sql = f"strftime('{SQLITE_FMT}', 'now')"
    grace = f"strftime('{SQLITE_FMT}', 'now', '-{RESERVE_GRACE:.3f} seconds')"
    # Modifiers are '+1.500 seconds' strings, built by _sqlite_seconds.
    return Flavor(
        now=func.strftime(fmt, literal_column("'now'")),
        now_sql=now_sql,
        plus=lambda p: func.strftime(fmt, literal_column("'now'"), bindparam(p)),
        plus_sql=lambda p: f"strftime('{SQLITE_FMT}', 'now', :{p})",
        add=lambda col, p: func.strftime(fmt, col, bindparam(p)),
        since=lambda col: (
            (func.julianday(literal_column("'now'")) - func.julianday(col)) * literal(86400.0)
        ),
        greatest=func.max,
        grace_ago=literal_column(grace),
        grace_ago_sql=grace,
        ts_bind=lambda n: bindparam(n, type_=String),
    )


def sqlite_seconds(seconds: float) -> str:
    return f"{seconds:+.3f} seconds"


def pg_seconds(seconds: float) -> float:
    return seconds


def sqlite_datetime(value: Any) -> datetime:
    dt = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return dt.replace(tzinfo=timezone.utc) if dt.tzinfo is None else dt.astimezone(timezone.utc)


def pg_datetime(value: Any) -> datetime:
    assert isinstance(value, datetime)
    return value.astimezone(timezone.utc)


def sqlite_ts(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
