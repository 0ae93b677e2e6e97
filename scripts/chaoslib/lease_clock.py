"""The lease on the local clock (issue 28): a renewing holder cut off from the
database, and a contender that takes the key once the database lets it.

:func:`cut_off_round` - the holder (its own process, a guarded run as the Celery
glue has it: heartbeat, ``check_lease()`` polled every 2 ms, fenced writes to the
resource every 50 ms while it believes it holds the key) loses the database:

* ``partition``: the proxy between it and the database stops forwarding (and, on
  ``reset`` rounds, drops its open connections, so its renewals need a connection
  that is never answered); the database stays up for the contender;
* ``frozen``: the database itself is SIGSTOPped (on ``reset`` rounds right after the
  holder's backends were terminated) and thawed after ``hold`` seconds.

The contender (direct connection) tries to take the key every 10 ms from the
moment of the fault. Figures: when the holder declared the loss (its first
``check_lease()`` that raised, wall clock) against when the database granted the
key to the contender (``acquired_at``, the database clock; same host, same clock):
``margin`` = grant - loss; the time both believed they held the key is
``max(0, -margin)``. After the fault ends, the holder tries one more fenced write
with its old lease (as a holder that never noticed): it must be refused, and no
write of the old lease may have committed after the new grant.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from scripts.chaoslib.resource import Resource
from taskguard import DatabaseUnavailable, Lease, LeaseLost, OutcomeUnknown, TaskGuard
from tests.harness.postgres import ThrowawayCluster
from tests.harness.proxy import FaultProxy


def _holder(url: str, key: str, ttl: float, conn: Any) -> None:
    from taskguard.held_lease import Hold, check_lease, enter_run, exit_run

    guard, res = TaskGuard(url), Resource(url)
    lease = guard.acquire(key, ttl)
    assert lease is not None, "the holder did not get the key"
    run = Hold(guard, key, lease, request=None)
    token = enter_run(run)
    run.start_renewing()
    beat = run
    writes: list[tuple[str, Any]] = []

    def write(with_lease: Lease) -> tuple[str, Any]:
        try:
            accepted, _counter, ts = res.fenced_write(guard, with_lease, key)
        except Exception as exc:  # cut off: not committed as far as we know
            return ("error", type(exc).__name__)
        return ("accepted", ts) if accepted else ("refused", None)

    def writer() -> None:
        while True:
            try:
                run.check()  # check_lease() of this run, from another thread
            except LeaseLost:
                return
            writes.append(write(lease))
            time.sleep(0.05)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    conn.send(("granted", lease.to_dict()))
    lost_at = None
    while lost_at is None:
        try:
            check_lease()
        except LeaseLost:
            lost_at = time.time()
        time.sleep(0.002)
    conn.send(("lost", lost_at))
    conn.recv()  # the fault ended and the contender wrote
    thread.join(30)
    late = write(lease)
    if late[0] == "error":
        # Its pooled connection died while the database was cut off (the backends were
        # terminated first); the pool has dropped it, so the fence now gets its say.
        late = write(lease)
    beat.stop_renewing()
    exit_run(token)
    conn.send(("done", writes, late))
    guard.dispose()
    res.dispose()


@dataclass
class CutOffRound:
    mode: str
    reset: bool
    ttl: float
    margin: float  # seconds from the holder's declared loss to the new grant
    writes: dict[str, int] = field(default_factory=dict)
    stale_committed: int = 0  # old-lease writes committed at or after the new grant
    late_write: str = ""  # the thawed holder's fenced write with its old lease


def _terminate_backends(cluster: ThrowawayCluster, database: str) -> None:
    with psycopg.connect(cluster.dsn(database), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,),
        )


def cut_off_round(
    cluster: ThrowawayCluster,
    database: str,
    key: str,
    *,
    mode: str,
    reset: bool,
    ttl: float = 3.0,
    hold: float = 4.5,
) -> CutOffRound:
    """One round (see the module docstring); ``database`` is migrated and has the
    resource table with a row for ``key``."""
    direct = cluster.url(database)
    ctx = mp.get_context("fork")
    with FaultProxy(cluster.port) as proxy:
        holder_url = cluster.url(database, port=proxy.port) if mode == "partition" else direct
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_holder, args=(holder_url, key, ttl, child), daemon=True)
        proc.start()
        contender, res = TaskGuard(direct, call_timeout=1.0), Resource(direct)
        try:
            kind, _first = parent.recv()
            assert kind == "granted"
            time.sleep(ttl / 3 + 0.3)  # a renewal went through
            if mode == "partition":
                proxy.freeze()
                if reset:
                    proxy.cut_all()
            else:
                if reset:
                    _terminate_backends(cluster, database)
                cluster.freeze()
            faulted = time.monotonic()
            new = _take_over(cluster, proxy, contender, key, faulted + hold)
            if not parent.poll(30):
                raise TimeoutError("the holder never declared its lease lost")
            kind, lost_at = parent.recv()
            assert kind == "lost"
            accepted, _c, _ts = res.fenced_write(contender, new, key)
            assert accepted, "the new holder's fenced write was refused"
            proxy.thaw()
            parent.send("go")
            if not parent.poll(60):
                raise TimeoutError("the holder did not report its writes")
            kind, writes, late = parent.recv()
            contender.release(new)
        finally:
            if cluster.frozen:
                cluster.thaw()
            proxy.thaw()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
            contender.dispose()
            res.dispose()
    granted = new.acquired_at.timestamp()
    counts: dict[str, int] = {}
    stale = 0
    for outcome, ts in writes:
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome == "accepted" and ts / 1e6 >= granted:
            stale += 1
    stale += late[0] == "accepted"
    return CutOffRound(mode, reset, ttl, granted - float(lost_at), counts, stale, late[0])


def _take_over(
    cluster: ThrowawayCluster, proxy: FaultProxy, contender: TaskGuard, key: str, heal_at: float
) -> Lease:
    """The contender's lease on ``key``: tried every 10 ms; the fault ends at ``heal_at``
    (an open fenced transaction of the holder can keep the row locked till then).
    An attempt whose outcome was unknown may have been granted: adopted if so."""
    unknown: set[str] = set()
    while time.monotonic() < heal_at + 60:
        if time.monotonic() >= heal_at:
            if cluster.frozen:
                cluster.thaw()
            proxy.thaw()
        try:
            new = contender.acquire(key, 60)
        except OutcomeUnknown as exc:
            unknown.add(exc.owner)
            new = None
        except DatabaseUnavailable:  # frozen: try again
            new = None
        if new is None and unknown:
            info = contender.get(key)
            if info is not None and info.held and info.owner in unknown:
                new = contender.adopt(key, info.owner, 60)
        if new is not None:
            return new
        time.sleep(0.01)
    raise TimeoutError("the contender never got the key")


def summarize(rounds: list[CutOffRound]) -> dict[str, Any]:
    """The figures of a phase; ``violations`` counts rounds in which both believed
    they held the key, stale writes committed, and late writes accepted."""
    margins = [r.margin for r in rounds]
    writes: dict[str, int] = {}
    for r in rounds:
        for k, v in r.writes.items():
            writes[k] = writes.get(k, 0) + v
    return {
        "rounds": len(rounds),
        "ttl_s": rounds[0].ttl if rounds else None,
        "margins_s": [round(m, 3) for m in margins],
        "margin_min_s": round(min(margins), 3) if margins else None,
        "both_believed_max_s": round(max([0.0, *(-m for m in margins)]), 3),
        "holder_writes": writes,
        "late_writes_refused": sum(r.late_write == "refused" for r in rounds),
        "stale_writes_committed": sum(r.stale_committed for r in rounds),
        "violations": sum(m <= 0 for m in margins) + sum(r.stale_committed for r in rounds),
    }
