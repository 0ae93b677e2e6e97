"""Single lock holders in their own processes, to pause (SIGSTOP) or kill (SIGKILL).

:func:`paused_holder_round` - a holder is frozen past its TTL mid critical section;
a second holder takes the key and writes the resource; the first is thawed and
carries on as if nothing happened: its fenced write, release and renew must all
be refused.

:func:`killed_holder_round` - a holder that keeps renewing is SIGKILLed; the key
must be granted to someone else within TTL + 1 s of the kill (database clock).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from scripts.chaoslib.history import us
from scripts.chaoslib.resource import Resource
from taskguard import Lease, TaskGuard


def _paused_holder(url: str, key: str, ttl: float, pause_point: float, conn: Any) -> None:
    guard, res = TaskGuard(url), Resource(url)
    lease = guard.acquire(key, ttl)
    conn.send(lease.to_dict() if lease else None)
    if lease is None:
        return
    # The parent freezes us in here, then nudges us on once thawed (a fixed sleep can
    # run out before a loaded parent has frozen us: the write would then come in time).
    conn.poll(pause_point)
    accepted, _counter, ts = res.write(key, lease.token)
    now = us(guard.db_now())
    conn.send(
        {
            "write_accepted": accepted,
            "write_ts": ts,
            "late_by_us": now - us(lease.expires_at),
            "released": guard.release(lease),
            "renewed": guard.renew(lease),
        }
    )
    guard.dispose()
    res.dispose()


@dataclass
class PausedRound:
    first_token: int
    second_token: int
    paused_for: float
    second_write_accepted: bool
    late: dict[str, Any]


def paused_holder_round(url: str, key: str, ttl: float = 0.5) -> PausedRound:
    """One SIGSTOP/SIGCONT round on ``key``; the resource row must exist."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_paused_holder, args=(url, key, ttl, 60.0, child), daemon=True)
    proc.start()
    guard, res = TaskGuard(url), Resource(url)
    try:
        first = parent.recv()
        assert first is not None, "first holder did not get the key"
        lease1 = Lease.from_dict(first)
        stopped = time.monotonic()
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGSTOP)
        lease2 = None
        while lease2 is None:  # free only once the frozen holder's lease has expired
            time.sleep(0.05)
            lease2 = guard.acquire(key, 30)
        accepted, _c, _ts = res.write(key, lease2.token)
        os.kill(proc.pid, signal.SIGCONT)
        parent.send("go on")
        paused = time.monotonic() - stopped
        if not parent.poll(60):
            raise TimeoutError("thawed holder did not report")
        late = parent.recv()
        guard.release(lease2)
        return PausedRound(lease1.token, lease2.token, paused, accepted, late)
    finally:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        guard.dispose()
        res.dispose()


def _renewing_holder(url: str, key: str, ttl: float, conn: Any) -> None:
    guard = TaskGuard(url)
    lease = guard.acquire(key, ttl)
    conn.send(lease.to_dict() if lease else None)
    while lease is not None and guard.renew(lease):
        time.sleep(ttl / 5)


@dataclass
class KilledRound:
    ttl: float
    regranted_after: float  # database seconds from the kill to the next grant
    first_token: int
    second_token: int


def killed_holder_round(url: str, key: str, ttl: float = 1.0) -> KilledRound:
    """SIGKILL a renewing holder and time (by the database clock) the next grant."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_renewing_holder, args=(url, key, ttl, child), daemon=True)
    proc.start()
    guard = TaskGuard(url)
    try:
        first = parent.recv()
        assert first is not None, "holder did not get the key"
        time.sleep(ttl / 2)  # let it renew a few times
        assert guard.acquire(key, ttl) is None, "key free while its holder renews"
        killed_at = guard.db_now()
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        lease = None
        deadline = time.monotonic() + ttl + 30
        while lease is None and time.monotonic() < deadline:
            time.sleep(0.01)
            lease = guard.acquire(key, 30)
        assert lease is not None, "key never granted again after its holder was killed"
        guard.release(lease)
        return KilledRound(
            ttl,
            (lease.acquired_at - killed_at).total_seconds(),
            int(first["token"]),
            lease.token,
        )
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        guard.dispose()
