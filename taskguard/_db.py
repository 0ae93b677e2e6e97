"""Connections for lock statements, and the one place driver errors are translated.

Lock statements never run inside a caller's transaction: each is its own
autocommit round trip on a pooled DBAPI connection that the guard borrows for
that statement alone.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import StaticPool

from taskguard.dialects import LockSQL, Statement, lock_sql_for
from taskguard.exceptions import (
    ConfigurationError,
    DatabaseUnavailable,
    SchemaMissing,
    TaskGuardError,
)

__all__ = ["Executor", "mask_url", "translate_error"]

# SQLite waits this long for another process's write to finish before giving up.
SQLITE_BUSY_TIMEOUT = 30.0


def mask_url(url: str | URL) -> str:
    """The URL with its password replaced by ``***`` (safe for logs and errors)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
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
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.close()

    return engine


def _dispose_after_fork(ref: weakref.ref[Engine]) -> None:
    engine = ref()
    if engine is not None:
        # The parent's sockets must not be shared; drop them without closing.
        engine.dispose(close=False)


def translate_error(exc: BaseException, url: str) -> TaskGuardError:
    """Map a driver/SQLAlchemy exception to taskguard's hierarchy."""
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
    return DatabaseUnavailable(f"lock database {url} unavailable: {first}", url)


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

    @contextlib.contextmanager
    def _borrow(self) -> Iterator[Any]:
        try:
            conn = self.engine.raw_connection()
        except Exception as exc:
            raise translate_error(exc, self.url) from exc
        try:
            if self._toggle_autocommit and conn.dbapi_connection is not None:
                self.dialect.set_isolation_level(conn.dbapi_connection, "AUTOCOMMIT")
            yield conn
        except BaseException as exc:
            if isinstance(exc, self.dialect.loaded_dbapi.Error) and self.dialect.is_disconnect(
                exc, conn.dbapi_connection, None
            ):
                conn.invalidate(exc)
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

    def dispose(self) -> None:
        """Close pooled connections if the guard created the engine."""
        if self.owns_engine:
            self.engine.dispose()
