"""Celery app for the fault matrix (tests/integration/test_fault_matrix.py).

One guarded task per phase (lock="run", lock="queue_and_run", on_conflict="coalesce",
debounce, on_conflict="wait"), all on the key ``fm:{k}``. Every body records its run
in ``fm_runs`` of a *record* database that no fault touches (the shared PostgreSQL
server; the lock database is a private one the test stops, freezes and partitions):
start and end by that server's clock, the lease's token, the pool process, and
how it ended (``ok``, or ``lost`` when check_lease() reported the lease lost). A
body polls check_lease() while it works, as a body with side effects should.

The workers run with ``acks_late`` and ``task_reject_on_worker_lost`` (a killed
run's message is delivered again: at-least-once), and a body that finds its lease
lost raises LeaseLost, which ``autoretry_for`` retries: every submission must end
as a run that completed under its lease, or as the marker of a run that covers it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from celery import Celery
from integration.celery.workers import worker_settings

from taskguard import LeaseLost, check_lease, current_lease, guarded_task

#: Lease length of every task (seconds); the faults last longer.
TTL = 4.0
#: How long a body works (seconds): the first submission of a key long enough for
#: a fault to strike it, the others briefly.
FIRST_BODY = 6.0
BODY = 1.0

RUNS_DDL = """
CREATE TABLE IF NOT EXISTS fm_runs (
    id serial PRIMARY KEY,
    task text NOT NULL,
    k text NOT NULL,
    task_id text NOT NULL,
    n int NOT NULL,
    token bigint,
    worker text NOT NULL,
    pid int NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz,
    outcome text
)
"""

_local = threading.local()


def _records() -> Any:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        conn = psycopg.connect(os.environ["FM_RECORD_DSN"], autocommit=True)
        _local.conn, _local.pid = conn, os.getpid()
    return conn


def work(task: Any, k: str, n: int) -> dict[str, Any]:
    """The body every task runs: record the start, work checking the lease, record
    the end and how it ended."""
    lease = current_lease(check=False)
    row = (
        _records()
        .execute(
            "INSERT INTO fm_runs (task, k, task_id, n, token, worker, pid) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
            (
                task.name,
                k,
                task.request.id,
                n,
                lease.token if lease else None,
                os.environ.get("FM_WORKER", "?"),
                os.getpid(),
            ),
        )
        .fetchone()
    )
    assert row is not None
    outcome = "ok"
    try:
        end = time.monotonic() + (FIRST_BODY if n == 0 else BODY)
        while time.monotonic() < end:
            check_lease()
            time.sleep(0.02)
        return {"k": k, "n": n, "ran": task.request.id}
    except LeaseLost:
        outcome = "lost"
        raise
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        _records().execute(
            "UPDATE fm_runs SET ended_at = clock_timestamp(), outcome = %s WHERE id = %s",
            (outcome, row[0]),
        )


def make_app(broker: str, backend: str, queue: str, lock_url: str) -> Celery:
    app = Celery("fault_matrix", set_as_current=False)
    app.conf.update(
        worker_settings(
            broker,
            backend,
            queue,
            lock_url,
            task_acks_late=True,
            task_reject_on_worker_lost=True,
            taskguard_call_timeout=3.0,
            taskguard_engine_options={"pool_size": 2, "max_overflow": 3},
        )
    )
    common: dict[str, Any] = {
        "app": app,
        "shared": False,
        "bind": True,
        "key": "fm:{k}",
        "ttl": TTL,
        "autoretry_for": (LeaseLost,),
        "default_retry_delay": 0.5,
        "max_retries": 100,
    }

    @guarded_task(name="fm.run", on_conflict="retry", retry_countdown=0.5, **common)
    def run(self: Any, k: str, n: int) -> dict[str, Any]:
        return work(self, k, n)

    @guarded_task(
        name="fm.queue_and_run",
        lock="queue_and_run",
        on_conflict="retry",
        retry_countdown=0.5,
        **common,
    )
    def queue_and_run(self: Any, k: str, n: int) -> dict[str, Any]:
        return work(self, k, n)

    @guarded_task(name="fm.coalesce", on_conflict="coalesce", **common)
    def coalesce(self: Any, k: str, n: int) -> dict[str, Any]:
        return work(self, k, n)

    @guarded_task(name="fm.debounce", debounce=0.5, **common)
    def debounce(self: Any, k: str, n: int) -> dict[str, Any]:
        return work(self, k, n)

    @guarded_task(name="fm.wait", on_conflict="wait", wait_timeout=60, **common)
    def wait(self: Any, k: str, n: int) -> dict[str, Any]:
        return work(self, k, n)

    return app


if os.environ.get("TASKGUARD_TEST_QUEUE"):  # imported by `celery -A fault_matrix_app worker`
    app = make_app(
        os.environ["TASKGUARD_TEST_BROKER_URL"],
        os.environ["TASKGUARD_TEST_RESULT_BACKEND"],
        os.environ["TASKGUARD_TEST_QUEUE"],
        os.environ["TASKGUARD_DATABASE_URL"],
    )
