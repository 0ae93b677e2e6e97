"""Connections for lock statements.

Lock statements never run inside a caller's transaction: each is its own
autocommit round trip on a DBAPI connection of the guard's engine. What differs
between databases (connect-time set-up, pooling, whether threads must take turns)
comes from the dialect.

On taskguard's own engines, opening a connection for a call with a deadline
(every lease operation: :mod:`taskguard.deadline`) ends by that deadline too: the
driver connects on a helper thread that the caller stops waiting for, so a host
that accepts the connection and never answers (a hung server, a partition) cannot
hold a renewal past the moment its lease runs out by the local clock.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from sqlalchemy import URL, Engine, create_engine, event
from sqlalchemy import exc as sa_exc

from taskguard.deadline import (
    _DEADLINE,
    DEFAULT_STATEMENT_LIMIT,
    Watch,
    call_limit,
    current_deadline,
    watchdog,
    within,
)
from taskguard.dialects import Dialect, Statement, dialect_for, dialect_for_url
from taskguard.exceptions import ConfigurationError, DatabaseUnavailable, TaskGuardError
from taskguard.store.errors import translate_error
from taskguard.urls import mask_url, parse_url

_T = TypeVar("_T")

__all__ = ["Executor", "create_lock_engine"]


def create_lock_engine(url: str | URL, *, durable: bool = True, **kwargs: Any) -> Engine:
    """An engine configured for lock statements: autocommit, plus whatever the
    dialect needs (SQLite: WAL and a busy timeout so processes can share a file).

    ``durable=False`` (PostgreSQL) commits lock statements without waiting for the
    WAL flush: faster, but grants acknowledged in the last few hundred
    milliseconds before a database crash can be lost (docs/reliability.md).
    """
    parsed = parse_url(url)
    try:
        dialect = dialect_for_url(parsed)
    except ConfigurationError as exc:
        raise ConfigurationError(f"cannot use database URL {mask_url(url)!r}: {exc}") from None
    if not durable and not dialect.relaxed_durability:
        raise ConfigurationError(
            f"durable=False (relaxed durability) is not available on {dialect.name}; "
            "it needs PostgreSQL"
        )
    options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", **kwargs}
    if options["isolation_level"] == "AUTOCOMMIT":
        # Every statement commits by itself, so a connection never goes back to the
        # pool inside a transaction: the pool's ROLLBACK-on-return is pure overhead
        # on the hot path (one per lock statement).
        options.setdefault("pool_reset_on_return", None)
    dialect.engine_options(parsed, options)
    try:
        engine = create_engine(parsed, **options)
    except (sa_exc.ArgumentError, ImportError) as exc:
        raise ConfigurationError(f"cannot use database URL {mask_url(url)!r}: {exc}") from None
    dialect.configure_engine(engine, parsed, durable=durable)
    if dialect.connect_timeout_floor is not None:
        _bound_connects(engine, dialect.connect_timeout_floor, mask_url(parsed))
    return engine


def _bound_connects(engine: Engine, shortest: int, url: str) -> None:
    """A new connection opened for a call with a deadline ends by it (module doc);
    ``shortest``: the driver's shortest connect_timeout."""

    @event.listens_for(engine, "do_connect")
    def _connect(sa_dialect: Any, _record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        deadline = current_deadline()
        if deadline is None:
            return None  # no limit in force: the driver's own connect timeout
        left = deadline - time.monotonic()
        # Only so that an abandoned attempt does not linger on its thread.
        wanted = max(shortest, math.ceil(left))
        configured = cparams.get("connect_timeout")
        if configured is None or float(configured) > wanted:
            cparams["connect_timeout"] = wanted
        return _connect_within(lambda: sa_dialect.connect(*cargs, **cparams), left, url)


def _connect_within(connect: Callable[[], Any], seconds: float, url: str) -> Any:
    conn = within(connect, seconds, _give_back) if seconds > 0 else None
    if conn is not None:
        return conn
    raise DatabaseUnavailable(
        f"lock database {url} did not accept a connection within the call's time limit",
        url,
        False,
    )


def _dispose_after_fork(ref: weakref.ref[Engine]) -> None:
    engine = ref()
    if engine is not None:
        # The parent's sockets must not be shared; drop them without closing.
        engine.dispose(close=False)


class Executor:
    """Runs compiled lock statements on the guard's own autocommit connections."""

    def __init__(
        self, url_or_engine: str | URL | Engine, *, durable: bool = True, **engine_kwargs: Any
    ) -> None:
        if isinstance(url_or_engine, Engine):
            if not durable:
                raise ConfigurationError("durable=False needs a URL (taskguard's own engine)")
            self.engine = url_or_engine
            self.owns_engine = False
            # A caller's engine keeps its isolation level; we switch the borrowed
            # DBAPI connection to autocommit and back (an attribute, no round trip).
            self._toggle_autocommit = True
        elif isinstance(url_or_engine, (str, URL)):
            self.engine = create_lock_engine(url_or_engine, durable=durable, **engine_kwargs)
            self.owns_engine = True
            self._toggle_autocommit = False
            if hasattr(os, "register_at_fork"):
                engine_ref = weakref.ref(self.engine)
                os.register_at_fork(after_in_child=lambda: _dispose_after_fork(engine_ref))
        else:
            raise ConfigurationError(
                "TaskGuard needs a database URL or a SQLAlchemy Engine, "
                f"not {type(url_or_engine).__name__}"
            )
        self.url = mask_url(self.engine.url)
        self._sa = self.engine.dialect
        self.dialect: Dialect = dialect_for(self._sa.name)
        self._serial: contextlib.AbstractContextManager[Any] = (
            threading.Lock()
            if self.dialect.serializes_threads(self.engine.url)
            else contextlib.nullcontext()
        )
        # On its own engine the guard keeps one connection (and cursor) checked out per
        # thread: a pool checkout + return per statement was most of taskguard's Python
        # overhead per acquire+release (docs/evidence/benchmarks.md). At most pool_size threads
        # pin one, so a big threads pool never starves the pool; the rest borrow per
        # statement. A thread's connection goes back when the thread ends, or on dispose().
        self._pin_limit = 0
        # Not every driver allows it: SQLite connections object to being closed from
        # another thread (a dead thread's connection is returned by the garbage collector).
        if self.owns_engine and self.dialect.pins_connections:
            size = getattr(self.engine.pool, "size", None)
            self._pin_limit = int(size()) if callable(size) else 0
        self._local = threading.local()
        self._pinned: weakref.WeakSet[_Pinned] = weakref.WeakSet()
        self._pin_lock = threading.Lock()
        self._opening = 0  # pins being connected (counted against the limit)
        if self._pin_limit and hasattr(os, "register_at_fork"):
            self_ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _forget_pinned_after_fork(self_ref))

    @contextlib.contextmanager
    def _borrow(self) -> Iterator[Any]:
        try:
            conn = self.engine.raw_connection()
        except Exception as exc:
            raise translate_error(exc, self.url, self.dialect, sent=False) from exc
        try:
            if self._toggle_autocommit and conn.dbapi_connection is not None:
                self._sa.set_isolation_level(conn.dbapi_connection, "AUTOCOMMIT")
            yield conn
        except BaseException as exc:
            if isinstance(exc, self._sa.loaded_dbapi.Error) and self._sa.is_disconnect(
                exc, conn.dbapi_connection, None
            ):
                conn.invalidate(exc)
                self._flush_pool()
            raise
        finally:
            if self._toggle_autocommit and conn.dbapi_connection is not None:
                with contextlib.suppress(Exception):
                    self._sa.reset_isolation_level(conn.dbapi_connection)
            conn.close()

    def run(
        self, stmt: Statement, values: Mapping[str, Any], deadline: float | None = None
    ) -> tuple[list[tuple[Any, ...]], int]:
        """Execute one statement in its own autocommit transaction, ended by
        ``deadline`` (``time.monotonic()``; also by the context's, :mod:`taskguard.
        deadline`; default: :data:`~taskguard.deadline.DEFAULT_STATEMENT_LIMIT`).

        Returns the rows (if any) and the affected row count.
        """
        pinned = getattr(self._local, "pinned", None)
        if stmt.unprepared is not None or pinned is None or pinned.watch is None:
            limit = (
                call_limit(deadline - time.monotonic()) if deadline else contextlib.nullcontext()
            )
            with limit:
                if stmt.unprepared is not None:
                    return self._on_cursor(_execute_either, stmt, values, self.dialect.prepares)
                return self._on_cursor(_execute, stmt, stmt.params(values), values)
        # This thread's pinned connection (the common case), inline: its watch armed
        # (see watchdog.keep), the statement run, the watch disarmed.
        watch, now = pinned.watch, time.monotonic()
        until = min(deadline or now + DEFAULT_STATEMENT_LIMIT, _DEADLINE.get() or math.inf)
        if until <= now:
            raise self._too_late()
        watch.deadline = until
        if until < watchdog.wake_at:
            watchdog.poke()
        try:
            rows = _execute(pinned.cursor, stmt, stmt.params(values), values)
        except Exception as exc:
            watch.deadline = math.inf  # before the connection is dropped: its fd may be reused
            failed = self._failed(exc, pinned, watch)
            if failed is exc:
                raise
            raise failed from exc
        watch.deadline = math.inf
        return rows

    def _too_late(self) -> DatabaseUnavailable:
        return DatabaseUnavailable(
            f"time limit for this call reached before a statement to {self.url} was sent",
            self.url,
            False,
        )

    def _failed(self, exc: Exception, pinned: _Pinned, watch: Watch | None) -> Exception:
        """What a statement's error on the pinned connection becomes (a broken
        connection is dropped first)."""
        if not isinstance(exc, self._sa.loaded_dbapi.Error):
            return exc
        if (watch is not None and watch.fired) or self._sa.is_disconnect(
            exc, pinned.conn.dbapi_connection, pinned.cursor
        ):
            self._local.pinned = None
            pinned.drop(exc)
            self._flush_pool()
        return self._timed_out(watch) or translate_error(exc, self.url, self.dialect)

    def _on_cursor(self, work: Callable[..., _T], *args: Any) -> _T:
        deadline = current_deadline()
        if deadline is not None and time.monotonic() >= deadline:
            raise self._too_late()
        watch: Watch | None = None
        pinned = self._pinned_connection() if self._pin_limit else None
        if pinned is not None:
            watch = watchdog.start(pinned.fd)
            try:
                try:
                    return work(pinned.cursor, *args)
                finally:
                    watchdog.stop(watch)  # before the connection is dropped: its fd may be reused
            except Exception as exc:
                failed = self._failed(exc, pinned, watch)
                if failed is exc:
                    raise
                raise failed from exc
        with self._serial:
            try:
                with self._borrow() as conn:
                    cur = conn.cursor()
                    try:
                        with watchdog.watch(self.dialect.socket_of(conn.dbapi_connection)) as watch:
                            return work(cur, *args)
                    except BaseException as exc:
                        if watch is not None and watch.fired:
                            conn.invalidate(exc)  # abandoned mid-statement: never reuse
                        raise
                    finally:
                        cur.close()
            except TaskGuardError:
                raise
            except Exception as exc:
                if isinstance(exc, (self._sa.loaded_dbapi.Error, sa_exc.SQLAlchemyError)):
                    raise self._timed_out(watch) or translate_error(
                        exc, self.url, self.dialect
                    ) from exc
                raise

    def _timed_out(self, watch: Watch | None) -> DatabaseUnavailable | None:
        if watch is None or not watch.fired:
            return None
        return DatabaseUnavailable(
            f"lock database {self.url} did not answer in time: the statement was abandoned "
            "(its connection shut down, never cancelled: a cancelled commit can still stand)",
            self.url,
            True,
        )

    def _flush_pool(self) -> None:
        # One dead connection usually means the server dropped them all (restart,
        # failover, pg_terminate_backend): never read back on another stale one.
        if self.owns_engine:
            self.engine.dispose()

    def _pinned_connection(self) -> _Pinned | None:
        pinned: _Pinned | None = getattr(self._local, "pinned", None)
        if pinned is not None and pinned.conn is not None:
            return pinned
        return self._pin()

    def _pin(self) -> _Pinned | None:
        with self._pin_lock:
            if len(self._pinned) + self._opening >= self._pin_limit:
                return None  # enough threads pin already: borrow per statement
            self._opening += 1
        try:
            # Not under the lock: another thread's renewal must not wait for our connect.
            conn = self.engine.raw_connection()
        except Exception as exc:
            raise translate_error(exc, self.url, self.dialect, sent=False) from exc
        finally:
            with self._pin_lock:
                self._opening -= 1
        pinned = _Pinned(conn, self.dialect.socket_of(conn.dbapi_connection))
        with self._pin_lock:
            self._pinned.add(pinned)
        self._local.pinned = pinned
        return pinned

    def dispose(self) -> None:
        """Close pooled connections if the guard created the engine."""
        if self.owns_engine:
            for pinned in list(self._pinned):
                pinned.drop()
            self._pinned = weakref.WeakSet()
            self._local = threading.local()
            self.engine.dispose()


