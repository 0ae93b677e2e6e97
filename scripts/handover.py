"""Hand-over latency of waiting acquires, in waves (issue 16, item 3).

    python scripts/handover.py [--pg-url postgresql+psycopg://postgres@127.0.0.1/postgres]

Per wave, 4 processes wait (``acquire(..., wait=30)``) on a key the parent holds;
the parent releases it and each waiter holds it 50 ms in turn. Prints the p50 and
worst time from one release to the next grant, per wave, on PostgreSQL (woken by
LISTEN/NOTIFY) and SQLite (polling). A reservation left behind by an earlier wave
shows up as ~500 ms hand-overs in the later waves.
"""

import argparse
import itertools
import multiprocessing as mp
import statistics
import tempfile
import time
import uuid
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from taskguard import TaskGuard, schema


def waiter(url: str, key: str, out: Any) -> None:
    guard = TaskGuard(url)
    lease = guard.acquire(key, 60, wait=30)
    assert lease is not None
    out.put(("granted", time.time()))
    time.sleep(0.05)
    out.put(("released", time.time()))
    guard.release(lease)
    guard.dispose()


def waves(url: str, rounds: int = 3, waiters: int = 4) -> None:
    ctx = mp.get_context("fork")
    guard = TaskGuard(url)
    for wave in range(1, rounds + 1):
        out = ctx.Queue()
        first = guard.acquire("feed", 60)
        assert first is not None
        procs = [ctx.Process(target=waiter, args=(url, "feed", out)) for _ in range(waiters)]
        for proc in procs:
            proc.start()
        time.sleep(1.0)  # every waiter is in line
        released = time.time()
        guard.release(first)
        events = [("released", released)] + [out.get(timeout=60) for _ in range(2 * waiters)]
        for proc in procs:
            proc.join()
        events.sort(key=lambda e: e[1])
        gaps = [
            b[1] - a[1]
            for a, b in itertools.pairwise(events)
            if a[0] == "released" and b[0] == "granted"
        ]
        print(
            f"{make_url(url).get_backend_name()} wave {wave}: {len(gaps)} hand-overs, "
            f"p50 {statistics.median(gaps) * 1000:.1f} ms, max {max(gaps) * 1000:.1f} ms"
        )
    guard.dispose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1/postgres")
    args = parser.parse_args()
    server = make_url(args.pg_url)
    admin = server.set(drivername="postgresql").render_as_string(hide_password=False)
    name = "tg_handover_" + uuid.uuid4().hex[:8]
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    try:
        pg = server.set(database=name).render_as_string(hide_password=False)
        schema.upgrade(pg)
        waves(pg)
        with tempfile.TemporaryDirectory() as tmp:
            lite = f"sqlite:///{tmp}/locks.sqlite"
            schema.upgrade(lite)
            waves(lite)
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
