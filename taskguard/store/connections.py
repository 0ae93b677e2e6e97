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
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import URL, Engine, create_engine, event
from sqlalchemy import exc as sa_exc

import taskguard.deadline as limits
from taskguard.deadline import (
    _DEADLINE,
    Watch,
    current_deadline,
    watchdog,
    within,
)
from taskguard.dialects import Dialect, Statement, dialect_for, dialect_for_url
from taskguard.exceptions import ConfigurationError, DatabaseUnavailable
from taskguard.store.errors import translate_error
from taskguard.urls import mask_url, parse_url

__all__ = ["Executor", "create_lock_engine"]

#: No deadline (a watch disarmed).
_INF = math.inf


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
        self._serial = (
            threading.Lock() if self.dialect.serializes_threads(self.engine.url) else None
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

    def run(
        self, stmt: Statement, values: Mapping[str, Any], deadline: float | None = None
    ) -> tuple[list[tuple[Any, ...]], int]:
        """Execute one statement in its own autocommit transaction, ended by
        ``deadline`` (``time.monotonic()``), by the context's (:mod:`taskguard.
        deadline`) and by :data:`~taskguard.deadline.DEFAULT_STATEMENT_LIMIT`,
        whichever comes first.

        Returns the rows (if any) and the affected row count. It runs on this
        thread's pinned connection, else on one borrowed for it (:meth:`_connection`),
        the same way: the connection's watch armed with the deadline (see
        :meth:`watchdog.keep <taskguard.deadline._Watchdog.keep>`), the statement
        run, the watch disarmed; an error classified by :meth:`_failed`.
        """
        now = time.monotonic()  # the default limit read here: tests shorten it
        until = min(now + limits.DEFAULT_STATEMENT_LIMIT, deadline or _INF, _DEADLINE.get() or _INF)
        if until <= now:
            raise DatabaseUnavailable(
                f"time limit for this call reached before a statement to {self.url} was sent",
                self.url,
                False,
            )
        conn = getattr(self._local, "pinned", None) or self._connection(until, deadline)
        conn.watch.deadline = until
        if until < watchdog.wake_at:
            watchdog.poke()
        if stmt.unprepared is not None and not conn.prepares:
            stmt = stmt.unprepared  # behind a pooler: no named statements
        try:
            return _execute(conn.cursor, stmt, stmt.params(values), values)
        except BaseException as exc:
            failed = self._failed(exc, conn)
            if failed is exc:
                raise
            raise failed from exc
        finally:
            conn.watch.deadline = _INF  # also when dropped: the watch stays its object
            if conn.borrowed:
                self._give_back(conn)

    def _failed(self, exc: BaseException, conn: _Conn) -> BaseException:
        """What a statement's error becomes; a connection it broke, or whose socket
        the watchdog shut down, is dropped first (never reused mid-statement)."""
        fired = conn.watch.fired
        raw = getattr(conn.conn, "dbapi_connection", None)
        error = self._sa.loaded_dbapi.Error
        if fired or (isinstance(exc, error) and self._sa.is_disconnect(exc, raw, conn.cursor)):
            self._local.pinned = None  # a borrowed one's thread pins none
            conn.drop(exc)
            self._flush_pool()
        if not isinstance(exc, error):
            return exc
        if fired:
            return DatabaseUnavailable(
                f"lock database {self.url} did not answer in time: the statement was "
                "abandoned (its connection shut down, never cancelled: a cancelled commit "
                "can still stand)",
                self.url,
                True,
            )
        return translate_error(exc, self.url, self.dialect)

    def _flush_pool(self) -> None:
        # One dead connection usually means the server dropped them all (restart,
        # failover, pg_terminate_backend): never read back on another stale one.
        if self.owns_engine:
            self.engine.dispose()

    def _connection(self, until: float, deadline: float | None) -> _Conn:
        """A connection for this thread to pin (at most ``pool_size`` threads pin one,
        so a big threads pool never starves the pool), else one borrowed for one
        statement; opened by ``until``."""
        token = _DEADLINE.set(until) if deadline is not None else None
        try:
            pinned = self._pin() if self._pin_limit else None
            return pinned or self._borrow()
        finally:
            if token is not None:
                _DEADLINE.reset(token)

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
        pinned = _Pinned(conn, self.dialect)
        with self._pin_lock:
            self._pinned.add(pinned)
        self._local.pinned = pinned
        return pinned

    def _borrow(self) -> _Conn:
        """A connection from the pool for one statement, in autocommit; threads that
        must take turns (``serializes_threads``) hold their turn until it goes back."""
        if self._serial is not None:
            self._serial.acquire()
        conn = None
        try:
            conn = self.engine.raw_connection()
            if self._toggle_autocommit and conn.dbapi_connection is not None:
                self._sa.set_isolation_level(conn.dbapi_connection, "AUTOCOMMIT")
            return _Conn(conn, self.dialect)
        except BaseException as exc:
            if conn is not None:
                _give_back(conn)
            if self._serial is not None:
                self._serial.release()
            if isinstance(exc, Exception):
                raise translate_error(exc, self.url, self.dialect, sent=False) from exc
            raise

    def _give_back(self, conn: _Conn) -> None:
        """A borrowed connection back to the pool (unless it was dropped), its
        isolation level restored, and the thread's turn ended."""
        try:
            conn.cursor.close()
            raw = getattr(conn.conn, "dbapi_connection", None)
            if self._toggle_autocommit and raw is not None:
                with contextlib.suppress(Exception):
                    self._sa.reset_isolation_level(raw)
        finally:
            conn.drop()
            if self._serial is not None:
                self._serial.release()

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
    # returns_rows None: unknown (text), read from the cursor.
    rows = [*cur.fetchall()] if (k := stmt.returns_rows) or (k is None and cur.description) else []
    if stmt.then is not None and cur.rowcount > 0:
        # No UPDATE … RETURNING (MariaDB): read the rows back on the same connection.
        count = cur.rowcount
        cur.execute(stmt.then.sql, stmt.then.params(values))
        return list(cur.fetchall()), count
    return rows, cur.rowcount


def _unpin(conn: Any, watch: Watch | None) -> None:
    watchdog.stop(watch)
    _give_back(conn)


def _give_back(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.close()


class _Conn:
    """A pool connection and its cursor, borrowed for one statement, with the watch
    on its socket, armed per statement (one the watchdog never sees where there is no
    socket to watch, e.g. SQLite)."""

    __slots__ = ("conn", "cursor", "prepares", "watch")
    #: Given back after its statement (a :class:`_Pinned` one is kept by its thread).
    borrowed = True

    def __init__(self, conn: Any, dialect: Dialect) -> None:
        self.conn: Any = conn
        self.cursor = conn.dbapi_connection.cursor()
        #: Whether named statements are kept (else :attr:`Statement.unprepared` is sent).
        self.prepares = dialect.prepares(self.cursor)
        self.watch = watchdog.keep(dialect.socket_of(conn.dbapi_connection))

    def drop(self, exc: BaseException | None = None) -> None:
        """Its watch out of the watchdog first (the socket's fd may be reused), then
        the connection back to the pool, or invalidated (``exc``: it broke)."""
        watchdog.stop(self.watch)
        conn, self.conn = self.conn, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            if exc is not None:
                conn.invalidate(exc)
            else:
                conn.close()


class _Pinned(_Conn):
    """One thread's checked-out connection and cursor. Returned to the pool when the
    thread ends (its thread-local dies), on :meth:`drop`, or on dispose()."""

    __slots__ = ("__weakref__", "_finalizer")
    borrowed = False

    def __init__(self, conn: Any, dialect: Dialect) -> None:
        super().__init__(conn, dialect)
        # A dead thread's pin: its watch leaves the watchdog before the socket closes.
        self._finalizer = weakref.finalize(self, _unpin, conn, self.watch)
        self._finalizer.atexit = False  # a forked child must never close its parent's socket

    def drop(self, exc: BaseException | None = None) -> None:
        self._finalizer.detach()
        super().drop(exc)

    def forget(self) -> None:
        """After fork: the socket is the parent's; keep it referenced, never touch it."""
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