def _execute(
    cur: Any, stmt: Statement, params: Any, values: Mapping[str, Any]
) -> tuple[list[tuple[Any, ...]], int]:
    cur.execute(stmt.sql, params)
    known = stmt.returns_rows
    rows = list(cur.fetchall()) if known or (known is None and cur.description) else []
    if stmt.then is not None and cur.rowcount > 0:
        # No UPDATE … RETURNING (MariaDB): read the rows back on the same connection.
        count = cur.rowcount
        cur.execute(stmt.then.sql, stmt.then.params(values))
        return list(cur.fetchall()), count
    return rows, cur.rowcount


def _execute_either(
    cur: Any, stmt: Statement, values: Mapping[str, Any], prepares: Callable[[Any], bool]
) -> tuple[list[tuple[Any, ...]], int]:
    if not prepares(cur) and stmt.unprepared is not None:
        stmt = stmt.unprepared
    return _execute(cur, stmt, stmt.params(values), values)


def _unpin(conn: Any, watch: Watch | None) -> None:
    watchdog.stop(watch)
    _give_back(conn)


def _give_back(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.close()


class _Pinned:
    """One thread's checked-out connection and cursor. Returned to the pool when the
    thread ends (its thread-local dies), on :meth:`drop`, or on dispose()."""

    __slots__ = ("__weakref__", "_finalizer", "conn", "cursor", "fd", "watch")

    def __init__(self, conn: Any, fd: int | None) -> None:
        self.conn: Any = conn
        self.cursor = conn.dbapi_connection.cursor()
        #: The connection's socket (for the statement watchdog), read once.
        self.fd = fd
        #: Its watch, armed per statement (None: no socket to watch, e.g. SQLite).
        self.watch = watchdog.keep(fd)
        # A dead thread's pin: its watch leaves the watchdog before the socket closes.
        self._finalizer = weakref.finalize(self, _unpin, conn, self.watch)
        self._finalizer.atexit = False  # a forked child must never close its parent's socket

    def drop(self, exc: BaseException | None = None) -> None:
        watchdog.stop(self.watch)
        self.watch = None
        conn, self.conn = self.conn, None
        self._finalizer.detach()
        if conn is None:
            return
        with contextlib.suppress(Exception):
            if exc is not None:
                conn.invalidate(exc)
            else:
                conn.close()

    def forget(self) -> None:
        """After fork: the socket is the parent's; keep it referenced, never touch it."""
        self.watch = None
        self._finalizer.detach()
        _INHERITED.append(self.conn)
        self.conn = None


#: Connections a forked child inherited pinned: kept referenced so they are never closed.
_INHERITED: list[Any] = []


def _forget_pinned_after_fork(ref: weakref.ref[Executor]) -> None:
    executor = ref()
    if executor is not None:
        for pinned in list(executor._pinned):
            pinned.forget()
        executor._pinned = weakref.WeakSet()
        executor._local = threading.local()
        # A thread of the parent may have held the lock at the fork (e.g. a Celery
        # worker's main process releasing a dead child's lease while billiard forks
        # its replacement): the child's copy would stay locked forever.
        executor._pin_lock = threading.Lock()
        executor._opening = 0
