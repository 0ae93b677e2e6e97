#!/usr/bin/env python3
"""taskguard through PgBouncer: error rate and pairs/s per connection setting.

Each configuration runs ``--procs`` processes x ``--ops`` acquire / renew / release
cycles on 3 contended keys, against a fresh migrated database on the shared server
(127.0.0.1:5432), directly and through a private PgBouncer (transaction and session
pooling, ``default_pool_size = 5``). Errors are counted by their first line, with
the SQLSTATE-free message shortened (``_pg3_N`` -> ``_pg3_*``).

    python scripts/pooler_probe.py                       # every configuration
    python scripts/pooler_probe.py --only tx-default     # one of them
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psycopg
from chaoslib.pgbouncer import PgBouncer, pgbouncer_version
from sqlalchemy.engine import make_url

from taskguard import TaskGuard, schema

BASE = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

#: name -> (route, engine kwargs)
#: "default" is what taskguard does by itself; "prepared" forces psycopg's default
#: (named statements after 5 runs: taskguard before issue 13).
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "direct-default": ("direct", {}),
    "tx-default": ("transaction", {}),
    "tx-prepared": ("transaction", {"connect_args": {"prepare_threshold": 5}}),
    "session-default": ("session", {}),
}


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"postgresql\+psycopg://\S+", "<url>", text)
    text = re.sub(r"owner [0-9a-f]+|'k\d'", "...", text)
    text = re.sub(r"_pg3_\d+", "_pg3_*", text)
    text = re.sub(
        r"supplies \d+ parameters, but prepared statement .* requires \d+",
        "supplies N parameters, but another statement requires M",
        text,
    )
    return f"{type(exc).__name__}: {text[:140]}"


def _worker(url: str, kwargs: dict[str, Any], ops: int, seed: int, out: Any) -> None:
    guard = TaskGuard(url, **kwargs)
    errors: Counter[str] = Counter()
    calls = grants = 0
    keys = [f"k{i}" for i in range(3)]
    t0 = time.perf_counter()
    for i in range(ops):
        key = keys[(i + seed) % 3]
        try:
            calls += 1
            lease = guard.acquire(key, 5)
        except Exception as exc:
            errors[_short(exc)] += 1
            continue
        if lease is None:
            continue
        grants += 1
        for op in (guard.renew, guard.release):
            calls += 1
            try:
                op(lease)
            except Exception as exc:
                errors[_short(exc)] += 1
    elapsed = time.perf_counter() - t0
    guard.dispose()
    out.put({"calls": calls, "grants": grants, "errors": dict(errors), "seconds": elapsed})


def run(name: str, bouncers: dict[str, PgBouncer], procs: int, ops: int) -> dict[str, Any]:
    route, kwargs = CONFIGS[name]
    db = f"tg_probe_{uuid.uuid4().hex[:8]}"
    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres", autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{db}"')
    try:
        direct = make_url(BASE).set(database=db).render_as_string(hide_password=False)
        schema.upgrade(direct)
        url = direct if route == "direct" else bouncers[route].url(db)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        ps = [ctx.Process(target=_worker, args=(url, kwargs, ops, i, out)) for i in range(procs)]
        t0 = time.perf_counter()
        for p in ps:
            p.start()
        results = [out.get(timeout=600) for _ in ps]
        wall = time.perf_counter() - t0
        for p in ps:
            p.join(30)
    finally:
        for b in bouncers.values():
            # The pooler keeps server connections to the database: let them go first.
            with psycopg.connect(b.admin_dsn(), autocommit=True) as c:
                c.execute(f"KILL {db}")
                c.execute(f"RESUME {db}")
        with psycopg.connect("host=127.0.0.1 port=5432 user=postgres", autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
    calls = sum(r["calls"] for r in results)
    grants = sum(r["grants"] for r in results)
    failed = sum(errors.values())
    busiest = max(r["seconds"] for r in results)
    return {
        "config": name,
        "calls": calls,
        "grants": grants,
        "failed_calls": failed,
        "error_rate": round(failed / calls, 3) if calls else None,
        "pairs_per_s": round(grants / busiest, 1) if busiest else None,
        "calls_per_s": round(calls / busiest, 1) if busiest else None,
        "wall_s": round(wall, 2),
        "errors": dict(errors.most_common()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--pool-size", type=int, default=5)
    ap.add_argument("--only", action="append", choices=sorted(CONFIGS))
    args = ap.parse_args()
    names = args.only or list(CONFIGS)
    print(f"# {pgbouncer_version()}, {args.procs} procs x {args.ops} cycles, 3 keys", flush=True)
    tx = PgBouncer(pool_mode="transaction", default_pool_size=args.pool_size)
    se = PgBouncer(pool_mode="session", default_pool_size=args.procs + 2)
    with tx, se:
        for name in names:
            print(
                json.dumps(run(name, {"transaction": tx, "session": se}, args.procs, args.ops)),
                flush=True,
            )


if __name__ == "__main__":
    main()
