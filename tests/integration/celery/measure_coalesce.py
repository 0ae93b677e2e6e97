"""Measure how soon the pending run of ``on_conflict="coalesce"`` starts after the
running one ends (issue 17), with a real prefork worker, per lock store.

    python tests/integration/celery/measure_coalesce.py [--durations 0.5 3] [--trials 3]
        [--stores postgresql sqlite]

Each trial runs one holder of ``duration`` seconds, submits one more run while it
runs, and reports the gap between the holder's end and the pending run's start
(both by the runs database's clock). The pending run re-checks with countdowns of
0.25 s doubling to 1 s, so the gap is up to about 1 s. A figure, not
a test: speed targets live in scripts/bench.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[2])]

import psycopg  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402
from tg_pending_app import RUNS_DDL, make_app  # noqa: E402
from tg_worker_app import libpq_url  # noqa: E402
from workers import start_worker, unique_queue  # noqa: E402

from taskguard import schema  # noqa: E402
from tests.services import PG_URL, REDIS_URL  # noqa: E402
from tests.services import pg_admin as _admin  # noqa: E402


def _rows(runs_url: str, kid: str) -> list[tuple[object, ...]]:
    with psycopg.connect(libpq_url(runs_url)) as conn:
        return conn.execute(
            "SELECT started_at, ended_at FROM tg_pending_runs WHERE key_id = %s "
            "ORDER BY started_at",
            (kid,),
        ).fetchall()


def _measure(store: str, runs_url: str, durations: list[float], trials: int) -> None:
    lock_url = runs_url
    if store == "sqlite":
        lock_url = f"sqlite:///{tempfile.mkdtemp(prefix='tg-measure-')}/locks.sqlite"
        schema.upgrade(lock_url)
    queue = unique_queue(f"tg-measure-{store}")
    app = make_app(REDIS_URL, REDIS_URL, queue, lock_url, runs_url)
    task = app.tasks["tgp.coalesce"]
    with start_worker(
        "tg_pending_app", REDIS_URL, lock_url, 4, queue=queue, result_backend=REDIS_URL,
        env={"TG_RUNS_URL": runs_url},
    ):  # fmt: skip
        task.delay(f"warm-{uuid.uuid4().hex[:6]}", "warm", 0.0).get(timeout=60)
        for duration in durations:
            gaps = []
            for _ in range(trials):
                kid = f"measure-{uuid.uuid4().hex[:6]}"
                task.delay(kid, "holder", duration)
                while not _rows(runs_url, kid):
                    time.sleep(0.02)
                task.delay(kid, "pending", 0.0).get(timeout=120)
                (_, ended), (started, _) = _rows(runs_url, kid)
                gaps.append((started - ended).total_seconds() * 1000)  # type: ignore[operator]
            print(
                f"{store}: holder {duration:g}s: pending run started p50 "
                f"{statistics.median(gaps):.0f} ms, max {max(gaps):.0f} ms after it ended "
                f"({', '.join(f'{g:.0f}' for g in gaps)})"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--durations", type=float, nargs="+", default=[0.5, 3.0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--stores", nargs="+", default=["postgresql", "sqlite"])
    args = parser.parse_args()
    name = f"tg_measure_{uuid.uuid4().hex[:8]}"
    with _admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    runs_url = make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    try:
        schema.upgrade(runs_url)
        with psycopg.connect(libpq_url(runs_url), autocommit=True) as conn:
            conn.execute(RUNS_DDL)
        for store in args.stores:
            _measure(store, runs_url, args.durations, args.trials)
    finally:
        with _admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
