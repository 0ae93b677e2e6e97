"""Failover to a standby while 8 processes contend (issue 13, item 2).

A :class:`~tests.harness.postgres.ReplicatedPair` (synchronous, or asynchronous: the
negative control). Contenders connect with a multi-host URL
(``host=A&host=B&target_session_attrs=read-write``) and loop: acquire one of 3
contended keys (short TTLs, leases lapse, never released so rows are only updated)
and now and then a "witness" key of their own with a long TTL.

Mid-run the standby's WAL receiver is paused (SIGSTOP) for half a second -
replication lag, so that commits are in flight (sync) or acknowledged but not yet
replicated (async) - then every process of the primary is SIGKILLed and so is the
paused receiver (what the network had not delivered is gone), the standby replays
what it had written, its ``task_locks`` is read (that is exactly the
state the promoted server starts from: nobody can write to a standby), and it is
promoted. The contenders keep going against the new primary.

Checks (each a ``violations.*`` count that must be 0 in the synchronous case):
- ``lost_ack``: a grant acknowledged before the promotion is missing from the
  promoted server (a contended key's row holds a lower token, or a witness row is
  gone or has another owner). WAL is linear, so a row with a higher token on the
  same key means the earlier grant was replicated too.
- ``token_order``: a grant after the promotion with a token not above every token
  acknowledged before it on that key, or a token handed out twice.
- ``overlap``: two acknowledged grants of one key whose database-clock lease
  intervals overlap.
- ``in_flight_misreported``: a call in flight at the kill that returned a grant the
  promoted server does not have (it must end as OutcomeUnknown, DatabaseUnavailable,
  or a grant that survived).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import signal
import time
from collections import Counter, defaultdict
from typing import Any

import psycopg

from scripts.chaoslib.history import Report, us
from taskguard import DatabaseUnavailable, OutcomeUnknown, TaskGuard
from tests.harness.postgres import ReplicatedPair

__all__ = ["failover_round"]

KEYS = ("f0", "f1", "f2")


# -- contenders ----------------------------------------------------------------------


def _contender(url: str, worker: int, out: Any, stop: Any, seed: int) -> None:
    rng = random.Random(seed * 100 + worker)
    guard = TaskGuard(url)
    events: list[tuple[Any, ...]] = []
    witness = 0
    while not stop.is_set():
        if rng.random() < 0.15:
            key, ttl = f"w:{worker}:{witness}", 600.0
            witness += 1
        else:
            key, ttl = rng.choice(KEYS), rng.choice((0.005, 0.01, 0.02))
        start = time.time()
        try:
            lease = guard.acquire(key, ttl)
        except OutcomeUnknown as exc:
            events.append(("U", key, exc.owner, start, time.time()))
            time.sleep(rng.uniform(0.02, 0.08))
            continue
        except DatabaseUnavailable:
            events.append(("E", key, None, start, time.time()))
            time.sleep(rng.uniform(0.02, 0.08))
            continue
        end = time.time()
        if lease is None:
            events.append(("N", key, None, start, end))
            continue
        events.append(
            (
                "G",
                key,
                lease.owner,
                start,
                end,
                lease.token,
                us(lease.acquired_at),
                us(lease.expires_at),
            )
        )
    guard.dispose()
    out.put(events)


def failover_round(
    *, sync: bool = True, workers: int = 8, before: float = 3.0, after: float = 3.0, seed: int = 0
) -> Report:
    """One contended run with one failover; returns counts and violations."""
    res = Report()
    with ReplicatedPair(sync=sync) as rp:
        assert rp.standby is not None
        url = rp.create_database("failover")
        ctx = mp.get_context("fork")
        stop, out = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(target=_contender, args=(url, i, out, stop, seed), daemon=True)
            for i in range(workers)
        ]
        for p in procs:
            p.start()
        try:
            time.sleep(before)
            receiver = rp.standby.walreceiver_pid()
            if receiver is None:
                raise RuntimeError("standby has no WAL receiver")
            # Replication lag: the primary keeps committing (async) or waits (sync).
            os.kill(receiver, signal.SIGSTOP)
            time.sleep(0.5)
            t_kill = time.time()
            rp.primary.kill()
            # The network never delivers what was in flight: what the receiver had not
            # written when it stopped is gone (its socket buffer dies with it).
            os.kill(receiver, signal.SIGKILL)
            # Its postmaster starts reinitialising when it reaps the receiver, and
            # drops every connection then: one made before that breaks mid-query.
            _wait_reaped(receiver)
            rp.standby.wait_caught_up()
            snapshot = _rows(rp.standby.dsn("failover"))
            # Taken before: the promoted server takes grants before `pg_ctl promote -w`
            # returns, and those are not in the snapshot.
            t_promoted = time.time()
            res.counts["promote_ms"] = round(rp.standby.promote() * 1000)
            time.sleep(after)
        finally:
            stop.set()
            events = _collect(procs, out)
        _judge(res, events, snapshot, t_kill, t_promoted, _rows(rp.standby.dsn("failover")))
    return res


def _wait_reaped(pid: int, timeout: float = 10.0) -> None:
    """Until process ``pid`` (killed, not our child) is gone, zombie included."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} was not reaped within {timeout:.0f} s")
        time.sleep(0.01)


