#!/usr/bin/env python3
"""taskguard benchmarks: every row in one run, ratios from that run.

    python scripts/bench.py [--quick] [--json FILE] [--sections pairs,contention,...,lines,compat]

Needs the local PostgreSQL, Redis and RabbitMQ (URLs below, or the options); the
storm section also starts a private memcached (installing the Debian package when
it is missing) and keeps its Redis keys in database 12. Each
section uses its own scratch database (dropped at the end) and a unique Redis key
prefix (deleted at the end). ``--quick`` shrinks every section (smaller tables,
fewer tasks, shorter runs) so the whole run takes well under a minute; its figures
are for smoke-testing, not publishing. See docs/evidence/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

# benchlib is beside this file; the repository root holds the servers of tests.harness.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import common, report

SECTIONS = ("pairs", "contention", "scale", "e2e", "storm", "refusals", "split", "lines", "compat")
DEFAULT_PG = os.environ.get(
    "TASKGUARD_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
DEFAULT_REDIS = os.environ.get("TASKGUARD_BENCH_REDIS_URL", "redis://127.0.0.1:6379/11")
DEFAULT_AMQP = os.environ.get("TASKGUARD_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sizes; finishes in < 60 s")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON to FILE")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    p.add_argument("--pg-url", default=DEFAULT_PG, help="SQLAlchemy URL of the PostgreSQL server")
    p.add_argument("--redis-url", default=DEFAULT_REDIS)
    p.add_argument("--amqp-url", default=DEFAULT_AMQP)
    p.add_argument(
        "--rows", action="store_true", help="print the id of every row the sections report, exit"
    )
    p.add_argument(
        "--profile",
        type=int,
        metavar="N",
        help="instead of benchmarking, cProfile N taskguard pairs (durable and relaxed) and exit",
    )
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        p.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in chosen]
    return args


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in (
        "taskguard-sql",
        "psycopg",
        "SQLAlchemy",
        "redis",
        "celery",
        "celery_once",
        "celery-singleton",
        "Django",
        "pymemcache",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _git_state() -> dict[str, Any]:
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=10
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"head": "unknown"}
    return {"head": head or "unknown", "uncommitted_paths": len(dirty)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _on_sigterm(signum: int, _frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so every `finally` drops its scratch database.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    env = common.Env(
        pg_url=args.pg_url, redis_url=args.redis_url, amqp_url=args.amqp_url, quick=args.quick
    )
    if args.rows:
        for name in args.sections:
            print("\n".join(row.id for row in importlib.import_module(f"benchlib.{name}").rows()))
        return 0
    if args.profile:
        from benchlib import pairs

        for durable in (True, False):
            print(f"== cProfile, {args.profile} taskguard pairs, durable={durable}")
            print(pairs.profile_taskguard(env, args.profile, durable=durable))
        return 0

    started = time.monotonic()
    meta: dict[str, Any] = {
        "command": " ".join(
            ["python", "scripts/bench.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": {"cores": os.cpu_count(), "cpu": _cpu_model(), "platform": platform.platform()},
        "load_before": os.getloadavg(),
        "versions": _versions(),
        "git": _git_state(),
    }
    try:
        meta["postgresql"] = common.server_facts(env)
    except Exception as exc:
        meta["postgresql"] = {"error": str(exc)}

    rows: list[common.Row] = []
    failed = False
    try:
        for name in args.sections:
            module = importlib.import_module(f"benchlib.{name}")
            t0 = time.monotonic()
            load_before = os.getloadavg()[0]
            print(f"-- {name} ...", file=sys.stderr, flush=True)
            try:
                section_rows = module.run(env)
            except Exception as exc:
                traceback.print_exc()
                section_rows = common.not_run(
                    module.rows(), f"{type(exc).__name__}: {exc}", error=True
                )
            meta.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 1)
            # The 1-minute load average around each section: how loaded the machine was.
            meta.setdefault("section_load", {})[name] = (load_before, os.getloadavg()[0])
            print(f"-- {name} done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
            rows.extend(section_rows)
    finally:
        common.drop_leftovers(env)
        try:
            common.redis_cleanup(env)
        except Exception as exc:
            print(
                f"warning: could not clean up Redis keys {env.redis_prefix}*: {exc}",
                file=sys.stderr,
            )

    report.compute_ratios(rows)
    target_results = report.targets(rows)
    meta["load_after"] = os.getloadavg()
    meta["seconds"] = round(time.monotonic() - started, 1)
    failed = any(r.status.startswith(("error", "failed")) for r in rows)

    print(report.format_table(rows))
    print()
    storm_table = report.format_storm(rows)
    if storm_table:
        print(storm_table)
        print()
    print(report.format_targets(target_results))
    print()
    print(
        f"{meta['date_utc']}  {meta['machine']['cores']} cores  "
        f"PostgreSQL {meta['postgresql'].get('server_version', '?')}  "
        f"load {meta['load_before'][0]:.2f} -> {meta['load_after'][0]:.2f}  {meta['seconds']} s"
    )
    if args.json:
        payload = {"meta": meta, "rows": [r.to_dict() for r in rows], "targets": target_results}
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
