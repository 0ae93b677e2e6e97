"""Where taskguard's Celery features meet each other (issue 28): coalesce and
debounce members of canvases, a queue lock with conflict retries, two tasks with
pending runs on one key, a killed waiter, and the combination matrix (every
``lock=`` x ``on_conflict=`` x canvas shape), with real prefork workers.

One worker per lock store and broker serves the whole module (``menv``); every
case uses keys of its own, so cases run side by side.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from billiard.exceptions import WorkerLostError
from celery import chain, chord
from conftest import AMQP_URL, REDIS_URL
from harness import wait_for
from pending_harness import PendingEnv, running_env, runs
from sqlalchemy import select
from tg_matrix_app import INVALID, make_app

from taskguard import guarded_task
from taskguard.celery.pending import is_coalesced
from taskguard.exceptions import ConfigurationError
from taskguard.models import TaskLock
from taskguard.waiting import RESERVATION

pytestmark = [pytest.mark.celery, pytest.mark.postgres]

#: (lock store, broker) of each worker the module starts.
ENVS = [("postgresql", "redis")]
BROKER_URLS = {"redis": REDIS_URL, "amqp": AMQP_URL}
#: Longest any canvas may take to finish (a loaded 2-core machine).
BOUND = 60.0


@pytest.fixture(scope="module", params=ENVS, ids=[f"{s}-{b}" for s, b in ENVS], name="menv")
def matrix_env(request: pytest.FixtureRequest) -> Iterator[PendingEnv]:
    store, broker = request.param
    with running_env(
        request, store, app_module="tg_matrix_app", app_factory=make_app, broker=broker,
        broker_url=BROKER_URLS[broker], concurrency=8,
    ) as env:  # fmt: skip
        yield env


# -- declaration -------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_combinations_are_refused_at_declaration(case: str) -> None:
    with pytest.raises(ConfigurationError, match=f"task tgm.bad.{case}"):

        @guarded_task(name=f"tgm.bad.{case}", key="m:{key_id}", **INVALID[case])
        def bad(key_id: str) -> None: ...


# -- A: coalesce and debounce members of canvases ------------------------------------------


def test_coalesced_chord_members_do_not_hang_the_chord(menv: PendingEnv) -> None:
    kid = menv.key_id("chord")
    member = menv.task("tgm.run-coalesce")
    sig = chord(
        [member.s(key_id=kid, note=f"n{i}", duration=1.0) for i in range(3)],
        menv.task("tgm.collect").s(),
    )
    values = sig.apply_async().get(timeout=30)
    assert values[0] == "n0", values
    assert all(is_coalesced(v) for v in values[1:]), values
    assert [r.note for r in runs(menv, kid)] == ["n0"]


def test_a_chain_whose_first_link_merges_into_a_pending_run_goes_on(menv: PendingEnv) -> None:
    kid = menv.key_id("chain")
    task = menv.task("tgm.run-coalesce")
    task.delay(key_id=kid, note="running", duration=2.0)
    wait_for(lambda: runs(menv, kid), 20, "the first run")
    pending = task.delay(key_id=kid, note="pending")
    result = chain(task.s(key_id=kid, note="chained"), menv.task("tgm.echo").s()).apply_async()
    value = result.get(timeout=30)
    assert is_coalesced(value) and value["into"] == pending.id, value
    assert pending.get(timeout=30) == "pending"
    assert [r.note for r in runs(menv, kid)] == ["running", "pending"]


def test_debounced_chord_members_do_not_hang_the_chord(menv: PendingEnv) -> None:
    kid = menv.key_id("debounce-chord")
    member = menv.task("tgm.run-debounce")
    sig = chord(
        [member.s(key_id=kid, note=f"n{i}") for i in range(3)], menv.task("tgm.collect").s()
    )
    values = sig.apply_async().get(timeout=30)
    assert values[2] == "n2", values
    assert all(is_coalesced(v) for v in values[:2]), values
    assert [r.note for r in runs(menv, kid)] == ["n2"]


# -- B: lock="queue" with on_conflict="retry" ------------------------------------------------


def test_a_queue_lock_conflict_retried_in_the_worker_is_checked_again(menv: PendingEnv) -> None:
    kid = menv.key_id("queue-retry")
    task = menv.task("tgm.queue-retry")
    first = task.apply_async(kwargs={"key_id": kid, "note": "a"}, countdown=3)
    began = time.monotonic()
    second = task.apply_async(kwargs={"key_id": kid, "note": "b"})
    assert second.get(timeout=30) == "b" and first.get(timeout=30) == "a"
    found = {r.note: r for r in runs(menv, kid)}
    # b met a's queue lock and was put off until a left the queue (a started).
    assert found["b"].started_at >= found["a"].started_at, found
    assert time.monotonic() - began >= 3.0


# -- issue 27 item 4: two tasks with pending runs on one key ----------------------------


def test_a_coalesced_submission_never_merges_into_another_tasks_pending_run(
    menv: PendingEnv,
) -> None:
    url = menv.key_id("feed")
    imports, reindex = menv.task("tgm.import_feed"), menv.task("tgm.reindex_feed")
    first = imports.delay(url)
    time.sleep(0.5)
    debounced = reindex.delay(url, [1])
    time.sleep(0.2)
    second = imports.delay(url)
    assert not is_coalesced(second.result), second.result
    assert first.get(timeout=30) == "import"
    assert debounced.get(timeout=30) == "reindex"
    assert second.get(timeout=30) == "import"
    found = runs(menv, url)
    assert sorted(r.note for r in found) == ["import", "import", "reindex"], found


# -- E: a SIGKILLed waiter -----------------------------------------------------------------


def _next_owner(env: PendingEnv, key: str) -> str | None:
    with env.guard.engine.connect() as conn:
        return conn.execute(select(TaskLock.next_owner).where(TaskLock.key == key)).scalar()


def _pool_pid(env: PendingEnv, task_id: str) -> int:
    """The pool process running ``task_id`` (Celery's remote control)."""
    for tasks in (env.app.control.inspect(timeout=5).active() or {}).values():
        for task in tasks:
            if task["id"] == task_id:
                return int(task["worker_pid"])
    raise AssertionError(f"{task_id} is not running")


def test_a_killed_waiting_pool_process_stops_holding_up_the_key(menv: PendingEnv) -> None:
    kid = menv.key_id("killed-waiter")
    key = f"m:{kid}"
    holder = menv.guard.acquire(key, 30, task_name="holder")
    assert holder is not None
    doomed = menv.task("tgm.run-wait").delay(key_id=kid, note="killed")
    wait_for(lambda: _next_owner(menv, key), 30, "the waiter to be in line")
    os.kill(_pool_pid(menv, doomed.id), signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        doomed.get(timeout=30)
    time.sleep(RESERVATION + 1.0)
    # The key is free for anyone right after a release (the dead waiter's
    # reservation kept it for RESERVE_GRACE after every release, up to its wait_timeout).
    assert menv.guard.release(holder)
    taken = menv.guard.acquire(key, 30, task_name="skip")
    assert taken is not None, "the killed waiter's reservation still holds the key"
    # A live waiter gets the key when it is released.
    live = menv.task("tgm.run-wait").delay(key_id=kid, note="live")
    wait_for(lambda: _next_owner(menv, key), 30, "the live waiter to be in line")
    released_at = datetime.now(timezone.utc)
    assert menv.guard.release(taken)
    assert live.get(timeout=30) == "live"
    (run,) = runs(menv, kid)
    print(f"{menv.store}: handed over {(run.started_at - released_at).total_seconds():.3f}s")
