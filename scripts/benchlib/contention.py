"""Section 2: 16 processes hammering one key, then 1,000 keys, then 3 keys directly
and through a private PgBouncer (transaction and session pooling).

Each process loops acquire -> (check) -> release on a random key until its time is
up. Overlaps are checked outside the database: a shared counter per key is raised
right after a grant and lowered right before the release, so two processes inside
the same key's critical section at once would see the counter at 2. A failed call
is counted by its message and the loop goes on.

The control row forces psycopg's named prepared statements (taskguard before it
sent unnamed ones to anything not shown to be a direct connection) through the
transaction pooler: its failures are what taskguard avoids, so they are its figure.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import re
import time
from collections import Counter
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from benchlib.common import Env, Row, latency_ms, libpq_url, now_ns, run_children, scratch_db
from taskguard import TaskGuard
from tests.harness.pgbouncer import PgBouncer

PROCESSES = 16
TTL = 60.0  # far longer than any hold, so a grant can only end by release
#: psycopg's own default: named statements after 5 runs on a connection.
NAMED = {"connect_args": {"prepare_threshold": 5}}


def rows() -> list[Row]:
    def r(id_: str, label: str, ref: str = "pair.taskguard") -> Row:
        return Row(
            id=f"contention.{id_}",
            section="2. contention",
            label=f"{PROCESSES} processes, {label}",
            unit="grants/s",
            ref=ref,
            ratio_kind="rate",
        )

    return [
        r("one_key", "1 key"),
        r("keys_1000", "1,000 keys"),
        r("keys_3", "3 keys"),
        r("pgbouncer_tx", "3 keys, via PgBouncer (transaction)", "contention.keys_3"),
        r("pgbouncer_session", "3 keys, via PgBouncer (session)", "contention.keys_3"),
        r("pgbouncer_tx_named", "same, named statements (control)", "contention.keys_3"),
    ]


def _short(exc: Exception) -> str:
    """An error's first line, with the names that differ per call folded."""
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    for pattern, fold in (
        (r"\S+://\S+", "<url>"),
        (r"_pg3_\d+", "_pg3_*"),
        (r"\d+ param", "N param"),
        (r"[0-9a-f]{32}", "*"),
    ):
        text = re.sub(pattern, fold, text)
    return f"{type(exc).__name__}: {text[:160]}"


def _worker(
    queue: Any,
    url: str,
    prefix: str,
    nkeys: int,
    counters: Any,
    barrier: Any,
    duration: float,
    max_attempts: int,
    seed: int,
    options: dict[str, Any],
) -> None:
    result: dict[str, Any] = {"error": None}
    guard = None
    errors: Counter[str] = Counter()
    try:
        guard = TaskGuard(url, **options)
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
            attempts += 1
            try:
                lease = guard.acquire(f"{prefix}{k}", TTL)
            except Exception as exc:
                errors[_short(exc)] += 1
                continue
            lat.append(now_ns() - t0)
            if lease is None:
                continue
            grants += 1
            with counters.get_lock():
                counters[k] += 1
                if counters[k] != 1:
                    overlaps += 1
            with counters.get_lock():
                counters[k] -= 1
            try:
                lost += not guard.release(lease)
            except Exception as exc:
                errors[_short(exc)] += 1
        result.update(
            errors=errors,
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


def _one(env: Env, row: Row, url: str, nkeys: int, options: dict[str, Any] | None = None) -> None:
    duration = env.pick(1.0, 8.0)
    ctx = mp.get_context("fork")
    counters = ctx.Array("i", nkeys)
    barrier = ctx.Barrier(PROCESSES)
    prefix = f"bench:{row.id}:"  # a row's own keys: the control row's may stay held
    args = [
        (url, prefix, nkeys, counters, barrier, duration, 200_000, seed, options or {})
        for seed in range(PROCESSES)
    ]
    results = run_children(_worker, args, timeout=duration + 90)
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} worker(s) failed: {errors[0]}")
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        live = conn.execute(
            "SELECT count(*) FROM task_locks WHERE key LIKE %s "
            "AND expires_at > statement_timestamp()",
            (f"{prefix}%",),
        ).fetchone()[0]  # type: ignore[index]
    grants = sum(r["grants"] for r in results)
    attempts = sum(r["attempts"] for r in results)
    overlaps = sum(r["overlaps"] for r in results)
    lost = sum(r["lost"] for r in results)
    failed: Counter[str] = sum((r["errors"] for r in results), Counter())
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
        "failed_calls": failed.total(),
        "errors": dict(failed.most_common(5)),
    }
    row.note = (
        f"{overlaps} overlaps; {attempts / span:,.0f} attempts/s "
        f"({1 - grants / max(1, attempts):.0%} refused); latency = one acquire attempt"
    )
    if failed:
        row.note += f"; {failed.total():,} calls failed, most as {failed.most_common(1)[0][0]!r}"
    if (overlaps or lost or live or failed) and options is not NAMED:
        row.status = (
            f"error: {overlaps} overlaps, {lost} lost releases, {live} leases left live, "
            f"{failed.total()} failed calls"
        )


def run(env: Env) -> list[Row]:
    one_key, keys_1000, keys_3, tx, session, tx_named = out = rows()
    with scratch_db(env, "contention") as url, contextlib.ExitStack() as stack:
        _one(env, one_key, url, 1)
        _one(env, keys_1000, url, 1000)
        _one(env, keys_3, url, 3)
        port = make_url(url).port or 5432
        pooler = stack.enter_context(PgBouncer(port, pool_mode="transaction"))
        _one(env, tx, pooler.via(url), 3)
        _one(env, tx_named, pooler.via(url), 3, NAMED)
        pooler = stack.enter_context(
            PgBouncer(port, pool_mode="session", default_pool_size=PROCESSES + 2)
        )
        _one(env, session, pooler.via(url), 3)
    return out
