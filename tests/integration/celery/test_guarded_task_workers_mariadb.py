"""The acceptance scenario of test_guarded_task_workers (fifty duplicate
submissions over three keys, a real prefork worker with concurrency 4) with the
locks, and the record of what actually ran, in MariaDB."""

from __future__ import annotations

from collections.abc import Iterator

import harness as shared
import pytest
import test_guarded_task_workers as scenarios
from conftest import REDIS_URL, drop_maria_database, new_maria_database
from tg_worker_app import RUNS_DDL_MARIADB, make_app, runs_connection
from workers import start_worker, unique_queue

from taskguard import TaskGuard
from taskguard.config import reset_guards

pytestmark = [pytest.mark.celery]


@pytest.fixture(scope="module")
def maria_env(maria_template: str) -> Iterator[shared.Env]:
    url = new_maria_database(maria_template)
    conn = runs_connection(url)
    conn.cursor().execute(RUNS_DDL_MARIADB)
    conn.close()
    queue = unique_queue("tg-maria")
    app = make_app(REDIS_URL, shared.RESULT_BACKEND, queue, url)
    guard = TaskGuard(url)
    try:
        with start_worker(
            "tg_worker_app", REDIS_URL, url, 4, queue=queue, result_backend=shared.RESULT_BACKEND
        ) as worker:
            yield shared.Env("redis", app, worker, guard, url)
    finally:
        guard.dispose()
        app.close()
        reset_guards()
        drop_maria_database(url)


def test_fifty_duplicates_never_overlap_per_key_on_mariadb(maria_env: shared.Env) -> None:
    scenarios.test_fifty_duplicates_never_overlap_per_key(maria_env)
