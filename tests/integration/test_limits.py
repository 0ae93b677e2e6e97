"""Concurrency limits (``acquire(..., limit=N)``) under real concurrency: separate
OS processes, real PostgreSQL and SQLite."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from typing import Any

import pytest

from taskguard import ConfigurationError, SchemaMissing, TaskGuard, schema

PROCS = 16
LIMIT = 3


def _worker(url: str, barrier: Any, out: Any, seconds: float) -> None:
    """Take a slot whenever one is free; report (start, end, slot, token) of each
    hold, timed strictly inside the lease (after acquire returned, before release)."""
    guard = TaskGuard(url)
    holds = []
    rng = random.Random(os.getpid())
    barrier.wait(timeout=60)
    stop = time.time() + seconds
    while time.time() < stop:
        lease = guard.acquire("pool", 30, limit=LIMIT)
        if lease is None:
            time.sleep(rng.uniform(0.001, 0.005))
            continue
        start = time.time()
        time.sleep(rng.uniform(0.005, 0.02))
        end = time.time()
        assert guard.release(lease)
        holds.append((start, end, lease.slot, lease.token))
    out.put(holds)
    guard.dispose()


def _max_overlap(holds: list[tuple[float, float, int, int]]) -> int:
    edges = sorted([(s, 1) for s, _, _, _ in holds] + [(e, -1) for _, e, _, _ in holds])
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def _run(target: Any, args: tuple[Any, ...], procs: int = PROCS) -> list[Any]:
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    workers = [
        ctx.Process(target=target, args=(*args[:1], barrier, out, *args[1:])) for _ in range(procs)
    ]
    for p in workers:
        p.start()
    results = [out.get(timeout=120) for _ in workers]
    for p in workers:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def test_limit_never_exceeded_under_sixteen_processes(db_url: str) -> None:
    holds = [h for r in _run(_worker, (db_url, 1.5)) for h in r]
    assert len(holds) > 20
    # Never more than N at once, and the limit is actually used (not a mutex).
    assert _max_overlap(holds) <= LIMIT
    assert _max_overlap(holds) == LIMIT
    assert {slot for _, _, slot, _ in holds} == set(range(LIMIT))
    tokens = [t for _, _, _, t in holds]
    assert len(tokens) == len(set(tokens))
    # Per slot, grants come one after another with ever larger tokens.
    for slot in range(LIMIT):
        ordered = sorted((s, t) for s, _, sl, t in holds if sl == slot)
        assert [t for _, t in ordered] == sorted(t for _, t in ordered)


def _racer(url: str, barrier: Any, out: Any) -> None:
    guard = TaskGuard(url)
    barrier.wait(timeout=60)
    lease = guard.acquire("race", 30, limit=4)
    out.put(None if lease is None else (lease.slot, lease.token))
    guard.dispose()


def test_sixteen_processes_race_for_four_new_slots(db_url: str) -> None:
    wins = [w for w in _run(_racer, (db_url,)) if w is not None]
    assert sorted(slot for slot, _ in wins) == [0, 1, 2, 3]
    assert len({token for _, token in wins}) == 4


def _crash_holding(url: str) -> None:
    guard = TaskGuard(url)
    assert guard.acquire("pool", 0.4, limit=2) is not None
    os._exit(0)  # no release: the slot must come free by expiry alone


def test_a_crashed_holder_frees_only_its_own_slot(db_url: str) -> None:
    guard = TaskGuard(db_url)
    try:
        survivor = guard.acquire("pool", 30, limit=2)
        assert survivor is not None
        child = mp.get_context("fork").Process(target=_crash_holding, args=(db_url,))
        child.start()
        child.join(timeout=30)
        assert child.exitcode == 0
        assert guard.acquire("pool", 30, limit=2) is None  # both slots taken
        time.sleep(0.5)
        taker = guard.acquire("pool", 30, limit=2)
        assert taker is not None and taker.slot != survivor.slot
        assert taker.token > survivor.token
        assert guard.is_held_by(survivor)  # the live holder was never touched
        assert guard.renew(survivor)
    finally:
        guard.dispose()


def test_every_slot_grant_gets_a_fresh_token(guard: TaskGuard) -> None:
    tokens = []
    for _ in range(3):
        leases = [guard.acquire("k", 30, limit=3) for _ in range(3)]
        assert all(lease is not None for lease in leases)
        assert guard.acquire("k", 30, limit=3) is None
        tokens += [lease.token for lease in leases if lease is not None]
        for lease in leases:
            assert lease is not None and guard.release(lease)
    assert tokens == sorted(tokens) and len(set(tokens)) == 9
    assert [i.slot for i in guard.get_all("k")] == [0, 1, 2]


def test_limit_one_is_the_mutex(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 30, limit=1)
    assert lease is not None and lease.slot == 0
    assert guard.acquire("k", 30) is None


@pytest.mark.parametrize("limit", [0, -1, 1001, 2.0, 1.0, "3", True, None])
def test_bad_limits_are_clear_errors(guard: TaskGuard, limit: object) -> None:
    with pytest.raises(ConfigurationError, match="limit"):
        guard.acquire("k", 30, limit=limit)  # type: ignore[arg-type]


def test_limit_and_slot_together_is_an_error(guard: TaskGuard) -> None:
    with pytest.raises(ConfigurationError, match="slot"):
        guard.acquire("k", 30, limit=2, slot=1)


@pytest.mark.parametrize("revision", ["tg0001", "tg0002"])
def test_a_schema_older_than_the_code_is_a_clear_error(db_url: str, revision: str) -> None:
    schema.downgrade(db_url, revision)
    guard = TaskGuard(db_url)
    try:
        with pytest.raises(SchemaMissing, match=r"older than this version.*taskguard db upgrade"):
            guard.acquire("k", 30)
        with pytest.raises(SchemaMissing, match=r"older than this version"):
            guard.held()
    finally:
        guard.dispose()
