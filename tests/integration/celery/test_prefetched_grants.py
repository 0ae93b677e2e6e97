"""Run leases of prefetched messages, taken by the worker's main process in batches
(taskguard.celery.prefetched, issue 18), with a real prefork worker (2 processes,
4 messages prefetched each) on RabbitMQ and PostgreSQL. Runs are recorded in
``tg_runs`` by the database clock, as in the other worker tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import AMQP_URL
from harness import (  # noqa: F401  (fixture: worker_db)
    RESULT_BACKEND,
    RESULT_TIMEOUT,
    assert_no_overlap,
    runs,
    wait_for,
    worker_db_fixture,
)
from tg_worker_app import make_app
from workers import Worker, start_worker, unique_queue

from taskguard import TaskGuard, is_skipped
from taskguard.config import reset_guards

pytestmark = [pytest.mark.celery, pytest.mark.postgres]


class Setup:
    def __init__(self, app: Any, worker: Worker, guard: TaskGuard, db_url: str) -> None:
        self.app, self.worker, self.guard, self.db_url = app, worker, guard, db_url

    def task(self, name: str) -> Any:
        return self.app.tasks[name]


@contextlib.contextmanager
def _start(worker_db: str, grants: bool) -> Iterator[Setup]:
    queue = unique_queue("tg-prefetch")
    app = make_app(AMQP_URL, RESULT_BACKEND, queue, worker_db)
    guard = TaskGuard(worker_db)
    env = {
        "TASKGUARD_TEST_PREFETCH_MULTIPLIER": "4",
        "TASKGUARD_TEST_PREFETCH_GRANTS": "1" if grants else "0",
    }
    try:
        with start_worker(
            "tg_worker_app",
            AMQP_URL,
            worker_db,
            2,
            queue=queue,
            result_backend=RESULT_BACKEND,
            env=env,
        ) as worker:
            yield Setup(app, worker, guard, worker_db)
    finally:
        guard.dispose()
        app.close()
        reset_guards()


@pytest.fixture(scope="module")
def setup(worker_db: str) -> Iterator[Setup]:
    with _start(worker_db, grants=True) as started:
        yield started


def _kid(name: str) -> str:
    return f"{name}-{time.monotonic_ns()}"


def _occupy(setup: Setup, seconds: float) -> list[Any]:
    """Keep both pool processes busy for ``seconds`` (and wait until they are)."""
    kids = [_kid(f"busy{i}") for i in range(2)]
    results = [setup.task("tg.sleeper").delay(kid, seconds) for kid in kids]
    for kid in kids:
        wait_for(lambda k=kid: runs(setup.db_url, k), 30, "the pool processes to be busy")
    return results


def _behind_busy(setup: Setup, seconds: float, task: str, name: str, duration: float) -> Any:
    """Both processes busy for ``seconds``, then one ``task`` message of a fresh key:
    (busy results, key id, its result, its grant as read while it waits)."""
    busy = _occupy(setup, seconds)
    kid = _kid(name)
    result = setup.task(task).delay(kid, duration)
    prefix = task.removeprefix("tg.")
    wait_for(lambda: setup.guard.get(f"{prefix}:{kid}"), 10, "the prefetched grant")
    granted = setup.guard.get(f"{prefix}:{kid}")
    assert granted is not None and granted.held and granted.holder.pid == setup.worker.pid
    return busy, kid, result, granted


def test_the_main_process_grants_and_the_runs_hold(setup: Setup) -> None:
    kids = [_kid(f"g{i}") for i in range(40)]
    results = [setup.task("tg.slow").delay(kid, 0.02) for kid in kids]
    tokens = [r.get(timeout=RESULT_TIMEOUT) for r in results]
    assert not any(is_skipped(t) for t in tokens)
    for kid, token in zip(kids, tokens, strict=True):
        (run,) = runs(setup.db_url, kid)
        info = setup.guard.get(f"slow:{kid}")
        assert info is not None and not info.held  # released by the pool process
        assert run.token == token == info.token  # the run held the granted lease
        # The row names the worker's main process: it took the lease.
        assert info.holder.pid == setup.worker.pid


def test_prefetched_duplicates_never_overlap(setup: Setup) -> None:
    # Both processes busy, so six messages of one key are prefetched together: the
    # first gets the grant, the others go to the pool without one and are refused
    # while the first (granted before any of them started) runs.
    busy = _occupy(setup, 1.0)
    kid = _kid("dup")
    results = [setup.task("tg.slow").delay(kid, 0.5) for _ in range(6)]
    values = [r.get(timeout=RESULT_TIMEOUT) for r in results]
    ran = [r.id for r, v in zip(results, values, strict=True) if not is_skipped(v)]
    skipped = [v for v in values if is_skipped(v)]
    assert ran[0] == results[0].id  # the granted one
    assert skipped and len(ran) + len(skipped) == 6
    found = runs(setup.db_url, kid)
    assert_no_overlap(found)
    assert sorted(run.task_id for run in found) == sorted(ran)
    for value in skipped:  # each refusal names a run that really ran
        assert value["holder"]["task_id"] in ran
    for result in busy:
        result.get(timeout=RESULT_TIMEOUT)


def test_a_grant_revoked_before_it_started_is_given_back(setup: Setup) -> None:
    busy, kid, waiting, granted = _behind_busy(setup, 2.0, "tg.sleeper", "revoked", 0)  # ttl 30 s
    setup.app.control.revoke(waiting.id)
    for result in busy:
        result.get(timeout=RESULT_TIMEOUT)
    wait_for(lambda: not setup.guard.get(f"sleeper:{kid}").held, 10, "the grant to be given back")  # type: ignore[union-attr]
    freed = setup.guard.get(f"sleeper:{kid}")
    assert freed is not None and freed.read_at < granted.expires_at  # not by expiry
    assert runs(setup.db_url, kid) == []
    setup.worker.wait_for_log(f"gave back lock 'sleeper:{kid}'", 10)


def test_a_grant_that_waited_past_its_ttl_is_taken_afresh(setup: Setup) -> None:
    # tg.long has a 1.5 s ttl; the message waits 2.5 s behind two busy processes,
    # so its grant has expired when a process starts it: acquired again, never two
    # runs at once, and a token above the lapsed grant's.
    busy, kid, late, granted = _behind_busy(setup, 2.5, "tg.long", "lapsed", 0.1)
    token = late.get(timeout=RESULT_TIMEOUT)
    assert token > granted.token
    (run,) = runs(setup.db_url, kid)
    assert run.token == token
    for result in busy:
        result.get(timeout=RESULT_TIMEOUT)
    setup.worker.wait_for_log(f"prefetched lease on 'long:{kid}' lapsed", 10)


def test_a_grant_that_waited_a_while_is_renewed(setup: Setup) -> None:
    # 0.8 s behind busy processes: past 5% of the 1.5 s ttl, not past the ttl.
    busy, _, late, granted = _behind_busy(setup, 0.8, "tg.long", "renewed", 0.1)
    assert late.get(timeout=RESULT_TIMEOUT) == granted.token  # the same lease, renewed
    for result in busy:
        result.get(timeout=RESULT_TIMEOUT)


def test_a_stopping_worker_gives_back_what_no_process_started(worker_db: str) -> None:
    with _start(worker_db, grants=True) as setup:
        _, kid, _, granted = _behind_busy(setup, 1.5, "tg.sleeper", "stopped", 0)
        setup.worker.stop()  # warm shutdown: the busy runs finish, the waiting one never starts
        freed = setup.guard.get(f"sleeper:{kid}")
        assert freed is not None and not freed.held and freed.read_at < granted.expires_at
        assert runs(setup.db_url, kid) == []


def test_off_switch_leaves_the_grant_to_the_pool_process(worker_db: str) -> None:
    with _start(worker_db, grants=False) as setup:
        kid = _kid("off")
        token = setup.task("tg.slow").delay(kid, 0.02).get(timeout=RESULT_TIMEOUT)
        info = setup.guard.get(f"slow:{kid}")
        assert info is not None and info.token == token
        assert info.holder.pid != setup.worker.pid  # a pool process took it
