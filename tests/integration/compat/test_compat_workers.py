"""A ``QueueOnce`` and a ``Singleton`` task on a real prefork worker (Redis broker;
locks in PostgreSQL, MariaDB, SQLite), with only the configuration switched to
taskguard's backends: duplicates refused or answered as before, the lock a row
while the call is queued and running, released when the task ends, expired by the
database clock."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celery_singleton.backends
import pytest
from celery import Celery, states
from celery_once import AlreadyQueued
from compat_app import make_app
from conftest import (
    REDIS_URL,
    drop_maria_database,
    drop_pg_database,
    new_maria_database,
    new_pg_database,
)
from integration.celery.workers import Worker, start_worker, unique_queue

from taskguard import LockInfo, TaskGuard
from taskguard.config import reset_guards

pytestmark = [pytest.mark.celery]

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]
RESULT_TIMEOUT = 60


@dataclass
class Env:
    app: Celery
    worker: Worker
    guard: TaskGuard

    def task(self, name: str) -> Any:
        return self.app.tasks[f"compat.{name}"]


@pytest.fixture(scope="module", params=["postgresql", "mariadb", "sqlite"])
def database(request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated database of each kind for the module's worker."""
    if request.param == "sqlite":
        path = request.getfixturevalue("tmp_path_factory").mktemp("compat") / "locks.sqlite"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        yield f"sqlite:///{path}"
    elif request.param == "mariadb":
        url = new_maria_database(request.getfixturevalue("maria_template"))
        yield url
        drop_maria_database(url)
    else:
        url = new_pg_database(request.getfixturevalue("pg_template"))
        yield url
        drop_pg_database(url)


@pytest.fixture(scope="module")
def env(database: str) -> Iterator[Env]:
    celery_singleton.backends._backend = None  # celery-singleton's per-process cache
    queue = unique_queue("tg-compat")
    app = make_app(REDIS_URL, REDIS_URL, queue, database)
    guard = TaskGuard(database)
    try:
        with start_worker(
            "compat_app", REDIS_URL, database, 2, queue=queue, result_backend=REDIS_URL,
            pythonpath=(HERE, TESTS),
        ) as worker:  # fmt: skip
            yield Env(app, worker, guard)
    finally:
        guard.dispose()
        app.close()
        reset_guards()
        celery_singleton.backends._backend = None


def _held(guard: TaskGuard, key: str) -> LockInfo | None:
    info = guard.get(key)
    return info if info is not None and info.held else None


def _wait_for(predicate: Callable[[], Any], what: str, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _past(guard: TaskGuard, info: LockInfo) -> None:
    """Wait until the database clock passes the lease's expiry."""
    _wait_for(lambda: guard.db_now() > info.expires_at, f"{info.key}'s expiry")


def test_queue_once_refuses_duplicates_until_the_run_ends(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    once = env.task("once_sleep")
    kid = uuid.uuid4().hex
    key = f"qo_compat.once_sleep_key_id-{kid}"
    first = once.apply_async(args=(kid, 0.5))
    row = _held(env.guard, key)
    assert row is not None and 50 < row.expires_in.total_seconds() <= 60  # default_timeout
    with caplog.at_level(logging.INFO, logger="taskguard"), pytest.raises(AlreadyQueued) as exc:
        once.apply_async(args=(kid, 0.0))
    assert 0 < exc.value.countdown <= 60
    assert f"lock {key!r} is held by owner {row.owner}" in caplog.text
    graceful = once.apply_async(args=(kid, 0.0), once={"graceful": True})
    assert graceful.state == states.REJECTED and graceful.result is None

    first.get(timeout=RESULT_TIMEOUT)
    _wait_for(lambda: _held(env.guard, key) is None, "release after the run")  # after_return
    assert env.guard.get(key) is not None  # the row stays until the reaper
    once.apply_async(args=(kid, 0.0)).get(timeout=RESULT_TIMEOUT)


def test_queue_once_lock_expires_by_the_database_clock(env: Env) -> None:
    once = env.task("once_sleep")
    kid = uuid.uuid4().hex
    key = f"qo_compat.once_sleep_key_id-{kid}"
    running = once.apply_async(args=(kid, 2.0), once={"timeout": 1})
    row = _held(env.guard, key)
    assert row is not None
    with pytest.raises(AlreadyQueued):
        once.apply_async(args=(kid, 0.0))
    _past(env.guard, row)
    assert running.state in (states.PENDING, states.STARTED)  # still queued or running
    second = once.apply_async(args=(kid, 0.0))  # taken again by the database's clock
    second.get(timeout=RESULT_TIMEOUT)
    running.get(timeout=RESULT_TIMEOUT)


def test_singleton_answers_duplicates_with_the_running_task_id(env: Env) -> None:
    single = env.task("singleton_sleep")
    kid = uuid.uuid4().hex
    first = single.apply_async(args=(kid, 0.5))
    assert single.apply_async(args=(kid, 0.0)).id == first.id
    lock = single.generate_lock(single.name, [kid, 0.5])
    row = _held(env.guard, lock)
    assert row is not None and row.holder.task_id == first.id
    assert 3500 < row.expires_in.total_seconds() <= 3600  # no lock_expiry: an hour

    first.get(timeout=RESULT_TIMEOUT)
    _wait_for(lambda: _held(env.guard, lock) is None, "release after the run")  # on_success
    again = single.apply_async(args=(kid, 0.0))
    assert again.id != first.id
    again.get(timeout=RESULT_TIMEOUT)


def test_singleton_keeps_the_lease_of_a_copy_queued_after_its_own_expired(env: Env) -> None:
    short = env.task("singleton_short")  # lock_expiry=1
    kid = uuid.uuid4().hex
    running = short.apply_async(args=(kid, 2.0))
    lock = short.generate_lock(short.name, [kid, 2.0])
    row = _held(env.guard, lock)
    assert row is not None and row.holder.task_id == running.id
    _past(env.guard, row)
    # Another publisher queues a copy now (its id is all that matters here).
    assert short.singleton_backend.lock(lock, "the-next-copy", expiry=60)

    running.get(timeout=RESULT_TIMEOUT)
    env.worker.wait_for_log(f"not releasing {lock!r} for task {running.id}", 20)
    assert short.singleton_backend.get(lock) == "the-next-copy"  # celery-singleton: DEL
