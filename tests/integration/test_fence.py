"""Same-database fencing (``lease.fence(session)``): a stale holder's commit fails,
and a takeover waits for a fenced transaction. Real processes, real databases."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from taskguard import ConfigurationError, LeaseLost, TaskGuard

KEY = "invoice:42"


def _business_table(url: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE invoices (writer VARCHAR(20), token BIGINT)"))
    engine.dispose()


def _invoices(url: str) -> list[tuple[Any, ...]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = [tuple(r) for r in conn.execute(text("SELECT writer, token FROM invoices"))]
    engine.dispose()
    return rows


def _write(session: Session, writer: str, token: int) -> None:
    session.execute(
        text("INSERT INTO invoices (writer, token) VALUES (:w, :t)"), {"w": writer, "t": token}
    )


def _stale_holder(url: str, acquired: Any, taken: Any, out: Any) -> None:
    guard = TaskGuard(url)
    lease = guard.acquire(KEY, 0.3)
    assert lease is not None
    acquired.set()
    # A GC pause / stalled worker: the lease expires and is taken over. (An event, not a
    # fixed sleep: on a loaded machine the takeover can come later than any sleep.)
    assert taken.wait(60)
    engine = create_engine(url)
    try:
        with Session(engine) as session, session.begin():
            _write(session, "stale", lease.token)
            lease.fence(session)
        out.put("committed")
    except LeaseLost as exc:
        out.put(f"lost: {exc.reason}")
    engine.dispose()
    guard.dispose()


def test_a_stale_holders_fenced_commit_fails(db_url: str) -> None:
    _business_table(db_url)
    ctx = mp.get_context("fork")
    acquired, taken, out = ctx.Event(), ctx.Event(), ctx.Queue()
    stale = ctx.Process(target=_stale_holder, args=(db_url, acquired, taken, out))
    stale.start()
    assert acquired.wait(30)
    guard, engine = TaskGuard(db_url), create_engine(db_url)
    try:
        lease = guard.acquire(KEY, 30, wait=30)  # granted once the stale lease expires
        assert lease is not None
        with Session(engine) as session, session.begin():
            token = lease.fence(session)
            _write(session, "current", token)
        taken.set()
        outcome = out.get(timeout=30)
        stale.join(timeout=30)
        assert stale.exitcode == 0
        assert outcome.startswith("lost: fence failed"), outcome
        assert _invoices(db_url) == [("current", lease.token)]
    finally:
        engine.dispose()
        guard.dispose()


def _fenced_slow_writer(url: str, fenced: Any, out: Any) -> None:
    guard, engine = TaskGuard(url), create_engine(url)
    lease = guard.acquire(KEY, 0.5)
    assert lease is not None
    with Session(engine) as session, session.begin():
        lease.fence(session)
        fenced.set()
        time.sleep(1.0)  # the lease expires while the fenced transaction is open
        _write(session, "slow", lease.token)
    out.put(time.time())
    engine.dispose()
    guard.dispose()


def test_a_takeover_waits_for_the_fenced_transaction(db_url: str) -> None:
    _business_table(db_url)
    ctx = mp.get_context("fork")
    fenced, out = ctx.Event(), ctx.Queue()
    writer = ctx.Process(target=_fenced_slow_writer, args=(db_url, fenced, out))
    writer.start()
    assert fenced.wait(30)
    time.sleep(0.7)  # the writer's lease has expired by now
    guard = TaskGuard(db_url)
    try:
        lease = guard.acquire(KEY, 30)
        granted = time.time()
        committed = out.get(timeout=30)
        writer.join(timeout=30)
        assert writer.exitcode == 0
        assert lease is not None
        # The takeover happened only after the old holder's transaction committed. A
        # takeover that did not wait would come ~0.3 s before the commit; the margin
        # covers the commit reply reaching the writer late (a loaded machine, a pooler).
        assert granted >= committed - 0.1
        assert [w for w, _ in _invoices(db_url)] == ["slow"]
    finally:
        guard.dispose()


def test_fence_returns_the_token_and_fails_once_released(db_url: str) -> None:
    guard, engine = TaskGuard(db_url), create_engine(db_url)
    try:
        lease = guard.acquire(KEY, 30)
        assert lease is not None
        with engine.begin() as conn:
            assert lease.fence(conn) == lease.token
        with Session(engine) as session, session.begin():
            assert guard.fence(lease, session) == lease.token
        assert guard.release(lease)
        with Session(engine) as session, pytest.raises(LeaseLost) as err, session.begin():
            lease.fence(session)
        assert err.value.key == KEY and err.value.owner == lease.owner
    finally:
        engine.dispose()
        guard.dispose()


def test_fence_needs_a_session_or_connection(guard: TaskGuard) -> None:
    lease = guard.acquire(KEY, 30)
    assert lease is not None
    with pytest.raises(ConfigurationError, match="Session or Connection"):
        lease.fence(guard.engine)  # type: ignore[arg-type]
