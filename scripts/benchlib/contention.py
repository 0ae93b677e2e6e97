"""Section 2: 16 processes hammering one key, then 1,000 keys.

Each process loops acquire -> (check) -> release on a random key until its time is
up. Overlaps are checked outside the database: a shared counter per key is raised
right after a grant and lowered right before the release, so two processes inside
the same key's critical section at once would see the counter at 2.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import time
from typing import Any

import psycopg

from benchlib.common import Env, Row, latency_ms, libpq_url, now_ns, run_children, scratch_db
from taskguard import TaskGuard

PROCESSES = 16
TTL = 60.0  # far longer than any hold, so a grant can only end by release


def rows() -> list[Row]:
    def r(id_: str, label: str) -> Row:
        return Row(
            id=f"contention.{id_}",
            section="2. contention",
            label=label,
            unit="grants/s",
            ref="pair.taskguard",
            ratio_kind="rate",
        )

    return [
        r("one_key", f"{PROCESSES} processes, 1 key"),
        r("keys_1000", f"{PROCESSES} processes, 1,000 keys"),
    ]


def _worker(
    queue: Any,
    url: str,
    nkeys: int,
    counters: Any,
    barrier: Any,
    duration: float,
    max_attempts: int,
    seed: int,
) -> None:
    result: dict[str, Any] = {"error": None}
    guard = None
    try:
        guard = TaskGuard(url)
        warm = guard.acquire(f"bench:warm:{seed}", TTL)  # connect before the clock starts
        if warm is not None:
            guard.release(warm)
        rnd = random.Random(seed)
        attempts = grants = overlaps = lost = 0
        lat: list[int] = []
        barrier.wait(60)
        start = time.monotonic()
        deadline = start + duration
        while attempts < max_attempts and time.monotonic() < deadline:
            k = rnd.randrange(nkeys)
            t0 = now_ns()
            lease = guard.acquire(f"bench:c:{k}", TTL)
            lat.append(now_ns() - t0)
            attempts += 1
            if lease is None:
                continue
            grants += 1
            with counters.get_lock():
                counters[k] += 1
                if counters[k] != 1:
                    overlaps += 1
            with counters.get_lock():
                counters[k] -= 1
            if not guard.release(lease):
                lost += 1
        result.update(
            start=start,
            end=time.monotonic(),
            attempts=attempts,
            grants=grants,
            overlaps=overlaps,
            lost=lost,
            lat=lat,
        )
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            barrier.abort()
    finally:
        if guard is not None:
            guard.dispose()
        queue.put(result)


def _one(env: Env, row: Row, url: str, nkeys: int) -> None:
    duration = env.pick(1.0, 8.0)
    ctx = mp.get_context("fork")
    counters = ctx.Array("i", nkeys)
    barrier = ctx.Barrier(PROCESSES)
    args = [(url, nkeys, counters, barrier, duration, 200_000, seed) for seed in range(PROCESSES)]
    results = run_children(_worker, args, timeout=duration + 90)
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} worker(s) failed: {errors[0]}")
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        live = conn.execute(
            "SELECT count(*) FROM task_locks WHERE key LIKE 'bench:c:%%' "
            "AND expires_at > statement_timestamp()"
        ).fetchone()[0]  # type: ignore[index]
    grants = sum(r["grants"] for r in results)
    attempts = sum(r["attempts"] for r in results)
    overlaps = sum(r["overlaps"] for r in results)
    lost = sum(r["lost"] for r in results)
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    row.rate = grants / span
    row.p50_ms, row.p99_ms = latency_ms([x for r in results for x in r["lat"]])
    row.extra = {
        "processes": PROCESSES,
        "keys": nkeys,
        "seconds": round(span, 2),
        "grants": grants,
        "attempts": attempts,
        "attempts_per_s": attempts / span,
        "overlaps": overlaps,
        "releases_returning_false": lost,
        "live_leases_left": live,
    }
    row.note = (
        f"{overlaps} overlaps; {attempts / span:,.0f} attempts/s "
        f"({1 - grants / max(1, attempts):.0%} refused); latency = one acquire attempt"
    )
    if overlaps or lost or live:
        row.status = f"error: {overlaps} overlaps, {lost} lost releases, {live} leases left live"


def run(env: Env) -> list[Row]:
    out = rows()
    with scratch_db(env, "contention") as url:
        _one(env, out[0], url, 1)
        _one(env, out[1], url, 1000)
    return out
