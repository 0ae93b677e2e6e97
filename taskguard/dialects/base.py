"""What every dialect provides, and the value types the storage layer runs.

A dialect is one :class:`Dialect` subclass in its own module
(:mod:`taskguard.dialects.postgresql`, :mod:`taskguard.dialects.sqlite`): how it
spells time arithmetic (:class:`Flavor`), where fencing tokens come from, the
statements that cannot be written dialect-neutrally, how its connections are
set up, how its errors are classified, how the reaper walks its table, whether
waiters can be woken, and the fence statement. The statements shared by all
dialects are built once per dialect by :mod:`taskguard.dialects.statements`.

Invariants every dialect upholds:

* "now" is the database's clock, read per statement (PostgreSQL:
  ``statement_timestamp()``, never the transaction-frozen ``now()``).
* Acquire is one ``INSERT … ON CONFLICT (key, slot) DO UPDATE … WHERE <free>``:
  the takeover condition is the ``where=`` of the upsert, never an index
  predicate (that would let a live lock be overwritten).
* Release/renew match ``key``, ``slot`` **and** ``owner`` and require the lease
  to be live.
* Fencing tokens come from a source that never goes back, and a takeover draws
  a token above the one of the grant it replaces.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from operator import itemgetter
from typing import Any, ClassVar, Protocol

from sqlalchemy import URL, ClauseElement, ColumnElement, Connection, Engine, Executable, Table
from sqlalchemy.engine import Dialect as SADialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import BindParameter, TextClause
from sqlalchemy.sql.selectable import SelectBase

from taskguard.deadline import watchdog
from taskguard.exceptions import ConfigurationError
from taskguard.models import TaskLock, TaskLockEvent

__all__ = [
    "EV",
    "HOLDER_COLS",
    "INFO_COLS",
    "RESERVE_GRACE",
    "Dialect",
    "Driver",
    "ErrorKind",
    "Flavor",
    "Listener",
    "LockSQL",
    "ReapStep",
    "Statement",
    "T",
    "compile_for",
]

#: For this long after a lease ends, only the longest-waiting waiter may take the row.
RESERVE_GRACE = 0.5

T: Table = TaskLock.__table__  # type: ignore[assignment]
EV: Table = TaskLockEvent.__table__  # type: ignore[assignment]
HOLDER_COLS = ("task_name", "task_id", "hostname", "pid")
#: A row as the reads return it after its lease columns: the holder, then the lock
#: phase and the key's limit the grant recorded (``get``'s shape, then ``read_at``).
INFO_COLS = (*HOLDER_COLS, "phase", "slots")


@dataclass(frozen=True, slots=True)
class Statement:
    """A statement compiled for one dialect: SQL text plus how to lay out params."""

    sql: str
    positional_names: tuple[str, ...] | None
    #: Values the compiler bound itself (e.g. SQLite's ``OFFSET 0``).
    defaults: tuple[tuple[str, Any], ...] = ()
    #: Dialects without ``UPDATE … RETURNING`` (MariaDB): a read run right after, on
    #: the same connection, when this statement matched rows; its rows are the result.
    then: Statement | None = None
    #: Whether it is known at compile time to yield rows (a Core SELECT, or
    #: RETURNING) or none (other Core DML, a release): the storage layer then skips
    #: ``cursor.description``, which builds column objects. None: unknown (text).
    returns_rows: bool | None = None
    #: Sent instead on a connection that does not keep prepared statements (behind a
    #: pooler, each execution is parsed and planned again): a shorter statement whose
    #: rows the dialect also understands.
    unprepared: Statement | None = None

    #: The statement's parameters from a mapping of values: a tuple in order where the
    #: driver takes them by position (an ``itemgetter``: no Python frame per call).
    params: Callable[[Mapping[str, Any]], Any] = field(
        default=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        names, defaults = self.positional_names, dict(self.defaults)
        if names is None:
            params: Callable[[Mapping[str, Any]], Any] = dict
        elif not names:
            params = _no_params
        elif len(names) == 1:
            params = _one(names[0])
        else:
            params = itemgetter(*names)
        if defaults:
            params = _with_defaults(params, defaults)
        object.__setattr__(self, "params", params)


def _no_params(_values: Mapping[str, Any]) -> tuple[()]:
    return ()


def _one(name: str) -> Callable[[Mapping[str, Any]], tuple[Any]]:
    return lambda values: (values[name],)


def _with_defaults(
    params: Callable[[Mapping[str, Any]], Any], defaults: dict[str, Any]
) -> Callable[[Mapping[str, Any]], Any]:
    return lambda values: params({**defaults, **values})


def compile_for(stmt: ClauseElement | Executable, dialect: SADialect) -> Statement:
    """Compile once; the storage layer then runs the text as a plain DBAPI call."""
    assert isinstance(stmt, ClauseElement)
    compiled = stmt.compile(dialect=dialect)
    assert isinstance(compiled, SQLCompiler)
    names: tuple[str, ...] | None = None
    if compiled.positional:
        names = tuple(compiled.positiontup or ())
    defaults = tuple((k, v) for k, v in compiled.params.items() if v is not None)
    known = bool(compiled.effective_returning) or isinstance(stmt, SelectBase)
    # Core DML without RETURNING yields no rows; a text statement may (ask the cursor).
    returns = True if known else (None if isinstance(stmt, TextClause) else False)
    return Statement(compiled.string, names, defaults, returns_rows=returns)


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


@dataclass(frozen=True, slots=True)
class LockSQL:
    """Every statement the storage layer runs, compiled for one dialect."""

    acquire: Statement
    #: Concurrency limit: any free slot of 0..n-1 -> (slot, token or NULL on a lost race, ...).
    acquire_slots: Statement
    release: Statement
    renew: Statement
    #: A no-op write to the owner's live row: its commit is durable (and, under
    #: synchronous replication, replicated) only once everything before it is.
    confirm: Statement
    #: Throttle window: release/renew that keep the key until acquired_at + hold.
    release_hold: Statement
    renew_hold: Statement
    #: Adopt a live lease by its owner id (``:from_owner``) under a new one
    #: (``:owner``, with new holder details): renew (and keep a throttle window).
    handover: Statement
    handover_hold: Statement
    get: Statement
    get_owner: Statement
    held: Statement
    held_all: Statement
    force_release: Statement
    db_now: Statement
    #: How many keys a waiter still waits for (``wanted_until`` ahead).
    waited_for: Statement
    #: Waiting: announce a waiter on a key's rows / withdraw it.
    announce: Statement
    withdraw: Statement
    #: Reaping: one batch, without and with lock history.
    reap_batch: Statement
    reap_batch_history: Statement
    #: A reap batch's history in a second statement (dialects without data-modifying CTEs).
    reaped_events: Statement | None
    record_event: Statement
    #: An event ending a grant, with the holder of that grant's ``acquired`` event.
    record_ended: Statement
    events: Statement
    #: Every key's events of some kinds since a time (:data:`~taskguard.dialects.
    #: event_statements.KIND_SLOTS` kinds at most), newest first.
    recent_events: Statement
    trim_events: Statement
    #: ``acquire`` refused while the key ``:unless`` is held (one statement); None:
    #: the store reads that key first.
    acquire_unless: Statement | None = None
    #: Dialects with :attr:`Dialect.lean_acquire`: ``acquire`` / ``acquire_unless``
    #: for the common case, granting only a row no waiter has reserved and reading
    #: nothing else; an empty result means "send the full statement".
    acquire_lean: Statement | None = None
    acquire_unless_lean: Statement | None = None
    #: ``release`` that also takes the marker key ``:mark_key`` for ``:mark_ttl``
    #: seconds, in one transaction and one round trip; None: two statements.
    release_marking: Statement | None = None


class ErrorKind(enum.Enum):
    """What a driver error means, as a dialect classifies it."""

    SCHEMA_MISSING = "schema_missing"
    SCHEMA_OLD = "schema_old"
    PERMISSION = "permission"
    LOGIN = "login"  # the server refused the login (wrong user or password)
    NO_DATABASE = "no_database"  # the database named in the URL does not exist
    OUTAGE = "outage"
    STATEMENT = "statement"
    LOCKED = "locked"  # another write transaction kept the database locked (SQLite): not run


@dataclass(frozen=True, slots=True)
class ReapStep:
    """What one reap batch did: rows deleted, rows looked at, where the next batch
    starts, and (for dialects that record history in a second statement) the rows."""

    deleted: int
    scanned: int
    after: dict[str, Any]
    reaped: list[tuple[Any, ...]]


class Listener(Protocol):
    """A connection that is woken when a lease with waiters ends early."""

    def wait(self, key: str, timeout: float) -> bool: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Driver:
    """A driver a dialect supports: its module, URL scheme and install line."""

    module: str
    scheme: str
    install: str


class Dialect:
    """Everything that differs between databases. Subclasses set :attr:`name`
    (SQLAlchemy's backend name) and fill in the hooks below; the registry in
    :mod:`taskguard.dialects` maps names to instances."""

    name: ClassVar[str]
    #: The database's name for people (messages, docs).
    label: ClassVar[str]
    #: Other SQLAlchemy backend names served by this dialect.
    aliases: ClassVar[tuple[str, ...]] = ()
    #: SQLAlchemy driver name -> the driver, for every driver taskguard supports here.
    drivers: ClassVar[Mapping[str, Driver]] = {}
    #: Whether timestamp columns hold naive UTC (no time zone stored).
    naive_timestamps: ClassVar[bool] = False
    #: Whether an engine's pool may hand each thread a connection to keep.
    pins_connections: ClassVar[bool] = False
    #: Whether ``durable=False`` (commits that do not wait for durability) is offered.
    relaxed_durability: ClassVar[bool] = False
    #: Driver exception types that mean "the statement was refused", never an outage.
    statement_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    #: The shortest ``connect_timeout`` (whole seconds) the driver honours; ``None``:
    #: it has none (nothing to connect to over a network).
    connect_timeout_floor: ClassVar[int | None] = 1

    # -- SQL ---------------------------------------------------------------------

    def flavor(self) -> Flavor:
        raise NotImplementedError

    def insert(self, table: Table) -> Any:
        """The dialect's ``insert()`` construct (with ``on_conflict_do_update``)."""
        raise NotImplementedError

    def token_insert(self) -> ColumnElement[Any]:
        """The token of a row's first grant."""
        raise NotImplementedError

    def token_takeover(self, ins: Any) -> ColumnElement[Any]:
        """The token of a takeover, evaluated while the row is locked."""
        raise NotImplementedError

    #: The concurrency-limit acquire as text (see statements.build_lock_sql for fields).
    acquire_slots_sql: ClassVar[str] = ""
    #: The takeover token inside acquire_slots_sql.
    takeover_token_sql: ClassVar[str] = ""
    #: A release and a marker grant in one statement (a data-modifying CTE), as text
    #: with the fields of acquire_slots_sql; "" where the dialect has no such thing.
    release_marking_sql: ClassVar[str] = ""
    #: Whether the store sends a lean acquire first (:attr:`LockSQL.acquire_lean`),
    #: the full one only when that grants nothing: where the full one costs a grant
    #: more than the lean one's extra round trip costs a refusal (PostgreSQL: the full
    #: one also reads the refusal's holder).
    lean_acquire: ClassVar[bool] = False

    def own_statements(self, fl: Flavor) -> dict[str, Any]:
        """Statements this dialect writes itself, by :class:`LockSQL` field name,
        instead of the shared ones (``acquire`` here means no ``insert()`` hooks are
        used). A value may be a pair ``(statement, then)``: see :attr:`Statement.then`."""
        return {}

    def granted(
        self, rows: list[tuple[Any, ...]], owner: str, slots: bool
    ) -> list[tuple[Any, ...]]:
        """An acquire's result rows in the shared shape: ``(token, acquired_at,
        expires_at)`` only if granted, or for a limit ``(slot, token or None, …)``."""
        return rows

    def reading_refusal(
        self, acquire: Any, fl: Flavor, unless: bool, sa_dialect: SADialect
    ) -> Statement:
        """The single acquire as built from the hooks above, compiled; or a statement
        that also returns the rows of the key it was refused by (then :meth:`holders`
        finds them): one round trip per refusal instead of two."""
        return compile_for(acquire, sa_dialect)

    def prepares(self, cursor: Any) -> bool:
        """Whether ``cursor``'s connection keeps prepared statements (else a
        statement's :attr:`Statement.unprepared` is sent)."""
        return True

    def holders(self, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The rows of the key (and marker) an acquire was refused by, in ``get``'s
        shape, where :meth:`reading_refusal` returns them; else none."""
        return []

    def quick_commit(self) -> ColumnElement[bool] | None:
        """A condition that makes a statement's own transaction commit without
        waiting for durability, for statements whose loss in a crash is harmless
        (a release, a reap batch); ``None`` if the dialect cannot."""
        return None

    def reap_sql(self, history: bool) -> str:
        raise NotImplementedError

    def reaped_events_sql(self) -> str | None:
        return None

    def fence_statement(self) -> Executable:
        """Run in the caller's transaction: the lease's token if ``lease_owner``
        still holds it (binds ``lease_key``, ``lease_slot``, ``lease_owner``), and
        nobody can take it over until that transaction ends."""
        raise NotImplementedError

    # -- values ------------------------------------------------------------------

    def timestamp_type(self) -> Any:
        """The column type of taskguard's timestamps where SQLAlchemy's
        ``DateTime(timezone=True)`` does not do; ``None``: that one."""
        return None

    def to_datetime(self, value: Any) -> datetime:
        """A timestamp as the driver returned it, as an aware UTC datetime."""
        raise NotImplementedError

    def seconds_param(self, seconds: float) -> Any:
        """How a duration in seconds is bound."""
        return seconds

    def ts_param(self, value: datetime) -> Any:
        """How a datetime is bound where SQL compares it with stored timestamps."""
        return value

    # -- connections ---------------------------------------------------------------

    def check_driver(self, url: URL) -> None:
        """A :class:`~taskguard.ConfigurationError` naming the supported drivers
        unless ``url`` names one of them, installed."""
        name = url.get_driver_name()
        ways = " or ".join(f"{d.scheme}:// ({d.install})" for d in self.drivers.values())
        driver = self.drivers.get(name)
        if driver is None:
            raise ConfigurationError(
                f"taskguard does not support the {name} driver ({url.drivername}://) for "
                f"{self.label}: use {ways}"
            )
        if importlib.util.find_spec(driver.module) is None:
            # The other drivers only: this one's schemes are the ones just refused.
            others = " or ".join(
                f"{d.scheme}:// ({d.install})" for n, d in self.drivers.items() if n != name
            )
            raise ConfigurationError(
                f"{url.drivername}:// URLs need {driver.install}"
                + (f"; or use {others}" if others else "")
            )

    def missing_database(self, url: URL) -> str | None:
        """Why ``url`` names no database, which connecting would create empty, or None."""
        return None

    def check_server(self, sa_dialect: SADialect) -> None:
        """A :class:`~taskguard.ConfigurationError` (one line) if the server a
        connection reached is one taskguard cannot keep locks in (after connecting)."""

    def missing_privileges(self, conn: Connection) -> list[str]:
        """The privileges the lock statements need that the role lacks (``taskguard
        check``), e.g. ``"UPDATE on table task_locks"``; empty where not checked."""
        return []

    def engine_options(self, url: URL, options: dict[str, Any]) -> None:
        """Adjust ``create_engine`` keyword arguments for a lock engine (in place)."""

    def configure_engine(self, engine: Engine, url: URL, *, durable: bool) -> None:
        """Install connect-time set-up on a lock engine taskguard owns."""

    def connect_args(self, url: URL) -> dict[str, Any]:
        """Driver options for any engine taskguard creates (also migrations, checks)."""
        return {}

    def socket_of(self, dbapi_conn: Any) -> int | None:
        """The connection's socket, which the statement watchdog shuts down when a
        statement outlives its time limit; ``None``: nothing to watch (in-process)."""
        return None

    def setting_up(self, dbapi_conn: Any) -> contextlib.AbstractContextManager[Any]:
        """Around a connection's set-up statements (in a ``connect`` listener): they
        end by the deadline of the call opening the connection, like a statement."""
        return watchdog.watch(self.socket_of(dbapi_conn))

    def serializes_threads(self, url: URL) -> bool:
        """Whether every thread shares one connection and must take turns."""
        return False

    def listener(self, engine: Engine, *, pooled_ok: bool = False) -> Listener | None:
        """A dedicated connection woken by releases, or ``None`` (then waiters poll).
        ``pooled_ok``: the operator named this URL for listening; trust it even if
        it goes through a pooler (session pooling keeps a LISTEN)."""
        return None

    # -- errors ------------------------------------------------------------------

    def classify(self, exc: BaseException, text: str) -> ErrorKind | None:
        """What ``exc`` (whose driver message is ``text``) means; ``None`` defers to
        the generic rules (an exception of :attr:`statement_errors` is a refused
        statement, anything else an outage)."""
        return None

    # -- reaping -------------------------------------------------------------------

    def reap_start(self) -> dict[str, Any]:
        """The cursor values of the first reap batch."""
        raise NotImplementedError

    def reap_step(self, rows: list[tuple[Any, ...]], after: dict[str, Any]) -> ReapStep:
        """Read one reap batch's result rows."""
        raise NotImplementedError
