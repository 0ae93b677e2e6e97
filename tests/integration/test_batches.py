"""Many leases per statement: ``acquire_many`` and ``release_many`` (one statement
on PostgreSQL, one call per lease elsewhere, with the same results on every
store). A Celery worker's main process grants its prefetched messages this way
(taskguard.celery.prefetched, issue 18)."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import psycopg
import pytest

from taskguard import Holder, InvalidArgument, LeaseRequest, Marker, TaskGuard


def test_grants_what_is_free_and_refuses_what_is_held(guard: TaskGuard) -> None:
    held = guard.acquire("b", 30)
    assert held is not None
    got = guard.acquire_many(
        [
            LeaseRequest("a", 30, Holder("job", "t-a")),
            LeaseRequest("b", 30, Holder("job", "t-b")),
            LeaseRequest("c", 5, Holder("job", "t-c", "elsewhere", 42)),
        ]
    )
    a, b, c = got
    assert b is None
    assert a is not None and c is not None
    assert a.key == "a" and c.key == "c" and a.owner != c.owner
    assert a.token > held.token and c.token > held.token and a.token != c.token
    assert 4 < (c.expires_at - c.acquired_at).total_seconds() < 6 and c.ttl == 5
    info = guard.get("c")
    assert info is not None and info.held and info.owner == c.owner and info.token == c.token
    assert (info.holder.task_name, info.holder.task_id) == ("job", "t-c")
    assert (info.holder.hostname, info.holder.pid) == ("elsewhere", 42)
    defaults = guard.get("a")
    assert defaults is not None and defaults.holder.hostname == guard.hostname
    assert guard.get("b").owner == held.owner  # type: ignore[union-attr]  # untouched
    assert guard.release(a) and guard.release(c)  # ordinary leases


def test_takes_over_expired_rows(guard: TaskGuard) -> None:
    old = guard.acquire("x", 0.05)
    assert old is not None
    time.sleep(0.15)
    (new,) = guard.acquire_many([LeaseRequest("x", 30)])
    assert new is not None and new.token > old.token
    assert guard.release(old) is False  # the stale owner cannot touch it
    assert guard.get("x").held  # type: ignore[union-attr]


def test_unless_refuses_while_the_marker_is_held(guard: TaskGuard) -> None:
    lease = guard.acquire("job", 30)
    assert lease is not None
    guard.release(lease, marker=Marker("done:1", 30))
    first, second = guard.acquire_many(
        [LeaseRequest("job", 30, unless="done:1"), LeaseRequest("other", 30, unless="done:2")]
    )
    assert first is None and second is not None
    assert not guard.get("job").held  # type: ignore[union-attr]


@pytest.mark.parametrize("n", [3, 9, 70])
def test_any_batch_size(guard: TaskGuard, n: int) -> None:
    keys = [f"k{i}:{uuid.uuid4().hex[:6]}" for i in range(n)]
    leases = guard.acquire_many([LeaseRequest(k, 30) for k in keys])
    assert [lease.key if lease else None for lease in leases] == keys
    assert len({lease.token for lease in leases if lease}) == n
    ended = guard.release_many(
        [(lease, Marker(f"done:{lease.key}", 30)) for lease in leases if lease is not None]
    )
    assert ended == [True] * n
    assert not any(info.key in keys for info in guard.held())
    assert all(guard.get(f"done:{k}").held for k in keys)  # type: ignore[union-attr]


def test_a_key_twice_is_refused_before_anything_is_written(guard: TaskGuard) -> None:
    with pytest.raises(InvalidArgument, match="appears twice"):
        guard.acquire_many(
            [LeaseRequest("dup", 30), LeaseRequest("x", 30), LeaseRequest("dup", 30)]
        )
    assert guard.get("dup") is None and guard.get("x") is None


def test_release_many_by_owner_only(guard: TaskGuard) -> None:
    a, b = guard.acquire_many([LeaseRequest("a", 30), LeaseRequest("b", 30)])
    assert a is not None and b is not None
    assert guard.force_release("b")
    thief = guard.acquire("b", 30)
    assert thief is not None
    assert guard.release_many([(a, None), (b, Marker("done:b", 30))]) == [True, False]
    assert guard.get("b").owner == thief.owner and guard.get("b").held  # type: ignore[union-attr]
    assert guard.get("done:b").held  # type: ignore[union-attr]  # taken either way


def test_release_many_keeps_a_throttle_window(guard: TaskGuard) -> None:
    hold = guard.acquire("w", 30, min_hold=5)
    free = guard.acquire("f", 30)
    assert hold is not None and free is not None
    assert guard.release_many([(hold, None), (free, None)]) == [True, True]
    assert guard.get("w").held and not guard.get("f").held  # type: ignore[union-attr]


def test_history_records_batch_grants_and_releases(db_url: str) -> None:
    guard = TaskGuard(db_url, history=True)
    try:
        (lease,) = guard.acquire_many([LeaseRequest("h", 30, Holder("job", "t1"))])
        assert lease is not None
        assert guard.release_many([(lease, None)]) == [True]
        events = [e.event for e in guard.events("h")]
        assert sorted(events) == ["acquired", "released"]
    finally:
        guard.dispose()


def test_postgresql_sends_one_round_trip_per_batch(
    pg_guard: TaskGuard, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert pg_guard.batches_in_one_statement
    db = pg_guard._store._db
    sent: list[tuple[str, int]] = []
    run, run_many = db.run, db.run_many

    def counting(stmt: Any, values: Any) -> Any:
        sent.append((stmt.sql.split()[0], 1))
        return run(stmt, values)

    def counting_many(stmt: Any, values: Any) -> Any:
        sent.append((stmt.sql.split()[0], len(values)))
        return run_many(stmt, values)

    monkeypatch.setattr(db, "run", counting)
    monkeypatch.setattr(db, "run_many", counting_many)
    leases = pg_guard.acquire_many([LeaseRequest(f"one:{i}", 30) for i in range(20)])
    assert all(leases) and sent == [("INSERT", 1)]  # one statement, 20 VALUES rows
    ended = pg_guard.release_many(
        [
            (lease, Marker(f"d:{i}", 30) if i % 2 else None)
            for i, lease in enumerate(leases)
            if lease
        ]
    )
    assert ended == [True] * 20
    # One pipeline (one round trip, one transaction) per statement: with and without marker.
    assert sorted(sent[1:]) == [("UPDATE", 10), ("WITH", 10)]


def test_the_batch_plan_is_index_lookups_even_when_made_on_a_small_table(
    pg_guard: TaskGuard, pg_url: str
) -> None:
    # PostgreSQL keeps the generic plan of a prepared statement, made early while the
    # table is small. As a join it hashes a full scan of task_locks, and keeps doing
    # so on every batch as the table grows.
    pg_guard.acquire_many([LeaseRequest(f"small:{i}", 30) for i in range(5)])
    sql = pg_guard._store._sql.acquire_many(4).sql  # type: ignore[misc]
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        names.append(match.group(1))
        return f"${len(names)}"

    numbered = re.sub(r"%\((\w+)\)s", number, sql)
    sample = {"key": "'k'", "owner": "'o'", "ttl": "60", "pid": "1", "unless": "'u'"}
    args = ", ".join(sample.get(name.rsplit("_", 1)[0], "NULL") for name in names)
    with psycopg.connect(_libpq(pg_url), autocommit=True) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE batch AS {numbered}")
        conn.execute("BEGIN")
        plan = "\n".join(r[0] for r in conn.execute(f"EXPLAIN EXECUTE batch({args})"))
        conn.execute("ROLLBACK")
    assert "Seq Scan" not in plan and "Hash" not in plan, plan
    assert plan.count("Index Scan using pk_task_locks") == 2, plan


def _libpq(url: str) -> str:
    return re.sub(r"^postgresql\+psycopg", "postgresql", url)
