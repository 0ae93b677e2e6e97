"""Contended runs shared by ``scripts/chaos.py`` and the integration tests.

:func:`contention` forks N contenders (plus, optionally, a reaper in a tight loop
and crash-restarts of a throwaway cluster), then checks the whole history against
the final database state.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, select

from chaoslib.checker import Report, check
from chaoslib.cluster import ThrowawayCluster
from chaoslib.history import read_history
from chaoslib.resource import Resource
from chaoslib.workers import Plan, contend, reap_loop
from taskguard.models import TaskLock


def db_tokens(url: str, limit: int = 1) -> dict[str, int]:
    """Token of every row in ``task_locks``, by history key (``key/slot`` under a limit)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            locks = TaskLock.__table__
            query = select(locks.c.key, locks.c.slot, locks.c.token)
            rows = conn.execute(query).all()
        return {(str(k) if limit == 1 else f"{k}/{s}"): int(t) for k, s, t in rows}
    finally:
        engine.dispose()


def contention(
    plan: Plan,
    *,
    workers: int = 8,
    reaper_grace: float | None = None,
    cluster: ThrowawayCluster | None = None,
    crash_every: float | None = None,
    outdir: Path | None = None,
) -> Report:
    """Run ``workers`` contenders on ``plan`` and check the history.

    ``reaper_grace``: also run a reaper with that grace in a tight loop.
    ``cluster`` + ``crash_every``: crash-restart the cluster every that many seconds
    while the contenders run (``plan.url`` must point at it).
    """
    own_dir = outdir is None
    outdir = outdir or Path(tempfile.mkdtemp(prefix="tg-chaos-history-"))
    resource = Resource(plan.url)
    resource.setup(plan.resource_keys())
    resource.dispose()
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    procs = [
        ctx.Process(
            target=contend, args=(replace(plan, seed=plan.seed + i), i, outdir, stop), daemon=True
        )
        for i in range(workers)
    ]
    reaper = None
    if reaper_grace is not None:
        reaper = ctx.Process(
            target=reap_loop, args=(plan.url, reaper_grace, outdir, stop), daemon=True
        )
    started = time.monotonic()
    for p in procs:
        p.start()
    if reaper is not None:
        reaper.start()
    crashes, downtime = 0, 0.0
    try:
        last_crash = time.monotonic()
        hard_deadline = started + plan.seconds + 120
        while any(p.is_alive() for p in procs):
            if time.monotonic() > hard_deadline:
                raise TimeoutError("contenders did not finish")
            if (
                cluster is not None
                and crash_every is not None
                and time.monotonic() - last_crash >= crash_every
            ):
                downtime += cluster.crash_restart()
                crashes += 1
                last_crash = time.monotonic()
            time.sleep(0.05)
    finally:
        stop.set()
        for p in [*procs, *([reaper] if reaper else [])]:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    elapsed = time.monotonic() - started
    bad_exit = [p.exitcode for p in procs if p.exitcode != 0]
    resource = Resource(plan.url)
    counters = resource.counters()
    resource.dispose()
    rep = check(read_history(outdir), counters=counters, db_tokens=db_tokens(plan.url, plan.limit))
    rep.counts["workers"] = workers
    rep.counts["seconds"] = round(elapsed)
    rep.counts["faults.crash_restarts"] = crashes
    rep.counts["faults.crash_downtime_ms"] = round(downtime * 1000)
    if bad_exit:
        rep.violate("worker_crashed", f"worker exit codes {bad_exit}")
    reaper_file = outdir / "reaper.json"
    if reaper_file.exists():
        stats: dict[str, Any] = json.loads(reaper_file.read_text())
        rep.counts["faults.reaper_loops"] = stats["loops"]
        rep.counts["faults.reaped_rows"] = stats["removed"]
    if own_dir and not rep.total_violations:
        shutil.rmtree(outdir, ignore_errors=True)
    elif rep.total_violations:
        rep.violations["history"].append(f"kept in {outdir}")
    return rep
