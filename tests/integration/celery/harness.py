"""What the real-worker tests share: one worker per broker per test module
(``env``), a database per module (``worker_db``), and readers of ``tg_runs``."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import pytest
from celery import Celery
from conftest import AMQP_URL, REDIS_URL, drop_pg_database, new_pg_database
from tg_worker_app import RUNS_DDL, libpq_url, make_app, runs_connection
from workers import Worker, start_worker, unique_queue

from taskguard import TaskGuard
from taskguard.config import reset_guards

BROKERS = {"amqp": AMQP_URL, "redis": REDIS_URL}
RESULT_BACKEND = REDIS_URL
RESULT_TIMEOUT = 60


@dataclass
class Env:
    broker: str
    app: Celery
    worker: Worker
    guard: TaskGuard
    db_url: str

    def task(self, name: str) -> Any:
        return self.app.tasks[name]


@dataclass
class Run:
    task_id: str
    retries: int
    token: int | None
    started_at: datetime
    ended_at: datetime | None


def runs(db_url: str, key_id: str) -> list[Run]:
    conn = runs_connection(db_url)  # PostgreSQL or MariaDB
    try:
        cur = conn.cursor()
        cur.execute(
            "SELECT task_id, retries, token, started_at, ended_at FROM tg_runs "
            "WHERE key_id = %s ORDER BY started_at",
            (key_id,),
        )
        rows = cur.fetchall()
    finally:
        conn.close()
    return [Run(*row) for row in rows]


def assert_no_overlap(found: list[Run]) -> None:
    for before, after in itertools.pairwise(found):
        assert before.ended_at is not None, f"run {before} never ended"
        assert after.started_at >= before.ended_at, f"overlap: {before} and {after}"


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module", name="worker_db")
def worker_db_fixture(pg_template: str) -> Iterator[str]:
    url = new_pg_database(pg_template)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(RUNS_DDL)
    yield url
    reset_guards()
    drop_pg_database(url)


@pytest.fixture(scope="module", params=sorted(BROKERS), name="env")
def env_fixture(request: pytest.FixtureRequest, worker_db: str) -> Iterator[Env]:
    broker = BROKERS[request.param]
    queue = unique_queue(f"tg-{request.param}")
    app = make_app(broker, RESULT_BACKEND, queue, worker_db)
    guard = TaskGuard(worker_db)
    try:
        with start_worker(
            "tg_worker_app", broker, worker_db, 4, queue=queue, result_backend=RESULT_BACKEND
        ) as worker:
            yield Env(request.param, app, worker, guard, worker_db)
    finally:
        guard.dispose()
        app.close()
        reset_guards()


def key_id(env: Env, name: str) -> str:
    return f"{env.broker}-{name}-{uuid.uuid4().hex[:6]}"


def started(env: Env, kid: str, count: int = 1) -> Callable[[], bool]:
    return lambda: len(runs(env.db_url, kid)) >= count
