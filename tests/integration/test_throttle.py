"""Throttle windows (``acquire(..., min_hold=S)``): at most one run per window,
across processes, releases and crashes."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from taskguard import Lease, TaskGuard

WINDOW = 0.5


def _importer(url: str, barrier: Any, out: Any, seconds: float) -> None:
    """Run the 'import' whenever the throttle lets us; report each run's grant."""
    guard = TaskGuard(url)
    runs = []
    barrier.wait(timeout=60)
    stop = time.time() + seconds
    while time.time() < stop:
        lease = guard.acquire("feed:import", 30, min_hold=WINDOW)
        if lease is None:
            time.sleep(0.01)
            continue
        time.sleep(0.02)  # the import itself: much shorter than the window
        assert guard.release(lease)
        runs.append((lease.acquired_at, lease.token))
    out.put(runs)
    guard.dispose()


def test_one_run_per_window_across_processes(db_url: str) -> None:
    procs = 8
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(target=_importer, args=(db_url, barrier, out, 2.2)) for _ in range(procs)
    ]
    for p in workers:
        p.start()
    runs = sorted(r for _ in workers for r in out.get(timeout=120))
    for p in workers:
        p.join(timeout=30)
        assert p.exitcode == 0
    starts = [at for at, _ in runs]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(starts)]
    # By the database clock, never two runs within one window...
    assert min(gaps) >= WINDOW
    # ...and the key frees as soon as the window ends (the runs themselves are short).
    assert max(gaps) < WINDOW + 0.4
    assert 3 <= len(runs) <= 5
    assert [t for _, t in runs] == sorted(t for _, t in runs)


def test_release_keeps_the_key_until_the_window_ends(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 30, min_hold=0.4)
    assert lease is not None and lease.min_hold == 0.4
    assert guard.release(lease) is True
    assert guard.acquire("k", 30, min_hold=0.4) is None
    info = guard.get("k")
    assert info is not None and info.held
    assert info.expires_at - lease.acquired_at == timedelta(seconds=0.4)
    time.sleep(0.45)
    assert guard.acquire("k", 30, min_hold=0.4) is not None


def test_a_long_run_releases_at_once(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 30, min_hold=0.1)
    assert lease is not None
    time.sleep(0.15)  # the run outlasted its window
    assert guard.release(lease)
    assert guard.acquire("k", 30) is not None


def _crash(url: str) -> None:
    TaskGuard(url).acquire("crashy", 0.1, min_hold=2.0)
    os._exit(0)


def test_a_crashed_run_still_holds_its_window(db_url: str) -> None:
    child = mp.get_context("fork").Process(target=_crash, args=(db_url,))
    child.start()
    child.join(timeout=30)
    guard = TaskGuard(db_url)
    try:
        # Past the 0.1 s ttl, inside the 2 s window (wide: on a loaded machine the
        # fork, the child's connect and this guard's took over 0.6 s).
        time.sleep(0.2)
        assert guard.acquire("crashy", 30) is None
        info = guard.get("crashy")
        assert info is not None and info.expires_at - info.acquired_at == timedelta(seconds=2)
        left = (info.expires_at - guard.db_now()).total_seconds()
        time.sleep(max(left, 0.0) + 0.05)
        assert guard.acquire("crashy", 30) is not None
    finally:
        guard.dispose()


def test_renewals_never_shorten_the_window(guard: TaskGuard) -> None:
    lease = guard.acquire("k", 0.1, min_hold=0.5)
    assert lease is not None
    assert guard.renew(lease)  # ttl 0.1 from now would end before the window
    assert lease.expires_at - lease.acquired_at >= timedelta(seconds=0.5)
    time.sleep(0.2)
    assert guard.acquire("k", 30) is None
    adopted = guard.adopt("k", lease.owner, 0.1, min_hold=lease.min_hold)
    assert adopted is not None and adopted.min_hold == 0.5
    assert adopted.expires_at - adopted.acquired_at >= timedelta(seconds=0.5)


def test_min_hold_travels_with_the_lease() -> None:
    now = datetime.now(timezone.utc)
    lease = Lease("k", "o", 1, now, now, ttl=5.0, slot=0, min_hold=60.0)
    assert Lease.from_dict(lease.to_dict()) == lease
    plain = Lease("k", "o", 1, now, now, ttl=5.0)
    assert "min_hold" not in plain.to_dict()
    assert Lease.from_dict(plain.to_dict()).min_hold == 0.0