def _collect(procs: list[Any], out: Any) -> list[tuple[Any, ...]]:
    events: list[tuple[Any, ...]] = []
    try:
        for _ in procs:
            events += out.get(timeout=120)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():  # stuck (e.g. a commit waiting for a paused standby)
                p.kill()
                p.join()
    return events


def _rows(dsn: str) -> dict[str, tuple[str, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT key, owner, token FROM task_locks WHERE slot = 0").fetchall()
    return {str(k): (str(o), int(t)) for k, o, t in rows}


def _judge(
    res: Report,
    events: list[tuple[Any, ...]],
    snapshot: dict[str, tuple[str, int]],
    t_kill: float,
    t_promoted: float,
    final: dict[str, tuple[str, int]],
) -> None:
    c = res.counts
    grants = [e for e in events if e[0] == "G"]
    for kind, *_ in events:
        c[f"calls.{kind}"] += 1
    before = [g for g in grants if g[4] < t_promoted]
    after = [g for g in grants if g[4] >= t_promoted]
    c["grants_before_promotion"] = len(before)
    c["grants_after_promotion"] = len(after)
    # 1. every grant acknowledged before the promotion is on the promoted server
    lost = 0
    for _, key, owner, _s, _e, token, *_ in before:
        row = snapshot.get(key)
        if key.startswith("w:"):
            ok = row is not None and row == (owner, token)
        else:
            ok = row is not None and (row[1] > token or row == (owner, token))
        if not ok:
            lost += 1
            res.violate("lost_ack", f"{key} token {token} acknowledged, promoted row {row}")
    c["lost_acknowledged_grants"] = lost
    # 2. tokens strictly increase per key across the failover, never reused
    top: dict[str, int] = defaultdict(int)
    for g in before:
        top[g[1]] = max(top[g[1]], g[5])
    for key, (_o, token) in snapshot.items():
        top[key] = max(top[key], token)
    for _, key, _o, _s, _e, token, *_ in after:
        if token <= top[key]:
            res.violate("token_order", f"{key}: token {token} after promotion <= {top[key]}")
    reused = Counter(g[5] for g in grants)
    for token, n in reused.items():
        if n > 1:
            res.violate("token_reused", f"token {token} acknowledged {n} times")
    # 3. no overlapping leases per key (database clock; both servers share this host's)
    per_key: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
    for g in grants:
        per_key[g[1]].append(g)
    for key, gs in per_key.items():
        gs.sort(key=lambda g: g[5])
        for a, b in itertools.pairwise(gs):
            c["pairs_checked"] += 1
            if b[6] < a[7]:
                res.violate("overlap", f"{key}: token {b[5]} from {b[6]} before {a[5]} ends {a[7]}")
    # 4. calls in flight at the kill: unknown, unavailable, or a grant that survived
    for e in events:
        if e[3] <= t_kill <= e[4]:
            c[f"in_flight.{e[0]}"] += 1
            if e[0] == "G" and e[4] >= t_promoted:
                continue  # retried against the new primary: a real, later grant
            if e[0] == "G":
                row = snapshot.get(e[1])
                if row is None or row[1] < e[5]:
                    res.violate("in_flight_misreported", f"{e[1]} reported granted, then lost")
    c["final_rows"] = len(final)
