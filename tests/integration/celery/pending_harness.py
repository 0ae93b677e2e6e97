"""What the coalesce, rate and combination-matrix worker tests share: one real
prefork worker per lock store (and broker) per test module, every run recorded in
PostgreSQL (``tg_pending_runs``), whichever store holds the locks."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from conftest import (
    REDIS_URL,
    drop_maria_database,
    drop_pg_database,
    new_maria_database,
    new_pg_database,
)
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
    broker: str = "redis"
    lock_url: str = ""
    pool: str = "prefork"

    def task(self, name: str) -> Any:
        return self.app.tasks[name]

    def key_id(self, name: str) -> str:
        return f"{self.store}-{self.broker}-{name}-{uuid.uuid4().hex[:6]}"


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


#: ``make_app(broker_url, result_backend, queue, lock_url, runs_url)`` of a worker app.
AppFactory = Callable[[str, str, str, str, str], Celery]


@contextlib.contextmanager
def running_env(
    request: pytest.FixtureRequest,
    store: str,
    *,
    app_module: str = "tg_pending_app",
    app_factory: AppFactory = make_app,
    broker: str = "redis",
    broker_url: str = REDIS_URL,
    concurrency: int = 4,
    worker_env: dict[str, str] | None = None,
    pool: str = "prefork",
) -> Iterator[PendingEnv]:
    """A worker of ``app_module`` whose locks live in ``store`` (postgresql, sqlite,
    mariadb), on ``broker_url``; runs recorded in a PostgreSQL database of its own.
    ``worker_env``: more environment for the worker; ``pool``: its ``-P``."""
    runs_url = new_pg_database(request.getfixturevalue("pg_template"))
    with psycopg.connect(libpq_url(runs_url), autocommit=True) as conn:
        conn.execute(RUNS_DDL)
    tmp = Path(tempfile.mkdtemp(prefix="tg-pending-"))
    lock_url = runs_url
    if store == "sqlite":
        lock_url = f"sqlite:///{tmp / 'locks.sqlite'}"
        schema.upgrade(lock_url)
    elif store == "mariadb":
        lock_url = new_maria_database(request.getfixturevalue("maria_template"))
    queue = unique_queue(f"tgp-{store}-{broker}")
    app = app_factory(broker_url, REDIS_URL, queue, lock_url, runs_url)
    guard = TaskGuard(lock_url)
    try:
        with start_worker(
            app_module, broker_url, lock_url, concurrency, pool, queue=queue,
            result_backend=REDIS_URL, env={"TG_RUNS_URL": runs_url, **(worker_env or {})},
        ) as worker:  # fmt: skip
            yield PendingEnv(store, app, worker, guard, runs_url, broker, lock_url, pool)
    finally:
        guard.dispose()
        app.close()
        reset_guards()
        drop_pg_database(runs_url)
        if store == "mariadb":
            drop_maria_database(lock_url)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module", params=STORES, name="penv")
def pending_env(request: pytest.FixtureRequest) -> Iterator[PendingEnv]:
    with running_env(request, request.param) as env:
        yield env
