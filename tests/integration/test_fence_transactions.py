"""Issue 41, defects 4 and 8: a fence taken inside the caller's transaction, and the
release called before that transaction ends (on the same thread). The release used
to wait for the fence's own row lock until the call timeout, then fail, and the
caller's transaction was lost; now it happens right after the transaction ends
(commit or rollback). Real databases, no mocks."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session

from taskguard import ConfigurationError, DatabaseUnavailable, TaskGuard
from taskguard.fencing import FENCED

KEY = "invoice:41"
#: A release that waited for its own fence took the call timeout (10 s); one that
#: does not takes milliseconds. Wide room for a loaded 2-core machine.
QUICK = 4.0


def _engine(url: str) -> Engine:
    """The application's engine; on SQLite with SQLAlchemy's recipe for pysqlite, which
    otherwise begins no transaction before a SAVEPOINT (whose release then commits)."""
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", lambda dbapi, _: setattr(dbapi, "isolation_level", None))
        event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN"))
    return engine


def _business_table(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE invoices (number VARCHAR(20), token BIGINT)"))
    engine.dispose()


def _numbers(url: str) -> list[str]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = [r[0] for r in conn.execute(text("SELECT number FROM invoices ORDER BY number"))]
    engine.dispose()
    return rows


def _write(session: Any, number: str, token: int) -> None:
    session.execute(
        text("INSERT INTO invoices (number, token) VALUES (:n, :t)"), {"n": number, "t": token}
    )


def _free(guard: TaskGuard) -> bool:
    info = guard.get(KEY)
    return info is None or not info.held


def test_a_release_inside_the_sessions_fenced_transaction_waits_for_its_commit(
    db_url: str,
) -> None:
    _business_table(db_url)
    guard, engine = TaskGuard(db_url), _engine(db_url)
    try:
        started = time.monotonic()
        with Session(engine) as session, session.begin():
            lease = guard.acquire(KEY, 30)
            assert lease is not None
            with session.begin_nested():
                _write(session, "A-1", lease.fence(session))
            assert guard.release(lease)  # before the outer commit
            _write(session, "A-2", lease.token)
        took = time.monotonic() - started
        assert took < QUICK, f"the release waited for its own fence: {took:.1f}s"
        assert _numbers(db_url) == ["A-1", "A-2"]
        assert _free(guard)
        assert lease.owner not in FENCED  # nothing left behind
        assert not guard.release(lease)  # released once, by the deferred release
    finally:
        engine.dispose()
        guard.dispose()


def test_a_release_inside_the_fenced_transaction_happens_after_a_rollback_too(
    db_url: str,
) -> None:
    _business_table(db_url)
    guard, engine = TaskGuard(db_url), _engine(db_url)
    try:
        started = time.monotonic()
        with (
            pytest.raises(RuntimeError, match="view failed"),
            Session(engine) as session,
            session.begin(),
        ):
            with guard.lock(KEY, 30) as lease, session.begin_nested():
                _write(session, "B-1", lease.fence(session))
            raise RuntimeError("view failed")
        assert time.monotonic() - started < QUICK
        assert _numbers(db_url) == []
        assert _free(guard)
    finally:
        engine.dispose()
        guard.dispose()


def test_a_release_inside_a_fenced_connections_transaction_is_refused_at_once(
    db_url: str,
) -> None:
    """A Core Connection has no hook after its commit: the release is refused before
    it waits, the transaction is untouched and commits, and the release then works."""
    _business_table(db_url)
    guard, engine = TaskGuard(db_url), _engine(db_url)
    try:
        lease = guard.acquire(KEY, 30)
        assert lease is not None
        with engine.connect() as conn:
            with conn.begin():
                _write(conn, "C-1", lease.fence(conn))
                started = time.monotonic()
                with pytest.raises(ConfigurationError, match="commit the transaction that"):
                    guard.release(lease)
                assert time.monotonic() - started < QUICK
            assert guard.release(lease)
        assert _numbers(db_url) == ["C-1"]
        assert _free(guard)
    finally:
        engine.dispose()
        guard.dispose()


def test_sqlite_acquire_inside_the_threads_own_write_transaction_says_so(
    sqlite_url: str,
) -> None:
    """Defect 8 (b): it said the connection broke."""
    _business_table(sqlite_url)
    # SQLite's busy timeout (30 s by default) is how long the acquire waits first.
    guard = TaskGuard(sqlite_url, connect_args={"timeout": 1.0})
    engine = _engine(sqlite_url)
    try:
        assert _free(guard)  # the guard has its connection (and WAL) already
        with Session(engine) as session, session.begin():
            _write(session, "D-1", 0)
            with pytest.raises(DatabaseUnavailable) as err:
                guard.acquire(KEY, 30)
        message = str(err.value)
        assert "write transaction" in message and "commit" in message, message
        assert "broke" not in message, message
        assert not err.value.statement_sent  # nothing was changed: no read-back
        with Session(engine) as session, session.begin():
            _write(session, "D-2", 0)
        assert guard.acquire(KEY, 30) is not None  # once it committed
    finally:
        engine.dispose()
        guard.dispose()


def test_a_fenced_lease_that_is_never_released_leaves_nothing_behind(db_url: str) -> None:
    guard, engine = TaskGuard(db_url), _engine(db_url)
    try:
        forgotten, other = guard.acquire(KEY, 30), guard.acquire("invoice:42", 30)
        assert forgotten is not None and other is not None
        with Session(engine) as session, session.begin():
            forgotten.fence(session)
        assert forgotten.owner in FENCED  # its transaction has ended; never released
        with Session(engine) as session, session.begin():
            other.fence(session)  # the next fence drops records of ended transactions
        assert forgotten.owner not in FENCED
        assert guard.release(other)  # at once: its transaction has ended
        assert other.owner not in FENCED
    finally:
        engine.dispose()
        guard.dispose()
