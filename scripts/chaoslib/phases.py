"""The phases of ``scripts/chaos.py``; each returns a dict of figures.

A figure named ``violations`` (or ending in ``.violations``) must be 0. Negative
controls report what they *expect* to see under ``expected_*`` and fail only if
the harness could not see it (``control_blind``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from scripts.chaoslib.contention import Plan, contention
from scripts.chaoslib.durability import durability_round
from scripts.chaoslib.failover import failover_round
from scripts.chaoslib.faults import MODES, OPS, fault_round
from scripts.chaoslib.history import Report
from scripts.chaoslib.holders import killed_holder_round, paused_holder_round
from scripts.chaoslib.lease_clock import cut_off_round, summarize
from scripts.chaoslib.resource import Resource
from taskguard import TaskGuard, schema
from tests.harness.postgres import ThrowawayCluster
from tests.harness.proxy import FaultProxy

ROOT = Path(__file__).resolve().parents[2]
Figures = dict[str, Any]


def _fresh(cluster: ThrowawayCluster, name: str) -> str:
    url = cluster.create_database(name)
    schema.upgrade(url)
    return url


def _figures(rep: Report) -> Figures:
    out: Figures = {k: v for k, v in sorted(rep.counts.items()) if not k.startswith("events.")}
    out["violations"] = rep.total_violations
    if rep.violations:
        out["examples"] = {k: v[:3] for k, v in rep.violations.items()}
    return out


def contended(
    cluster: ThrowawayCluster,
    *,
    grants: int,
    crash_every: float | None,
    reaper_grace: float | None,
    name: str,
    **plan: Any,
) -> Figures:
    """8 contenders with millisecond TTLs on a fresh database of ``cluster``."""
    url = _fresh(cluster, name)
    keys = plan.pop("keys", tuple(f"k{i}" for i in range(8)))
    p = Plan(url=url, keys=keys, grants=grants // 8, seconds=600, **plan)
    return _figures(
        contention(
            p,
            workers=8,
            reaper_grace=reaper_grace,
            cluster=cluster if crash_every else None,
            crash_every=crash_every,
        )
    )


def contended_sqlite(tmp: Path, *, grants: int) -> Figures:
    url = f"sqlite:///{tmp / 'chaos.sqlite'}"
    schema.upgrade(url)
    p = Plan(
        url=url,
        keys=("a", "b", "c", "d"),
        grants=grants // 8,
        seconds=600,
        ttls=(0.005, 0.01, 0.02),
    )
    return _figures(contention(p, workers=8))


def negative_controls(cluster: ThrowawayCluster, *, grants: int) -> Figures:
    """What the checker must catch when a guarantee is deliberately given up."""
    relaxed = contended(
        cluster,
        grants=grants,
        crash_every=2.0,
        reaper_grace=None,
        name="neg_relaxed",
        durable=False,
    )
    no_grace = contended(
        cluster,
        grants=grants,
        crash_every=None,
        reaper_grace=0.0,
        name="neg_grace0",
        keys=("a", "b", "c", "d"),
    )
    return {
        "relaxed_durability_with_crashes": relaxed,
        "reaper_with_zero_grace": no_grace,
        "expected_relaxed_violations": relaxed["violations"],
        "expected_grace0_violations": no_grace["violations"],
    }


def mariadb_holders(server: Any, *, rounds: int) -> Figures:
    """SIGKILLed renewing holders on MariaDB: the key is granted again within ttl + 1 s."""
    url = _fresh(server, "holders")
    worst, late = 0.0, 0
    for i in range(rounds):
        k = killed_holder_round(url, f"kill{i}", ttl=1.0)
        worst = max(worst, k.regranted_after)
        late += k.regranted_after > k.ttl + 1.0
    return {
        "sigkill_rounds": rounds,
        "sigkill_worst_regrant_s": round(worst, 3),
        "violations": late,
    }


def mariadb_durability(server: Any, *, rounds: int) -> Figures:
    """Acknowledged grants survive a SIGKILL of the MariaDB server (durable mode only:
    MariaDB has no relaxed-commit mode in taskguard)."""
    url = _fresh(server, "durability")
    out: Figures = Counter()
    for _ in range(rounds):
        r = durability_round(server, url, durable=True, grants=50)
        out["durable.acknowledged"] += r.acknowledged
        out["durable.survived"] += r.survived
        out["durable.tokens_reissued"] += r.tokens_reissued
        out["faults.crash_restarts"] += 1
    figures = dict(out)
    figures["violations"] = (
        out["durable.acknowledged"] - out["durable.survived"] + out["durable.tokens_reissued"]
    )
    return figures


def durability(cluster: ThrowawayCluster, *, rounds: int) -> Figures:
    url = _fresh(cluster, "durability")
    out: Figures = Counter()
    for _ in range(rounds):
        for durable in (True, False):
            r = durability_round(cluster, url, durable=durable, grants=50)
            mode = "durable" if durable else "relaxed"
            out[f"{mode}.acknowledged"] += r.acknowledged
            out[f"{mode}.survived"] += r.survived
            out[f"{mode}.tokens_reissued"] += r.tokens_reissued
            out["faults.crash_restarts"] += 1
    figures = dict(out)
    figures["violations"] = (
        out["durable.acknowledged"] - out["durable.survived"] + out["durable.tokens_reissued"]
    )
    figures["control_blind"] = int(out["relaxed.survived"] == out["relaxed.acknowledged"])
    return figures


def holders(cluster: ThrowawayCluster, *, rounds: int) -> Figures:
    url = _fresh(cluster, "holders")
    res = Resource(url)
    res.setup([f"p{i}" for i in range(rounds)])
    res.dispose()
    out: Figures = {
        "sigstop_rounds": 0,
        "late_writes_rejected": 0,
        "stale_release_refused": 0,
        "stale_renew_refused": 0,
        "sigkill_rounds": 0,
        "violations": 0,
    }
    worst = 0.0
    for i in range(rounds):
        p = paused_holder_round(url, f"p{i}", ttl=0.5)
        out["sigstop_rounds"] += 1
        out["late_writes_rejected"] += p.late["write_accepted"] is False
        out["stale_release_refused"] += p.late["released"] is False
        out["stale_renew_refused"] += p.late["renewed"] is False
        out["violations"] += sum(bool(p.late[k]) for k in ("write_accepted", "released", "renewed"))
        k = killed_holder_round(url, f"kill{i}", ttl=1.0)
        out["sigkill_rounds"] += 1
        worst = max(worst, k.regranted_after)
        out["violations"] += k.regranted_after > k.ttl + 1.0
    out["sigkill_worst_regrant_s"] = round(worst, 3)
    return out


def faults(cluster: ThrowawayCluster, *, rounds: int) -> Figures:
    url = _fresh(cluster, "faults")
    out: Figures = Counter()
    with FaultProxy(cluster.port) as proxy:
        proxied = TaskGuard(cluster.url("faults", port=proxy.port))
        direct = TaskGuard(url)
        proxied.db_now()
        for _ in range(rounds):
            for op in OPS:
                for mode in MODES:
                    o = fault_round(proxied, direct, proxy, op, mode)
                    out["faults.connection_cuts"] += 1
                    out[f"{op}.{mode}.{'true' if o.correct else 'misreported'}"] += 1
                    out["violations"] += not o.correct
        proxied.dispose()
        direct.dispose()
    return dict(out)


def cut_off(cluster: ThrowawayCluster, *, mode: str, rounds: int) -> Figures:
    """A renewing holder cut off from the database (``partition``: a proxy between
    them stops; ``frozen``: the database is SIGSTOPped), rounds alternating between
    open connections that hang and connections reset so that renewals must connect
    anew. Figure: the longest time two holders both believed they held the key
    (target 0 s: the old holder declares the loss before the new grant), and the
    margin per round; no stale fenced write may commit."""
    name = f"cut_{mode}"
    _fresh(cluster, name)
    keys = [f"{mode}{i}" for i in range(rounds)]
    res = Resource(cluster.url(name))
    res.setup(keys)
    res.dispose()
    out = [
        cut_off_round(cluster, name, key, mode=mode, reset=i % 2 == 1) for i, key in enumerate(keys)
    ]
    return summarize(out)


def failover(*, rounds: int, seconds: float) -> Figures:
    """Failover to a synchronous standby (must lose nothing), then the asynchronous
    negative control (expected to lose acknowledged grants: ``expected_*``)."""
    out: Figures = Counter()
    control: Figures = Counter()
    examples: dict[str, list[str]] = {}
    for i in range(rounds):
        sync = failover_round(sync=True, before=seconds, after=seconds, seed=i)
        out.update(sync.counts)
        out["failovers"] += 1
        examples.update({k: v for k, v in sync.violations.items() if v})
    for i in range(max(1, rounds // 2)):
        asyn = failover_round(sync=False, before=seconds, after=seconds, seed=100 + i)
        control.update({k: v for k, v in asyn.counts.items()})
        control["failovers"] += 1
    figures: Figures = {k: v for k, v in sorted(out.items()) if not k.startswith("violations.")}
    figures["violations"] = sum(v for k, v in out.items() if k.startswith("violations."))
    figures.update(
        {f"violations.{k[11:]}": v for k, v in out.items() if k.startswith("violations.")}
    )
    if examples:
        figures["examples"] = examples
    figures["async_control"] = dict(sorted(control.items()))
    figures["expected_async_lost_acknowledged"] = control["lost_acknowledged_grants"]
    figures["control_blind"] = int(control["lost_acknowledged_grants"] == 0)
    return figures


_STATS = re.compile(r"- (\d+) passing examples, (\d+) failing examples, (\d+) invalid")


def pytest_phase(test_file: str, *, examples: int | None = None) -> Figures:
    """Run one of the integration test files in a subprocess (its fixtures use the
    shared PostgreSQL server) and collect its outcome and hypothesis statistics."""
    env = dict(os.environ)
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::DeprecationWarning",
        f"tests/integration/{test_file}",
    ]
    if examples is not None:
        env["TASKGUARD_CHAOS_EXAMPLES"] = str(examples)
        args.append("--hypothesis-show-statistics")
    proc = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=1800
    )
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    counts = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|xfailed|xpassed|error)", tail)
    }
    stats = [tuple(map(int, m)) for m in _STATS.findall(proc.stdout)]
    out: Figures = {
        "pytest": tail,
        **counts,
        "violations": counts.get("failed", 0) + counts.get("error", 0) + counts.get("xpassed", 0),
    }
    failures = re.findall(r"^(?:FAILED|ERROR) .*$", proc.stdout, flags=re.M)
    failures += re.findall(r"Falsifying example:.*?(?=\n\S|\n\n)", proc.stdout, flags=re.S)
    if failures:
        out["failures"] = [f[:2000] for f in failures[:10]]
    if stats:
        out["hypothesis_examples"] = sum(p + f + i for p, f, i in stats)
        out["hypothesis_failing"] = sum(f for _, f, _ in stats)
    return out


def timed(phase: str, fn: Any, *args: Any, **kwargs: Any) -> Figures:
    print(f"== {phase} ...", flush=True)
    t0 = time.monotonic()
    figures: Figures = fn(*args, **kwargs)
    figures["wall_seconds"] = round(time.monotonic() - t0, 1)
    print(f"   {phase}: {figures}", flush=True)
    return figures
