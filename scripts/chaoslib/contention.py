"""A checked contention run, shared by ``scripts/chaos.py`` and the integration tests.

:func:`contention` forks N contenders, each in its own OS process with its own
TaskGuard and connections, logging every grant (plus, optionally, a reaper in a
tight loop and crash-restarts of a throwaway cluster), then checks the whole history
against the final database state.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, select
from sqlalchemy import exc as sa_exc

from scripts.chaoslib.history import Recorder, Report, check, read_history, us
from scripts.chaoslib.resource import Resource
from taskguard import DatabaseUnavailable, Lease, OutcomeUnknown, TaskGuard
from taskguard.models import TaskLock
from tests.harness.postgres import ThrowawayCluster


@dataclass(frozen=True)
class Plan:
    """What one contender does. TTLs are milliseconds so leases expire mid-work."""

    url: str
    keys: tuple[str, ...]
    grants: int
    seconds: float
    ttls: tuple[float, ...] = (0.002, 0.005, 0.01, 0.02)
    p_renew: float = 0.3
    p_release: float = 0.6
    p_sleep_past_ttl: float = 0.02
    durable: bool = True
    #: > 1: a concurrency limit; each slot is checked as its own mutex.
    limit: int = 1
    #: Write the resource as a read-modify-write inside a fence()d transaction
    #: instead of a token-guarded increment.
    fenced: bool = False
    #: acquire(..., wait=) seconds: queue for the key instead of spinning.
    wait: float | None = None
    seed: int = 0
    #: Extra keyword arguments for each contender's TaskGuard (engine options).
    engine_kwargs: dict[str, Any] | None = None

    def resource_keys(self) -> list[str]:
        if self.limit == 1:
            return list(self.keys)
        return [f"{k}/{s}" for k in self.keys for s in range(self.limit)]


class _Contender:
    def __init__(self, plan: Plan, worker: int, outdir: Path) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed * 1000 + worker)
        self.guard = TaskGuard(plan.url, durable=plan.durable, **(plan.engine_kwargs or {}))
        self.resource = Resource(plan.url)
        self.rec = Recorder(outdir / f"worker-{worker}.jsonl", worker)
        self.grants = 0

    def run(self, stop: Any) -> None:
        deadline = time.monotonic() + self.plan.seconds
        while self.grants < self.plan.grants and time.monotonic() < deadline and not stop.is_set():
            key = self.rng.choice(self.plan.keys)
            try:
                lease = self.guard.acquire(
                    key, self.rng.choice(self.plan.ttls), limit=self.plan.limit, wait=self.plan.wait
                )
            except OutcomeUnknown:
                self.rec.add("U", key, "acquire")
                self._backoff()
                continue
            except DatabaseUnavailable:
                self.rec.add("E", "acquire")
                self._backoff()
                continue
            if lease is None:
                continue
            self.grants += 1
            self.rec.add(
                "G",
                self._rkey(lease),
                lease.owner,
                lease.token,
                us(lease.acquired_at),
                us(lease.expires_at),
            )
            try:
                self._hold(lease)
            except OutcomeUnknown:
                self.rec.add("U", key, "renew/release")
                self._backoff()
            except DatabaseUnavailable:
                self.rec.add("E", "hold")
                self._backoff()
        self.rec.close()
        self.guard.dispose()
        self.resource.dispose()

    def _rkey(self, lease: Lease) -> str:
        """The history/resource key: per slot under a concurrency limit."""
        return lease.key if self.plan.limit == 1 else f"{lease.key}/{lease.slot}"

    def _backoff(self) -> None:
        time.sleep(self.rng.uniform(0.01, 0.05))

    def _hold(self, lease: Lease) -> None:
        """The critical section: maybe renew, write the resource, then release or lapse."""
        live_at = us(lease.acquired_at)
        if self.rng.random() < self.plan.p_renew:
            ok = self.guard.renew(lease)
            self.rec.add("N", lease.owner, ok, us(lease.expires_at) if ok else None)
            if ok:
                live_at = us(lease.expires_at) - round(lease.ttl * 1e6)
        rkey = self._rkey(lease)
        try:
            if self.plan.fenced:
                accepted, counter, ts = self.resource.fenced_write(self.guard, lease, rkey)
            else:
                accepted, counter, ts = self.resource.write(rkey, lease.token)
        except sa_exc.DBAPIError:
            self.rec.add("W", rkey, lease.token, None, None, None)
            raise DatabaseUnavailable("resource write failed") from None
        self.rec.add("W", rkey, lease.token, accepted, counter, ts)
        if ts is not None:
            # Not proof the lease was live, but it precedes the release statement,
            # and a lower bound on the release time is all the checker needs.
            live_at = max(live_at, ts)
        if self.rng.random() < self.plan.p_sleep_past_ttl:
            time.sleep(lease.ttl + 0.005)
        now = us(self.guard.db_now()) if ts is None else ts
        if now >= us(lease.expires_at):
            # Expired by the database clock: a stale owner must not touch anything.
            self.rec.add("S", lease.owner, "release", self.guard.release(lease))
            self.rec.add("S", lease.owner, "renew", self.guard.renew(lease))
            return
        if self.rng.random() >= self.plan.p_release:
            return  # let it lapse
        try:
            ok = self.guard.release(lease)
        except OutcomeUnknown:
            self.rec.add("R", lease.owner, None, live_at, None)
            raise
        exact = None
        try:
            if ok:
                for info in self.guard.get_all(lease.key):
                    if info.owner == lease.owner and info.slot == lease.slot:
                        exact = us(info.expires_at)
        finally:
            # Recorded even when the read-back fails (a crash right after the release):
            # a release missing from the history would make the checker believe the
            # lease lived on to its expiry and report a takeover as an overlap.
            self.rec.add("R", lease.owner, ok, live_at, exact)


def contend(plan: Plan, worker: int, outdir: Path, stop: Any) -> None:
    """Process entry point: contend until ``plan.grants`` grants or ``plan.seconds``."""
    _Contender(plan, worker, outdir).run(stop)


def reap_loop(url: str, grace: float, outdir: Path, stop: Any) -> None:
    """Process entry point: reap with ``grace`` as fast as it can until ``stop``."""
    guard = TaskGuard(url)
    loops = removed = errors = 0
    while not stop.is_set():
        try:
            removed += guard.reap(grace=grace, batch_size=200)
            loops += 1
        except DatabaseUnavailable:
            errors += 1
            time.sleep(0.05)
        time.sleep(0.001)
    guard.dispose()
    (outdir / "reaper.json").write_text(
        json.dumps({"loops": loops, "removed": removed, "errors": errors})
    )


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
