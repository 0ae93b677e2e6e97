"""TaskGuard against real PostgreSQL and SQLite databases."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from taskguard import InvalidArgument, InvalidKey, InvalidTTL, LockHeld, SchemaMissing, TaskGuard
from taskguard.models import TaskLock
from taskguard.validation import normalize_key


def test_acquire_conflict_then_release(guard: TaskGuard) -> None:
    lease = guard.acquire("feed:a", 30, task_name="import_feed", task_id="t1")
    assert lease is not None and lease.key == "feed:a" and lease.token > 0
    assert lease.expires_at - lease.acquired_at == timedelta(seconds=30)
    assert guard.acquire("feed:a", 30) is None
    assert guard.release(lease) is True
    again = guard.acquire("feed:a", 30)
    assert again is not None and again.token > lease.token


def test_conflict_is_logged_with_holder(guard: TaskGuard, caplog: pytest.LogCaptureFixture) -> None:
    lease = guard.acquire("k", 30, task_name="import_feed", task_id="abc")
    assert lease is not None
    with caplog.at_level(logging.INFO, logger="taskguard"):
        assert guard.acquire("k", 30) is None
    msg = "\n".join(r.getMessage() for r in caplog.records)
    assert "'k'" in msg and lease.owner in msg and "import_feed" in msg and "abc" in msg


def test_takeover_after_expiry_gets_higher_token(guard: TaskGuard) -> None:
    first = guard.acquire("k", 0.2)
    assert first is not None
    time.sleep(0.3)
    second = guard.acquire("k", 30)
    assert second is not None and second.token > first.token
    # The stale owner can neither release nor renew the new holder's row.
    assert guard.release(first) is False
    assert guard.renew(first) is False
    info = guard.get("k")
    assert info is not None and info.owner == second.owner and info.held


def test_renew_extends_by_database_clock(guard: TaskGuard) -> None:
    # 2 s, not 0.5: a loaded machine can stall that long between two statements.
    lease = guard.acquire("k", 2)
    assert lease is not None
    before = lease.expires_at
    assert guard.renew(lease, 60) is True
    assert lease.expires_at > before + timedelta(seconds=50)
    while guard.db_now() <= before:  # past the first expiry, by the database's clock
        time.sleep(0.05)
    assert guard.acquire("k", 1) is None  # renewal kept it


def test_expired_lease_cannot_be_renewed_or_released(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 0.1)
    assert lease is not None
    time.sleep(0.2)
    assert guard.renew(lease) is False
    assert guard.release(lease) is False


def test_tokens_never_go_back_after_reaping(guard: TaskGuard) -> None:
    seen = []
    for _ in range(3):
        lease = guard.acquire("k", 30)
        assert lease is not None
        seen.append(lease.token)
        assert guard.release(lease)
        assert guard.reap(grace=0) == 1  # the row is gone
        assert guard.get("k") is None
    assert seen == sorted(seen) and len(set(seen)) == 3


def test_lock_context_manager(guard: TaskGuard) -> None:
    with guard.lock("ctx", 30) as lease:
        with pytest.raises(LockHeld) as err, guard.lock("ctx", 30):
            pass
        assert err.value.key == "ctx"
        assert err.value.holder is not None and err.value.holder.owner == lease.owner
        assert err.value.expires_at == lease.expires_at
    assert guard.get("ctx") is not None and not guard.get("ctx").held  # type: ignore[union-attr]


def test_held_prefix_get_and_force_release(guard: TaskGuard) -> None:
    a = guard.acquire("feed:a", 30, task_name="t", task_id="1", hostname="h1", pid=42)
    guard.acquire("feed:b", 30)
    guard.acquire("Feed:c", 30)  # prefix match is case-sensitive on both backends
    guard.acquire("100%_x", 30)
    short = guard.acquire("other", 0.05)
    assert a is not None and short is not None
    time.sleep(0.1)
    assert [i.key for i in guard.held("feed:")] == ["feed:a", "feed:b"]
    assert [i.key for i in guard.held("100%")] == ["100%_x"]
    assert "other" not in [i.key for i in guard.held()]
    assert "other" in [i.key for i in guard.held(include_expired=True)]
    info = guard.get("feed:a")
    assert info is not None and info.holder.hostname == "h1" and info.holder.pid == 42
    assert info.expires_in > timedelta(seconds=20)
    assert guard.force_release("feed:a") is True
    assert guard.force_release("feed:a") is False
    assert guard.release(a) is False
    assert guard.get("missing") is None


def test_a_prefix_is_normalised_as_keys_are(guard: TaskGuard) -> None:
    """Issue 41, defect 8a: keys are stored in NFC; held(prefix=) (and `taskguard locks
    --prefix`) compared the prefix as typed, so a decomposed "é" listed nothing."""
    assert guard.acquire("cafe\u0301:1", 30) is not None  # stored as "caf\u00e9:1"
    assert [i.key for i in guard.held("cafe\u0301")] == ["caf\u00e9:1"]
    assert [i.key for i in guard.held("caf\u00e9:")] == ["caf\u00e9:1"]


def test_adopt_hands_a_lease_over(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 30)
    assert lease is not None
    adopted = guard.adopt("k", lease.owner, 60)
    assert adopted is not None and adopted.token == lease.token
    assert guard.adopt("k", "not-the-owner", 60) is None


def test_exclusive_adopt_passes_the_lease_to_one_new_owner(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 30, task_name="t", task_id="id1", hostname="publisher", pid=1)
    assert lease is not None
    mine = guard.adopt(
        "k", lease.owner, 60, exclusive=True, task_name="t", task_id="id1", hostname="w1", pid=7
    )
    assert mine is not None and mine.owner != lease.owner
    assert (mine.token, mine.acquired_at) == (lease.token, lease.acquired_at)
    assert mine.expires_at - mine.acquired_at >= timedelta(seconds=59)
    # A second adopter of the same handed-over owner id (a redelivered message) fails,
    # and the row names the first adopter.
    assert guard.adopt("k", lease.owner, 60, exclusive=True, hostname="w2") is None
    info = guard.get("k")
    assert info is not None and info.held and info.owner == mine.owner
    assert (info.holder.task_id, info.holder.hostname, info.holder.pid) == ("id1", "w1", 7)
    # The old owner id can no longer renew or release it; the new one can.
    assert guard.renew(lease) is False and guard.release(lease) is False
    assert guard.renew(mine) is True and guard.release(mine) is True
    assert guard.adopt("k", mine.owner, 60, exclusive=True) is None  # released: not live


def test_exclusive_adopt_keeps_the_throttle_window(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 1, min_hold=30)
    assert lease is not None
    mine = guard.adopt("k", lease.owner, 1, min_hold=30, exclusive=True)
    assert mine is not None and mine.min_hold == 30
    assert mine.expires_at - mine.acquired_at >= timedelta(seconds=29)


def test_adopt_refuses_holder_details_unless_exclusive(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 30)
    assert lease is not None
    with pytest.raises(InvalidArgument, match="task_id= only with exclusive=True"):
        guard.adopt("k", lease.owner, 30, task_id="x")
    assert guard.get("k") is not None and guard.get("k").owner == lease.owner  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "key", ["", "a\x00b", 42, None, "\ud800"], ids=["empty", "nul", "int", "none", "surrogate"]
)
def test_bad_keys_raise_clear_errors(guard: TaskGuard, key: object) -> None:
    with pytest.raises(InvalidKey) as err:
        guard.acquire(key, 30)  # type: ignore[arg-type]
    assert "key" in str(err.value)
    assert guard.held(include_expired=True) == []


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), 10**12, "5", True])
def test_bad_ttls_raise_clear_errors(guard: TaskGuard, ttl: object) -> None:
    with pytest.raises(InvalidTTL):
        guard.acquire("k", ttl)  # type: ignore[arg-type]
    assert guard.held(include_expired=True) == []


@pytest.mark.parametrize(
    "key",
    ["ключ:😀", "x" * 10_000, "'; DROP TABLE task_locks; --", "%_\\", " spaces ", "a\nb"],
    ids=["unicode", "10k", "sql", "wildcards", "spaces", "newline"],
)
def test_awkward_keys_round_trip(guard: TaskGuard, key: str) -> None:
    lease = guard.acquire(key, 30)
    assert lease is not None and lease.key == normalize_key(key)
    assert guard.acquire(key, 30) is None
    info = guard.get(key)
    assert info is not None and info.owner == lease.owner
    assert guard.release(lease)


def test_statements_never_join_the_callers_transaction(db_url: str) -> None:
    engine = create_engine(db_url)
    guard = TaskGuard(engine)
    try:
        with Session(engine) as session:
            session.execute(text("SELECT 1"))  # caller has an open transaction
            lease = guard.acquire("k", 30)
            session.rollback()  # must not undo the grant
        assert lease is not None
        with Session(engine) as session:
            row = session.get(TaskLock, ("k", 0))
            assert row is not None and row.owner == lease.owner
            assert row.expires_at.tzinfo is not None
    finally:
        engine.dispose()


def test_missing_schema_is_a_clear_error(empty_pg_url: str) -> None:
    guard = TaskGuard(empty_pg_url)
    with pytest.raises(SchemaMissing, match="taskguard db upgrade"):
        guard.acquire("k", 30)
    guard.dispose()
