"""Connections for lock statements, and the one place driver errors are translated.

Lock statements never run inside a caller's transaction: each is its own
autocommit round trip on a pooled DBAPI connection that the guard borrows for
that statement alone.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import psycopg
from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import StaticPool

from taskguard.dialects import LockSQL, Statement, lock_sql_for
from taskguard.exceptions import (
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailable,
    PermissionDenied,
    SchemaMissing,
    TaskGuardError,
)

__all__ = ["Executor", "mask_url", "translate_error"]

# SQLite waits this long for another process's write to finish before giving up.
SQLITE_BUSY_TIMEOUT = 30.0


#: Query parameters that carry a secret (libpq and psycopg accept the password there too).
_SECRET_PARAMS = frozenset({"password", "passwd", "pass", "sslpassword", "sslkey_password"})


def mask_url(url: str | URL) -> str:
    """The URL with its password (in the userinfo or as a query parameter) replaced
    by ``***``: safe for logs and errors."""
    try:
        parsed = make_url(url)
        secret = {k: "***" for k in parsed.query if k.lower() in _SECRET_PARAMS}
        if secret:
            parsed = parsed.update_query_dict(secret)
        # The renderer percent-encodes query values; show the mask as in the userinfo.
        return parsed.render_as_string(hide_password=True).replace("=%2A%2A%2A", "=***")
    except Exception:
        return "<unparseable database URL>"


def _is_memory_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def create_lock_engine(url: str | URL, *, durable: bool = True, **kwargs: Any) -> Engine:
    """An engine configured for lock statements: autocommit, and for SQLite WAL
    plus a busy timeout so several processes can share one file.

    ``durable=False`` (PostgreSQL) commits lock statements with
    ``synchronous_commit=off``: faster, but grants acknowledged in the last few
    hundred milliseconds before a database crash can be lost (docs/reliability.md).
    """
    try:
        parsed = make_url(url)
    except sa_exc.ArgumentError as exc:
        raise ConfigurationError(f"invalid database URL {mask_url(url)!r}: {exc}") from None
    options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", **kwargs}
    if options["isolation_level"] == "AUTOCOMMIT":
        # Every statement commits by itself, so a connection never goes back to the
        # pool inside a transaction: the pool's ROLLBACK-on-return is pure overhead
        # on the hot path (one per lock statement).
        options.setdefault("pool_reset_on_return", None)
    if parsed.get_backend_name() == "sqlite":
        connect_args = options.setdefault("connect_args", {})
        connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT)
        if _is_memory_sqlite(parsed):
            # One shared in-memory database for every thread of the process.
            connect_args.setdefault("check_same_thread", False)
            options.setdefault("poolclass", StaticPool)
    try:
        engine = create_engine(parsed, **options)
    except (sa_exc.ArgumentError, ImportError) as exc:
        raise ConfigurationError(f"cannot use database URL {mask_url(url)!r}: {exc}") from None
    if not durable:
        if parsed.get_backend_name() != "postgresql":
            raise ConfigurationError("durable=False (relaxed durability) needs PostgreSQL")

        @event.listens_for(engine, "connect")
        def _relaxed(dbapi_conn: Any, _record: Any) -> None:
            prev = dbapi_conn.autocommit
            dbapi_conn.autocommit = True
            dbapi_conn.execute("SET synchronous_commit TO off")
            dbapi_conn.autocommit = prev

    if parsed.get_backend_name() == "sqlite" and not _is_memory_sqlite(parsed):

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # WAL persists in the file, so only the first connection ever switches. The
            # switch needs an exclusive lock and ignores the busy timeout: processes
            # opening a freshly migrated file together must take turns, not fail.
            cur = dbapi_conn.cursor()
            try:
                deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT
                while cur.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    try:
                        cur.execute("PRAGMA journal_mode=WAL")
                    except sqlite3.OperationalError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.01)
            finally:
                cur.close()

    return engine


def _dispose_after_fork(ref: weakref.ref[Engine]) -> None:
    engine = ref()
    if engine is not None:
        # The parent's sockets must not be shared; drop them without closing.
        engine.dispose(close=False)


# SQLSTATE classes that mean "the server or the connection is in trouble" (retryable):
# connection exception, operator intervention, insufficient resources, system error,
# transaction rollback (serialization failure / deadlock).
_OUTAGE_CLASSES = ("08", "57", "53", "58", "40")
_SQLITE_OUTAGE = ("database is locked", "unable to open", "disk i/o", "database is full")


def translate_error(exc: BaseException, url: str, *, sent: bool = True) -> TaskGuardError:
    """Map a driver/SQLAlchemy exception to taskguard's hierarchy.

    ``sent=False`` says no statement reached the server (the connection could not be
    opened), so the caller knows the operation did not happen.
    """
    if isinstance(exc, TaskGuardError):
        return exc
    text = str(getattr(exc, "orig", None) or exc)
    low = text.lower()
    sqlstate = getattr(exc, "sqlstate", None) or getattr(
        getattr(exc, "orig", None), "sqlstate", None
    )
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if (
        sqlstate == "42703"
        or "no such column" in low
        or (sqlstate is None and "column" in low and "does not exist" in low)
    ):
        # A column a newer migration adds: the code was deployed before the upgrade.
        return SchemaMissing(
            f"taskguard's schema in {url} is older than this version of taskguard: run "
            f"`taskguard db upgrade --database-url ...` ({first})"
        )
    if (
        sqlstate == "42P01"
        or "no such table" in low
        or ("does not exist" in low and ("task_locks" in low or "relation" in low))
    ):
        return SchemaMissing(
            f"taskguard's tables are missing in {url}: run `taskguard db upgrade "
            f"--database-url ...` first ({first})"
        )
    if sqlstate == "42501" or "permission denied" in low or "readonly database" in low:
        return PermissionDenied(
            f"the database role lacks a privilege on taskguard's objects in {url}: {first} "
            "(see docs/reliability.md, 'Least privilege')",
            url,
        )
    outage = (
        not sent
        or (sqlstate is None and not isinstance(getattr(exc, "orig", exc), _STATEMENT_ERRORS))
        or (sqlstate is not None and sqlstate[:2] in _OUTAGE_CLASSES)
        or any(marker in low for marker in _SQLITE_OUTAGE)
    )
    if outage:
        return DatabaseUnavailable(f"lock database {url} unavailable: {first}", url, sent)
    return DatabaseError(f"lock statement refused by {url}: {first}", url)


# Driver errors that mean the statement itself was refused, not the connection.
_STATEMENT_ERRORS: tuple[type[BaseException], ...] = (
    sqlite3.IntegrityError,
    sqlite3.DataError,
    sqlite3.ProgrammingError,
    psycopg.DataError,
    psycopg.IntegrityError,
    psycopg.ProgrammingError,
)


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
        self.dialect = self.engine.dialect
        try:
            self.sql: LockSQL = lock_sql_for(self.dialect)
        except NotImplementedError as exc:
            raise ConfigurationError(str(exc)) from None
        # One in-memory SQLite connection is shared by all threads: take turns.
        self._serial = (
            threading.Lock() if _is_memory_sqlite(self.engine.url) else contextlib.nullcontext()
        )
        # On its own engine the guard keeps one connection (and cursor) checked out per
        # thread: a pool checkout + return per statement was most of taskguard's Python
        # overhead per acquire+release (docs/benchmarks.md). At most pool_size threads
        # pin one, so a big threads pool never starves the pool; the rest borrow per
        # statement. A thread's connection goes back when the thread ends, or on dispose().
        self._pin_limit = 0
        # PostgreSQL only: SQLite connections object to being closed from another
        # thread (a dead thread's connection is returned by the garbage collector).
        if self.owns_engine and self.dialect.name == "postgresql":
            size = getattr(self.engine.pool, "size", None)
            self._pin_limit = int(size()) if callable(size) else 0
        self._local = threading.local()
        self._pinned: weakref.WeakSet[_Pinned] = weakref.WeakSet()
        self._pin_lock = threading.Lock()
        if self._pin_limit and hasattr(os, "register_at_fork"):
            self_ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _forget_pinned_after_fork(self_ref))

    @contextlib.contextmanager
    def _borrow(self) -> Iterator[Any]:
        try:
            conn = self.engine.raw_connection()
        except Exception as exc:
            raise translate_error(exc, self.url, sent=False) from exc
        try:
            if self._toggle_autocommit and conn.dbapi_connection is not None:
                self.dialect.set_isolation_level(conn.dbapi_connection, "AUTOCOMMIT")
            yield conn
        except BaseException as exc:
            if isinstance(exc, self.dialect.loaded_dbapi.Error) and self.dialect.is_disconnect(
                exc, conn.dbapi_connection, None
            ):
                conn.invalidate(exc)
                self._flush_pool()
            raise
        finally:
            if self._toggle_autocommit and conn.dbapi_connection is not None:
                with contextlib.suppress(Exception):
                    self.dialect.reset_isolation_level(conn.dbapi_connection)
            conn.close()

    def run(self, stmt: Statement, values: dict[str, Any]) -> tuple[list[tuple[Any, ...]], int]:
        """Execute one statement in its own autocommit transaction.

        Returns the rows (if any) and the affected row count.
        """
        params = stmt.params(values)
        pinned = self._pinned_connection() if self._pin_limit else None
        if pinned is not None:
            cur = pinned.cursor
            try:
                cur.execute(stmt.sql, params)
                rows = cur.fetchall() if cur.description is not None else []
                return rows, cur.rowcount
            except Exception as exc:
                if isinstance(exc, self.dialect.loaded_dbapi.Error):
                    if self.dialect.is_disconnect(exc, pinned.conn.dbapi_connection, cur):
                        self._local.pinned = None
                        pinned.drop(exc)
                        self._flush_pool()
                    raise translate_error(exc, self.url) from exc
                raise
        with self._serial:
            try:
                with self._borrow() as conn:
                    cur = conn.cursor()
                    try:
                        cur.execute(stmt.sql, params)
                        rows = cur.fetchall() if cur.description is not None else []
                        return rows, cur.rowcount
                    finally:
                        cur.close()
            except TaskGuardError:
                raise
            except Exception as exc:
                if isinstance(exc, (self.dialect.loaded_dbapi.Error, sa_exc.SQLAlchemyError)):
                    raise translate_error(exc, self.url) from exc
                raise

    def _flush_pool(self) -> None:
        # One dead connection usually means the server dropped them all (restart,
        # failover, pg_terminate_backend): never read back on another stale one.
        if self.owns_engine:
            self.engine.dispose()

    def _pinned_connection(self) -> _Pinned | None:
        pinned: _Pinned | None = getattr(self._local, "pinned", None)
        if pinned is not None and pinned.conn is not None:
            return pinned
        with self._pin_lock:
            if len(self._pinned) >= self._pin_limit:
                return None  # enough threads pin already: borrow per statement
            try:
                pinned = _Pinned(self.engine.raw_connection())
            except Exception as exc:
                raise translate_error(exc, self.url, sent=False) from exc
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


def _give_back(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.close()


class _Pinned:
    """One thread's checked-out connection and cursor. Returned to the pool when the
    thread ends (its thread-local dies), on :meth:`drop`, or on dispose()."""

    __slots__ = ("__weakref__", "_finalizer", "conn", "cursor")

    def __init__(self, conn: Any) -> None:
        self.conn: Any = conn
        self.cursor = conn.dbapi_connection.cursor()
        self._finalizer = weakref.finalize(self, _give_back, conn)
        self._finalizer.atexit = False  # a forked child must never close its parent's socket

    def drop(self, exc: BaseException | None = None) -> None:
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
