"""Celery app for the @guarded_task worker tests.

A worker process imports this module (``celery -A tg_worker_app worker``) and
builds its app from the environment (see ``workers.start_worker``); the test
process calls :func:`make_app` with the same settings to publish. Every guarded
task records each execution (start/end by the database clock, pid, lease token,
retry number) in ``tg_runs`` of the test database, so tests can check that runs
of one key never overlap.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from celery import Celery
from sqlalchemy.engine import make_url

from taskguard import current_lease, guarded_task

RUNS_DDL = """
CREATE TABLE IF NOT EXISTS tg_runs (
    id serial PRIMARY KEY,
    task text NOT NULL,
    key_id text NOT NULL,
    task_id text NOT NULL,
    retries int NOT NULL,
    token bigint,
    pid int NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz
)
"""

_local = threading.local()


def libpq_url(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL as a plain libpq URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _conn() -> psycopg.Connection[Any]:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed or getattr(_local, "pid", None) != os.getpid():
        url = os.environ["TASKGUARD_DATABASE_URL"]
        conn = psycopg.connect(libpq_url(url), autocommit=True)
        _local.conn, _local.pid = conn, os.getpid()
    return conn


def record(task: Any, key_id: str, duration: float) -> int:
    """Record a run of ``task`` while sleeping ``duration`` seconds; returns its token."""
    lease = current_lease(check=False)
    token = lease.token if lease is not None else None
    request = task.request
    row = (
        _conn()
        .execute(
            "INSERT INTO tg_runs (task, key_id, task_id, retries, token, pid) "
            "VALUES (%s, %s, %s, %s, %s, %s) RETURNING id",
            (task.name, key_id, request.id, request.retries, token, os.getpid()),
        )
        .fetchone()
    )
    assert row is not None
    time.sleep(duration)
    _conn().execute("UPDATE tg_runs SET ended_at = clock_timestamp() WHERE id = %s", (row[0],))
    return token or 0


def make_app(broker_url: str, result_backend: str | None, queue: str, database_url: str) -> Celery:
    """The app (tasks registered) for these settings."""
    app = Celery("tg_worker_app", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=result_backend,
        task_default_queue=queue,
        result_expires=600,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        taskguard_database_url=database_url,
        taskguard_engine_options={"pool_size": 2, "max_overflow": 3},
    )

    @guarded_task(app=app, shared=False, name="tg.slow", key="slow:{key_id}", ttl=3, bind=True)
    def slow(self: Any, key_id: str, duration: float = 0.3) -> int:
        return record(self, key_id, duration)

    @guarded_task(
        app=app,
        shared=False,
        name="tg.queued",
        key="queued:{key_id}",
        ttl=3,
        lock="queue_and_run",
        on_conflict="raise",
        bind=True,
    )
    def queued(self: Any, key_id: str, duration: float = 0.0) -> int:
        return record(self, key_id, duration)

    @guarded_task(app=app, shared=False, name="tg.long", key="long:{key_id}", ttl=1.5, bind=True)
    def long(self: Any, key_id: str, duration: float) -> int:
        return record(self, key_id, duration)

    @guarded_task(
        app=app,
        shared=False,
        name="tg.retrying",
        key="retrying:{key_id}",
        ttl=3,
        bind=True,
        max_retries=5,
    )
    def retrying(self: Any, key_id: str, retries_wanted: int) -> int:
        token = record(self, key_id, 0.3)
        if self.request.retries < retries_wanted:
            raise self.retry(countdown=0.5)
        return token

    @guarded_task(
        app=app,
        shared=False,
        name="tg.patient",
        key="slow:{key_id}",  # tg.slow's key: the two conflict
        ttl=3,
        on_conflict="retry",
        retry_countdown=0.3,
        max_retries=30,
        bind=True,
    )
    def patient(self: Any, key_id: str) -> int:
        return record(self, key_id, 0.0)

    @guarded_task(
        app=app, shared=False, name="tg.sleeper", key="sleeper:{key_id}", ttl=30, bind=True
    )
    def sleeper(self: Any, key_id: str, duration: float) -> int:
        return record(self, key_id, duration)

    @guarded_task(
        app=app,
        shared=False,
        name="tg.short_ttl",
        key="short:{key_id}",
        ttl=2,
        bind=True,
        acks_late=True,
    )
    def short_ttl(self: Any, key_id: str, duration: float) -> int:
        # acks_late: a killed worker's message is redelivered; that copy does not sleep.
        redelivered = (self.request.delivery_info or {}).get("redelivered")
        return record(self, key_id, 0 if redelivered else duration)

    @guarded_task(app=app, shared=False, name="tg.stubborn", key="stubborn:{key_id}", ttl=30)
    def stubborn(key_id: str, duration: float) -> None:
        # Swallows the SIGTERM billiard sends on a hard time limit (SystemExit),
        # so it has to be SIGKILLed: its finally never releases.
        try:
            record(stubborn, key_id, duration)
        except BaseException:
            time.sleep(duration)

    return app


def _from_environment() -> Celery:
    return make_app(
        broker_url=os.environ.get("TASKGUARD_TEST_BROKER_URL", "memory://"),
        result_backend=os.environ.get("TASKGUARD_TEST_RESULT_BACKEND") or None,
        queue=os.environ.get("TASKGUARD_TEST_QUEUE", "tg_worker_app"),
        database_url=os.environ.get("TASKGUARD_DATABASE_URL", ""),
    )


app = _from_environment()
