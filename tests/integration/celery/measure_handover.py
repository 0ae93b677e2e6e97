"""Measure how fast a released key reaches the next ``on_conflict="wait"`` task
(issue 16 item 3), with a real prefork worker, in several waves on one key.

    python tests/integration/celery/measure_handover.py [--waves 3] [--per-wave 4]
        [--broker redis://127.0.0.1:6379/0] [--finished-retention 0]

After one unreported warm-up wave (on another key), each wave publishes
``per-wave`` waiters for the same key at once; they run one after another
(concurrency = per-wave). The hand-over of one wave is the gap
between a run's end and the next run's start, both by the database clock. Prints
p50 and max per wave. A figure, not a test: speed targets live in scripts/bench.py.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[2])]

import psycopg  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402
from tg_worker_app import RUNS_DDL, libpq_url, make_app  # noqa: E402
from workers import start_worker, unique_queue  # noqa: E402

from taskguard import schema  # noqa: E402
from tests.services import PG_URL, REDIS_URL  # noqa: E402
from tests.services import pg_admin as _admin  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--per-wave", type=int, default=4)
    parser.add_argument("--broker", default=REDIS_URL)
    parser.add_argument(
        "--finished-retention",
        help="taskguard_finished_retention for the worker (0: no finished-task records)",
    )
    args = parser.parse_args()
    name = f"tg_handover_{uuid.uuid4().hex[:8]}"
    with _admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    db_url = make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    try:
        schema.upgrade(db_url)
        with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
            conn.execute(RUNS_DDL)
        queue = unique_queue("tg-handover")
        app = make_app(args.broker, REDIS_URL, queue, db_url)
        kid = f"handover-{uuid.uuid4().hex[:6]}"
        with start_worker(
            "tg_worker_app",
            args.broker,
            db_url,
            args.per_wave,
            queue=queue,
            result_backend=REDIS_URL,
        ):
            # Warm-up, not reported: each pool child opens its connections (the
            # harness's own tg_runs connection included) on a key of its own.
            warm = [app.tasks["tg.waiter"].delay(f"{kid}-warm", 0.05) for _ in range(args.per_wave)]
            for result in warm:
                result.get(timeout=120)
            for wave in range(1, args.waves + 1):
                results = [app.tasks["tg.waiter"].delay(kid, 0.05) for _ in range(args.per_wave)]
                for result in results:
                    result.get(timeout=120)
                with psycopg.connect(libpq_url(db_url)) as conn:
                    rows = conn.execute(
                        "SELECT started_at, ended_at FROM tg_runs WHERE key_id = %s "
                        "AND task_id = ANY(%s) ORDER BY started_at",
                        (kid, [r.id for r in results]),
                    ).fetchall()
                gaps = [
                    (nxt[0] - prev[1]).total_seconds() * 1000
                    for prev, nxt in itertools.pairwise(rows)
                ]
                print(
                    f"wave {wave}: {len(rows)} runs, hand-over p50 {statistics.median(gaps):.1f} ms, "
                    f"max {max(gaps):.1f} ms ({', '.join(f'{g:.0f}' for g in gaps)})"
                )
                time.sleep(1.0)
        app.close()
    finally:
        with _admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
