"""What the coalesce and rate worker tests share: one real prefork worker per lock
store (PostgreSQL, SQLite) per test module, runs recorded in PostgreSQL."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from conftest import REDIS_URL, drop_pg_database, new_pg_database
from tg_pending_app import RUNS_DDL, make_app
from tg_worker_app import libpq_url
from workers import Worker, start_worker, unique_queue

from taskguard import TaskGuard, schema
from taskguard.config import reset_guards

STORES = ("postgresql", "sqlite")


@dataclass
class PendingEnv:
    store: str
    app: Celery
    worker: Worker
    guard: TaskGuard
    runs_url: str

    def task(self, name: str) -> Any:
        return self.app.tasks[name]

    def key_id(self, name: str) -> str:
        return f"{self.store}-{name}-{uuid.uuid4().hex[:6]}"


@dataclass
class PendingRun:
    task_id: str
    note: str
    pid: int
    started_at: datetime
    ended_at: datetime | None


def runs(env: PendingEnv, key_id: str) -> list[PendingRun]:
    with psycopg.connect(libpq_url(env.runs_url)) as conn:
        rows = conn.execute(
            "SELECT task_id, note, pid, started_at, ended_at FROM tg_pending_runs "
            "WHERE key_id = %s ORDER BY started_at",
            (key_id,),
        ).fetchall()
    return [PendingRun(*row) for row in rows]


@pytest.fixture(scope="module", params=STORES, name="penv")
def pending_env(request: pytest.FixtureRequest, pg_template: str) -> Iterator[PendingEnv]:
    runs_url = new_pg_database(pg_template)
    with psycopg.connect(libpq_url(runs_url), autocommit=True) as conn:
        conn.execute(RUNS_DDL)
    tmp = Path(tempfile.mkdtemp(prefix="tg-pending-"))
    lock_url = runs_url
    if request.param == "sqlite":
        lock_url = f"sqlite:///{tmp / 'locks.sqlite'}"
        schema.upgrade(lock_url)
    queue = unique_queue(f"tgp-{request.param}")
    app = make_app(REDIS_URL, REDIS_URL, queue, lock_url, runs_url)
    guard = TaskGuard(lock_url)
    try:
        with start_worker(
            "tg_pending_app", REDIS_URL, lock_url, 4, queue=queue, result_backend=REDIS_URL,
            env={"TG_RUNS_URL": runs_url},
        ) as worker:  # fmt: skip
            yield PendingEnv(request.param, app, worker, guard, runs_url)
    finally:
        guard.dispose()
        app.close()
        reset_guards()
        drop_pg_database(runs_url)
        shutil.rmtree(tmp, ignore_errors=True)
