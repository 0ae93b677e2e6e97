#!/usr/bin/env python3
"""Prove taskguard's lock the Jepsen/ShedLock way, on one machine (issue #7).

    python scripts/chaos.py            # the full run (~10 min): >= 100k contended grants
    python scripts/chaos.py --quick    # the same phases, small (~2 min)

Creates a throwaway PostgreSQL cluster (initdb in a temp dir, its own port; the
server on 5432 is only used by the pytest phases, never stopped or signalled),
drives 8 worker processes that log every grant/renewal/release/fenced write with
database timestamps, injects faults (reaper in a tight loop, crash-restarts,
SIGSTOP/SIGCONT, SIGKILL, connection cuts around COMMIT, bad input, failover to a
synchronous standby with an asynchronous negative control, a renewing holder cut off
by a network partition or a frozen database) and checks the histories. Prints the figures (docs/evidence/reliability-runs.md quotes them) and writes
them as JSON with ``--out``. Exit status 1 if any invariant was violated.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The repository root: scripts.chaoslib and the servers of tests.harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.chaoslib import phases
from tests.harness.mariadb import ThrowawayMariaDB
from tests.harness.postgres import ThrowawayCluster

FULL = {
    "grants": 100_000,
    "crash_grants": 20_000,
    "sqlite_grants": 8_000,
    "limit_grants": 4_000,
    "fenced_grants": 4_000,
    "control_grants": 8_000,
    "rounds": 10,
    "fault_rounds": 100,
    "examples": 2_500,
    "maria_grants": 20_000,
    "maria_crash_grants": 8_000,
    "failovers": 6,
    "failover_seconds": 4.0,
    "cut_off_rounds": 10,
}
QUICK = {
    "grants": 4_000,
    "crash_grants": 2_000,
    "sqlite_grants": 800,
    "limit_grants": 480,
    "fenced_grants": 480,
    "control_grants": 2_000,
    "rounds": 2,
    "fault_rounds": 5,
    "examples": 100,
    "maria_grants": 2_000,
    "maria_crash_grants": 1_000,
    "failovers": 1,
    "failover_seconds": 2.0,
    "cut_off_rounds": 2,
}


Phase = tuple[str, Any, dict[str, Any]]


def contended(server: Any, size: dict[str, int], prefix: str = "") -> list[Phase]:
    """The contention phases (``phases.contended``) every server runs; ``prefix``
    names the server's figures and sizes (``maria_``)."""
    base = dict(cluster=server, crash_every=None, reaper_grace=None)
    two_keys = dict(base, keys=("a", "b"))
    reaped = dict(base, reaper_grace=0.05)
    return [
        (
            f"{prefix}1_contention_reaper",
            phases.contended,
            dict(reaped, grants=size[f"{prefix}grants"], name="contention"),
        ),
        (
            f"{prefix}2_crash_restarts",
            phases.contended,
            # Enough keys that some sit idle past the grace: the reaper deletes.
            dict(
                reaped,
                grants=size[f"{prefix}crash_grants"],
                name="crashes",
                crash_every=3.0,
                keys=tuple(f"k{i}" for i in range(32)),
            ),
        ),
        (
            f"{prefix}1_limit3",
            phases.contended,
            dict(two_keys, grants=size["limit_grants"], name="limit3", limit=3),
        ),
        (
            f"{prefix}3_fenced_rmw",
            phases.contended,
            dict(two_keys, grants=size["fenced_grants"], name="fenced", fenced=True),
        ),
    ]


def run(plan: list[Phase], skip: list[str], results: dict[str, Any]) -> None:
    for name, fn, kwargs in plan:
        if name not in skip:
            results[name] = phases.timed(name, fn, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small version of every phase")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("--skip", action="append", default=[], help="phase name to skip")
    opts = parser.parse_args()
    size = QUICK if opts.quick else FULL
    # Recoveries log warnings by design; the figures are the output here.
    logging.basicConfig(level=logging.ERROR)
    started = time.monotonic()
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if opts.quick else "full",
        "sizes": size,
    }
    with ThrowawayCluster() as cluster, tempfile.TemporaryDirectory(prefix="tg-chaos-") as tmp:
        waiting = dict(cluster=cluster, crash_every=None, reaper_grace=None, keys=("a", "b"))
        cut_off = dict(cluster=cluster, rounds=size["cut_off_rounds"])
        plan = [
            *contended(cluster, size),
            (
                "1_sqlite",
                phases.contended_sqlite,
                dict(tmp=Path(tmp), grants=size["sqlite_grants"]),
            ),
            (
                "1_wait",
                phases.contended,
                dict(waiting, grants=size["limit_grants"], name="waiting", wait=0.05),
            ),
            ("3_4_5_holders", phases.holders, dict(cluster=cluster, rounds=size["rounds"])),
            ("6_durability", phases.durability, dict(cluster=cluster, rounds=size["rounds"])),
            (
                "7_connection_faults",
                phases.faults,
                dict(cluster=cluster, rounds=size["fault_rounds"]),
            ),
            (
                "negative_controls",
                phases.negative_controls,
                dict(cluster=cluster, grants=size["control_grants"]),
            ),
            ("11_partition", phases.cut_off, dict(cut_off, mode="partition")),
            ("12_frozen_database", phases.cut_off, dict(cut_off, mode="frozen")),
            (
                "10_failover",
                phases.failover,
                dict(rounds=size["failovers"], seconds=size["failover_seconds"]),
            ),
            ("7_faults_tests", phases.pytest_phase, dict(test_file="test_faults.py")),
            (
                "8_bad_input",
                phases.pytest_phase,
                dict(test_file="test_bad_input.py", examples=size["examples"]),
            ),
            ("9_privileges", phases.pytest_phase, dict(test_file="test_privileges.py")),
        ]
        run(plan, opts.skip, results)
    if "mariadb" not in opts.skip:
        # A private MariaDB server (mariadb-install-db into a temp dir, its own port).
        with ThrowawayMariaDB() as maria:
            maria_plan = [
                *contended(maria, size, "maria_"),
                (
                    "maria_5_sigkill",
                    phases.mariadb_holders,
                    dict(server=maria, rounds=size["rounds"]),
                ),
                (
                    "maria_6_durability",
                    phases.mariadb_durability,
                    dict(server=maria, rounds=size["rounds"]),
                ),
            ]
            run(maria_plan, opts.skip, results)
    results["wall_seconds"] = round(time.monotonic() - started, 1)
    failed = [
        n
        for n, r in results.items()
        if isinstance(r, dict) and (r.get("violations") or r.get("control_blind"))
    ]
    results["failed_phases"] = failed
    if opts.out:
        opts.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(json.dumps({"wall_seconds": results["wall_seconds"], "failed_phases": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
