"""@guarded_task with real ``celery worker`` processes (prefork, concurrency 4) on
RabbitMQ and on Redis, against PostgreSQL. Each run is recorded in ``tg_runs``
(start/end by the database clock), so "never two at once per key" is checked
from what actually executed, not from what the library says."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import pytest
from celery import chain
from celery.signals import before_task_publish
from conftest import AMQP_URL
from harness import (  # noqa: F401  (fixtures: env, worker_db)
    RESULT_BACKEND,
    RESULT_TIMEOUT,
    Env,
    assert_no_overlap,
    env_fixture,
    key_id,
    runs,
    started,
    wait_for,
    worker_db_fixture,
)
from tg_worker_app import make_app
from workers import purge_queue, start_worker, unique_queue

from taskguard import AlreadyLocked, TaskGuard, is_skipped
from taskguard.celery.message import HEADER, Handed, Header
from taskguard.config import reset_guards

pytestmark = [pytest.mark.celery, pytest.mark.postgres]

# -- the acceptance scenario ------------------------------------------------------------


def test_fifty_duplicates_never_overlap_per_key(env: Env) -> None:
    slow = env.task("tg.slow")
    keys = [key_id(env, f"dup{i}") for i in range(3)]
    results = [slow.delay(keys[i % 3], 0.3) for i in range(50)]
    values = [r.get(timeout=RESULT_TIMEOUT) for r in results]

    skipped = [(r, v) for r, v in zip(results, values, strict=True) if is_skipped(v)]
    ran = [r for r, v in zip(results, values, strict=True) if not is_skipped(v)]
    print(f"{env.broker}: 50 submissions over 3 keys: {len(ran)} ran, {len(skipped)} skipped")
    assert skipped and ran and len(skipped) + len(ran) == 50
    ran_ids = {r.id for r in ran}
    executed = []
    for kid in keys:
        found = runs(env.db_url, kid)
        assert found, f"nothing ran for {kid}"
        assert_no_overlap(found)
        executed += [run.task_id for run in found]
    assert sorted(executed) == sorted(ran_ids)  # every non-skipped result ran exactly once

    log = env.worker.log_text()
    for result, value in skipped:
        assert value["key"] == f"slow:{keys[results.index(result) % 3]}"
        assert value["holder"]["task_id"] in ran_ids  # the holder was a real run
        line = next(x for x in log.splitlines() if f"skipped tg.slow[{result.id}]" in x)
        assert "WARNING" in line and value["key"] in line and value["holder"]["task_id"] in line
    assert len(re.findall(r"skipped tg\.slow\[", log)) >= len(skipped)


def test_queue_and_run_raise_at_delay_until_the_first_finished(env: Env) -> None:
    queued = env.task("tg.queued")
    kid = key_id(env, "qr")
    first = queued.delay(kid, 1.5)
    with pytest.raises(AlreadyLocked) as queued_conflict:
        queued.delay(kid)
    assert queued_conflict.value.holder is not None
    assert queued_conflict.value.holder.holder.task_id == first.id

    wait_for(started(env, kid), 30, "the first run to start")
    with pytest.raises(AlreadyLocked) as running_conflict:
        queued.delay(kid)
    assert running_conflict.value.holder.holder.task_id == first.id  # type: ignore[union-attr]

    token = first.get(timeout=RESULT_TIMEOUT)
    assert token == queued_conflict.value.holder.token  # the enqueue lease was the run's lease
    assert not is_skipped(queued.delay(kid).get(timeout=RESULT_TIMEOUT))
    found = runs(env.db_url, kid)
    assert len(found) == 2 and found[0].task_id == first.id
    assert_no_overlap(found)


def test_a_task_longer_than_its_ttl_is_renewed_not_run_twice(env: Env) -> None:
    long = env.task("tg.long")  # ttl 1.5 s, body 4.5 s
    kid = key_id(env, "long")
    first = long.delay(kid, 4.5)
    wait_for(started(env, kid), 30, "the long run to start")
    t0 = time.monotonic()
    duplicates = []
    while time.monotonic() - t0 < 3.0:  # well past two ttls, well before the end
        duplicates.append(long.delay(kid, 0))
        time.sleep(0.4)
    token = first.get(timeout=RESULT_TIMEOUT)
    values = [d.get(timeout=RESULT_TIMEOUT) for d in duplicates]
    assert all(is_skipped(v) for v in values), values
    assert {v["holder"]["token"] for v in values} == {token}  # one lease, renewed
    found = runs(env.db_url, kid)
    assert len(found) == 1 and found[0].task_id == first.id


def test_a_retried_task_keeps_its_lock_across_retries(env: Env) -> None:
    retrying = env.task("tg.retrying")
    kid = key_id(env, "retry")
    first = retrying.delay(kid, 2)
    wait_for(started(env, kid), 30, "the first attempt")
    duplicates = []
    while not first.ready():
        duplicates.append(retrying.delay(kid, 0))
        time.sleep(0.25)
    token = first.get(timeout=RESULT_TIMEOUT)
    attempts = [r for r in runs(env.db_url, kid) if r.task_id == first.id]
    assert [a.retries for a in attempts] == [0, 1, 2]
    assert {a.token for a in attempts} == {token}  # the same lease for every retry
    last_end = attempts[-1].ended_at
    for dup in duplicates:
        value = dup.get(timeout=RESULT_TIMEOUT)
        if not is_skipped(value):  # only possible once the retried task had finished
            run = next(r for r in runs(env.db_url, kid) if r.task_id == dup.id)
            assert last_end is not None and run.started_at >= last_end
    assert_no_overlap(runs(env.db_url, kid))


def test_retry_on_conflict_runs_once_the_holder_finished(env: Env) -> None:
    kid = key_id(env, "patient")
    first = env.task("tg.slow").delay(kid, 1.5)
    wait_for(started(env, kid), 30, "the holder to start")
    patient = env.task("tg.patient").delay(kid)
    assert not is_skipped(patient.get(timeout=RESULT_TIMEOUT))  # deferred, never dropped
    first.get(timeout=RESULT_TIMEOUT)
    found = runs(env.db_url, kid)
    assert [r.task_id for r in found] == [first.id, patient.id]  # ran once, after the holder
    assert_no_overlap(found)
    assert found[1].retries >= 1  # it was re-scheduled, counted as a retry
    log = env.worker.log_text()
    assert f"retrying tg.patient[{patient.id}] in " in log  # the core's line (runs.py)


def test_the_key_is_free_once_the_result_is_ready_and_for_the_next_link(env: Env) -> None:
    # The run releases before Celery stores its result or sends a chain's next link:
    # whoever reads the result, and the next link of one key, finds the key free.
    # (This ordering is why the release stays on the run's own path; see
    # docs/evidence/benchmarks.md.)
    slow = env.task("tg.slow")
    kid = key_id(env, "order")
    for _ in range(10):
        token = slow.delay(kid, 0).get(timeout=RESULT_TIMEOUT)
        assert not is_skipped(token)
        info = env.guard.get(f"slow:{kid}")
        assert info is not None and info.token == token and not info.held
        following = slow.delay(kid, 0).get(timeout=RESULT_TIMEOUT)
        assert not is_skipped(following) and following > token
    last = chain(*(slow.si(kid, 0) for _ in range(5))).apply_async()
    links: list[Any] = []
    node: Any = last
    while node is not None:
        links.insert(0, node)
        node = node.parent
    values = [link.get(timeout=RESULT_TIMEOUT) for link in links]
    assert len(values) == 5 and not any(is_skipped(v) for v in values)
    assert values == sorted(values)  # each link took the key after the one before
    found = runs(env.db_url, kid)
    assert len(found) == 25
    assert_no_overlap(found)


def test_redelivery_of_the_same_task_id_waits_for_the_first_copy(env: Env) -> None:
    # Issue 16 item 1 changed this test's expectation on purpose: it used to assert
    # that both deliveries ran, one after the other. A second delivery of a task id
    # waits for the first copy (never overlapping it) and, once that copy finished,
    # is dropped instead of running the body again.
    kid = key_id(env, "redeliver")
    task_id = uuid.uuid4().hex
    # send_task bypasses apply_async (no header): the worker derives the key itself,
    # as for beat. The second message is what a broker redelivery looks like.
    env.app.send_task("tg.slow", (kid, 1.0), task_id=task_id)
    env.app.send_task("tg.slow", (kid, 1.0), task_id=task_id)
    env.worker.wait_for_log(f"dropped a late copy of finished tg.slow[{task_id}]", 30)
    found = runs(env.db_url, kid)
    assert [r.task_id for r in found] == [task_id]
    assert found[0].ended_at is not None
    assert "another delivery of this task id" in env.worker.log_text()


def test_a_redelivered_hand_off_waits_for_the_copy_that_adopted_it(env: Env) -> None:
    # queue_and_run: the message carries the publisher's lease. A second delivery of
    # that very message (same task id, same header) while the first copy runs must
    # not adopt it too: adopting passes the lease to the run's own owner id.
    queued = env.task("tg.queued")  # queue_and_run, ttl 3 s, on_conflict="raise"
    kid = key_id(env, "redeliver-handover")
    sent: list[Any] = []

    def keep_header(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("task") == "tg.queued" and HEADER in headers:
            sent.append(headers[HEADER])

    before_task_publish.connect(keep_header, weak=False)
    try:
        first = queued.apply_async((kid, 1.5))
    finally:
        before_task_publish.disconnect(keep_header)
    handed = Header.of_string(sent[0]).lease
    assert handed is not None
    carried = Handed.of(handed).owner
    wait_for(started(env, kid), 30, "the first copy to start")
    adopted = env.guard.get(f"queued:{kid}")
    assert adopted is not None and adopted.held and adopted.owner != carried
    assert adopted.holder.task_id == first.id and adopted.holder.hostname != env.guard.hostname
    env.app.send_task("tg.queued", (kid, 1.5), task_id=first.id, headers={HEADER: sent[0]})
    env.worker.wait_for_log(f"dropped a late copy of finished tg.queued[{first.id}]", 30)
    assert first.get(timeout=RESULT_TIMEOUT) is not None
    found = runs(env.db_url, kid)
    assert [r.task_id for r in found] == [first.id] and found[0].ended_at is not None
    assert "another delivery of this task id" in env.worker.log_text()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
def test_revoke_terminate_releases_at_once(env: Env, signame: str) -> None:
    # SIGTERM: billiard unwinds the child and the run's finally releases.
    # SIGKILL: no finally runs; the worker's main process releases.
    sleeper = env.task("tg.sleeper")  # ttl 30 s
    kid = key_id(env, f"revoke-{signame}")
    first = sleeper.delay(kid, 30)
    wait_for(started(env, kid), 30, "the sleeper to start")
    env.app.control.revoke(first.id, terminate=True, signal=signame)
    t0 = time.monotonic()
    wait_for(lambda: not env.guard.get(f"sleeper:{kid}").held, 15, "the lock to be released")  # type: ignore[union-attr]
    assert time.monotonic() - t0 < 15 < 30  # not by expiry
    assert not is_skipped(sleeper.delay(kid, 0).get(timeout=RESULT_TIMEOUT))
    assert runs(env.db_url, kid)[0].ended_at is None  # it really was stopped mid-run
    if signame == "SIGKILL":
        env.worker.wait_for_log(f"sleeper:{kid}' held by tg.sleeper[{first.id}]", 10)


def test_revoked_before_start_gives_back_the_queue_lease(env: Env) -> None:
    queued = env.task("tg.queued")  # queue_and_run, ttl 3 s
    kid = key_id(env, "unstarted")
    result = queued.apply_async((kid,), countdown=3)  # queue lease: 3 s + 3 s
    lease = env.guard.get(f"queued:{kid}")
    assert lease is not None and lease.held and lease.holder.task_id == result.id
    env.app.control.revoke(result.id)  # discarded when it comes due, never run
    wait_for(lambda: not env.guard.get(f"queued:{kid}").held, 20, "the lease to be given back")  # type: ignore[union-attr]
    freed = env.guard.get(f"queued:{kid}")
    assert freed is not None and freed.read_at < lease.expires_at  # released, not expired
    env.worker.wait_for_log(f"released lock 'queued:{kid}' of revoked", 10)
    assert runs(env.db_url, kid) == []


def test_hard_time_limit_releases_the_lock(env: Env) -> None:
    # tg.sleeper unwinds on billiard's SIGTERM (its finally releases); tg.stubborn
    # swallows it, is SIGKILLed, and the worker's main process releases for it.
    kids = {name: key_id(env, f"hardlimit-{name}") for name in ("sleeper", "stubborn")}
    results = {
        name: env.task(f"tg.{name}").apply_async((kid, 30), time_limit=1.0)
        for name, kid in kids.items()
    }
    for name, kid in kids.items():
        wait_for(started(env, kid), 30, f"{name} to start")
        wait_for(lambda: not env.guard.get(f"{name}:{kid}").held, 20, f"{name}'s lock to go")  # type: ignore[union-attr]  # noqa: B023
        results[name].get(timeout=RESULT_TIMEOUT, propagate=False)
        assert results[name].state == "FAILURE"
    env.worker.wait_for_log("hard time limit (1.0s) exceeded", 10)
    line = next(x for x in env.worker.log_text().splitlines() if "hard time limit (1.0s)" in x)
    assert f"stubborn:{kids['stubborn']}" in line


def test_soft_time_limit_releases_the_lock(env: Env) -> None:
    sleeper = env.task("tg.sleeper")  # ttl 30 s
    kid = key_id(env, "softlimit")
    first = sleeper.apply_async((kid, 30), soft_time_limit=0.5)
    first.get(timeout=RESULT_TIMEOUT, propagate=False)
    assert first.state == "FAILURE" and "SoftTimeLimitExceeded" in repr(first.result)
    info = env.guard.get(f"sleeper:{kid}")
    assert info is not None and not info.held  # released by the run's finally


# -- a killed worker ---------------------------------------------------------------------


def test_sigkilled_worker_lock_frees_after_the_ttl(worker_db: str) -> None:
    # RabbitMQ redelivers the killed worker's unacked (acks_late) message: the same
    # task id, which must run only once the dead copy's lease has expired.
    broker = AMQP_URL
    queue = unique_queue("tg-kill")
    app = make_app(broker, RESULT_BACKEND, queue, worker_db)
    guard = TaskGuard(worker_db)
    kid = f"kill-{uuid.uuid4().hex[:6]}"
    short = app.tasks["tg.short_ttl"]  # ttl 2 s, acks_late
    try:
        # purge=False: the redelivered message must survive between the two workers.
        with start_worker("tg_worker_app", broker, worker_db, 2, queue=queue, purge=False) as w1:
            first = short.delay(kid, 60)
            wait_for(lambda: runs(worker_db, kid), 30, "the run to start")
            w1.kill()
            killed_at = time.monotonic()
            info = guard.get(f"short:{kid}")
            assert info is not None and info.held  # no hook ran: still held
            wait_for(lambda: not guard.get(f"short:{kid}").held, 10, "the lease to expire")  # type: ignore[union-attr]
            assert time.monotonic() - killed_at <= 2 + 4  # ttl plus generous slack
        with start_worker(
            "tg_worker_app",
            broker,
            worker_db,
            2,
            queue=queue,
            result_backend=RESULT_BACKEND,
            purge=False,
        ):
            wait_for(lambda: len(runs(worker_db, kid)) == 2, 30, "the redelivery to run")
            value = short.delay(kid, 0).get(timeout=RESULT_TIMEOUT)
            assert not is_skipped(value)
        found = runs(worker_db, kid)
        assert [r.task_id for r in found[:2]] == [first.id, first.id]
        assert found[0].ended_at is None  # killed
        assert found[1].started_at >= info.expires_at  # the redelivery waited for expiry
        assert len(found) == 3 and found[2].ended_at is not None
    finally:
        purge_queue(broker, queue, delete=True)
        guard.dispose()
        app.close()
        reset_guards()
