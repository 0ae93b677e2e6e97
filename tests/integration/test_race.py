"""Mutual exclusion under real concurrency: separate OS processes, one key."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest

from taskguard import TaskGuard

PROCS = 16
ROUNDS = 10


def _contender(barrier: Any, out: Any, url: str, key_prefix: str, ttl: float) -> None:
    guard = TaskGuard(url)
    wins = []
    for rnd in range(ROUNDS):
        barrier.wait(timeout=60)
        lease = guard.acquire(f"{key_prefix}{rnd}", ttl)
        if lease is not None:
            wins.append((rnd, lease.token, lease.owner))
    out.put(wins)
    guard.dispose()


def _in_processes(target: Any, *args: Any) -> list[tuple[int, int, str]]:
    """``target(barrier, out, *args)`` in PROCS processes: every win they report."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(PROCS), ctx.Queue()
    procs = [ctx.Process(target=target, args=(barrier, out, *args)) for _ in range(PROCS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return [w for r in results for w in r]


def _race(url: str, key_prefix: str, ttl: float = 30.0) -> list[tuple[int, int, str]]:
    return _in_processes(_contender, url, key_prefix, ttl)


def test_sixteen_processes_exactly_one_winner_per_round(db_url: str) -> None:
    wins = _race(db_url, "race:")
    per_round: dict[int, int] = {}
    for rnd, _token, _owner in wins:
        per_round[rnd] = per_round.get(rnd, 0) + 1
    assert per_round == {rnd: 1 for rnd in range(ROUNDS)}


def test_sixteen_processes_race_for_an_expired_key(db_url: str) -> None:
    guard = TaskGuard(db_url)
    expired = []
    for rnd in range(ROUNDS):
        lease = guard.acquire(f"stale:{rnd}", 0.05)
        assert lease is not None
        expired.append(lease.token)
    time.sleep(0.1)
    wins = _race(db_url, "stale:")
    assert sorted(rnd for rnd, _, _ in wins) == list(range(ROUNDS))
    for rnd, token, owner in wins:
        assert token > expired[rnd]
        info = guard.get(f"stale:{rnd}")
        assert info is not None and info.owner == owner
    guard.dispose()


@pytest.mark.parametrize("_", range(1))
def test_tokens_unique_across_processes(db_url: str, _: int) -> None:
    wins = _race(db_url, "uniq:")
    tokens = [t for _, t, _ in wins]
    assert len(tokens) == len(set(tokens))


def _adopter(barrier: Any, out: Any, url: str, handed: list[tuple[str, str]]) -> None:
    guard = TaskGuard(url)
    wins = []
    for rnd, (key, owner) in enumerate(handed):
        barrier.wait(timeout=60)
        lease = guard.adopt(key, owner, 30, exclusive=True, task_id="same-message")
        if lease is not None:
            wins.append((rnd, lease.token, lease.owner))
    out.put(wins)
    guard.dispose()


def test_sixteen_deliveries_of_one_hand_off_exactly_one_adopts(db_url: str) -> None:
    # Every process is a delivery of the same message, carrying the same owner id.
    guard = TaskGuard(db_url)
    leases = [guard.acquire(f"handed:{rnd}", 30) for rnd in range(ROUNDS)]
    assert all(lease is not None for lease in leases)
    handed = [(lease.key, lease.owner) for lease in leases if lease is not None]
    wins = _in_processes(_adopter, db_url, handed)
    assert sorted(rnd for rnd, _, _ in wins) == list(range(ROUNDS))
    for rnd, token, owner in wins:
        info = guard.get(f"handed:{rnd}")
        assert info is not None and info.held and info.owner == owner
        assert token == leases[rnd].token  # type: ignore[union-attr]
    guard.dispose()
