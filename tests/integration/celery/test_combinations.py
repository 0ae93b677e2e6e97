"""Where taskguard's Celery features meet each other (issue 28): coalesce and
debounce members of canvases, a queue lock with conflict retries, two tasks with
pending runs on one key, a killed waiter, and the combination matrix (every
``lock=`` x ``on_conflict=`` x canvas shape), with real prefork workers.

One worker per lock store and broker serves the whole module (``menv``); every
case uses keys of its own, so cases run side by side.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from celery import chain, chord
from conftest import AMQP_URL, REDIS_URL
from harness import wait_for
from pending_harness import PendingEnv, running_env, runs
from tg_matrix_app import INVALID, make_app

from taskguard import guarded_task
from taskguard.celery.pending import is_coalesced
from taskguard.exceptions import ConfigurationError

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
