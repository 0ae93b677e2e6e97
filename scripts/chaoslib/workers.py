"""Worker processes: contenders that log every grant, and a reaper in a tight loop.

Each runs in its own OS process (forked), with its own TaskGuard and connections.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import exc as sa_exc

from chaoslib.history import Recorder, us
from chaoslib.resource import Resource
from taskguard import DatabaseUnavailable, Lease, OutcomeUnknown, TaskGuard


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
