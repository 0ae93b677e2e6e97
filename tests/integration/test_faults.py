"""Connection faults around COMMIT (issue #7, item 7).

A loopback proxy we control (tests/harness/proxy.py) sits between the guard
and the shared PostgreSQL server and cuts a chosen statement before the server
sees it, after it committed, or after it committed with the server unreachable
for the read-back. ``pg_terminate_backend`` kills a backend mid-statement. The
client must never assume: it reports what the database says, or OutcomeUnknown.
A guarded task whose lock cannot be established does not run (fail closed).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from celery import Celery
from conftest import drop_pg_database, new_pg_database
from sqlalchemy.engine import make_url

from scripts.chaoslib.faults import MODES, OPS, fault_round
from taskguard import (
    DatabaseUnavailable,
    InvalidKey,
    InvalidTTL,
    OutcomeUnknown,
    TaskGuard,
    current_lease,
    guarded_task,
)
from taskguard.config import reset_guards
from tests.harness.proxy import FaultProxy


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def proxy(pg_url: str) -> Iterator[FaultProxy]:
    port = make_url(pg_url).port or 5432
    with FaultProxy(port) as p:
        yield p


@pytest.fixture
def proxied_url(pg_url: str, proxy: FaultProxy) -> str:
    return make_url(pg_url).set(port=proxy.port).render_as_string(hide_password=False)


@pytest.fixture
def proxied(proxied_url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(proxied_url)
    g.db_now()  # one connection past start-up, so the first cut hits a statement
    yield g
    g.dispose()


def _case(op: str, mode: str) -> Any:
    return pytest.param(op, mode)


@pytest.mark.parametrize(("op", "mode"), [_case(op, mode) for op in OPS for mode in MODES])
def test_cut_connection_reports_true_outcome(
    op: str, mode: str, proxied: TaskGuard, pg_guard: TaskGuard, proxy: FaultProxy
) -> None:
    outcome = fault_round(proxied, pg_guard, proxy, op, mode)
    fired = proxy.fired["partition" if mode == "partition" else mode]
    assert fired == 1, "the proxy did not cut the statement"
    assert outcome.correct, outcome


def test_terminated_backend_mid_acquire_is_read_back_then_retried(
    pg_url: str, pg_guard: TaskGuard
) -> None:
    """pg_terminate_backend while the acquire waits on a row lock: the statement
    never committed; the client reads back by owner, finds nothing, retries."""
    old = pg_guard.acquire("term", 0.05)
    assert old is not None
    time.sleep(0.1)
    blocker = psycopg.connect(_libpq(pg_url))
    blocker.execute("SELECT 1 FROM task_locks WHERE key = 'term' FOR UPDATE")
    victim = TaskGuard(pg_url)
    result: dict[str, Any] = {}

    def attempt() -> None:
        try:
            result["lease"] = victim.acquire("term", 30)
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=attempt)
    thread.start()
    try:
        with psycopg.connect(_libpq(pg_url), autocommit=True) as admin:
            pid = None
            for _ in range(200):
                row = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO task_locks%' "
                    "AND pid <> pg_backend_pid()"
                ).fetchone()
                if row:
                    pid = row[0]
                    break
                time.sleep(0.02)
            assert pid is not None, "the acquire never blocked on the row lock"
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            time.sleep(0.2)
    finally:
        blocker.commit()
        blocker.close()
        thread.join(30)
        victim.dispose()
    lease = result.get("lease")
    assert lease is not None, result
    info = pg_guard.get("term")
    assert info is not None and info.held
    assert (info.owner, info.token) == (lease.owner, lease.token)
    assert lease.token > old.token


def test_stale_pool_after_server_drops_connections(pg_url: str, pg_guard: TaskGuard) -> None:
    guard = TaskGuard(pg_url)
    leases = []
    barrier = threading.Barrier(6)

    def take(i: int) -> None:
        barrier.wait()
        leases.append(guard.acquire(f"pool:{i}", 60))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Idle connections in the pool for the server to drop. The finished threads'
    # pinned connections go back to it when their thread-locals are cleared; in two
    # full-suite runs of five only 2 of them had, even after 5 s; top it up by hand.
    extra = [guard.engine.raw_connection() for _ in range(3)]
    for conn in extra:
        conn.close()
    assert guard.engine.pool.checkedin() >= 3  # type: ignore[attr-defined]
    with psycopg.connect(_libpq(pg_url), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    try:
        results = [guard.release(lease) for lease in leases if lease is not None]
    finally:
        guard.dispose()
    assert results == [True] * 6


def test_failed_retry_after_read_back_is_reported_as_unknown(
    proxied: TaskGuard, pg_guard: TaskGuard, proxy: FaultProxy
) -> None:
    proxy.arm("before", b"tn-retry-cut")
    proxy.arm("after", b"tn-retry-cut")
    try:
        lease = proxied.acquire("retry-cut", 30, task_name="tn-retry-cut")
    except OutcomeUnknown as exc:
        info = pg_guard.get("retry-cut")
        assert info is not None and info.owner == exc.owner
        return
    except DatabaseUnavailable:
        info = pg_guard.get("retry-cut")
        # Plain "unavailable" is only truthful if nothing was granted.
        assert info is None or not info.held
        return
    info = pg_guard.get("retry-cut")
    assert info is not None and lease is not None and info.owner == lease.owner


# -- @guarded_task fails closed ----------------------------------------------------------


@pytest.fixture
def app(proxied_url: str) -> Iterator[Celery]:
    app = Celery("tg_faults", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=False, taskguard_database_url=proxied_url
    )
    yield app
    reset_guards()


def _task(app: Celery, ran: list[Any]) -> Any:
    @guarded_task(app=app, shared=False, key="feed:{feed}", ttl=30, name="faults.fetch")
    def fetch(feed: str) -> str:
        lease = current_lease()
        ran.append(lease)
        return "ran"

    return fetch


def test_guarded_task_does_not_run_when_lock_db_unreachable(
    app: Celery, proxy: FaultProxy, pg_guard: TaskGuard
) -> None:
    ran: list[Any] = []
    fetch = _task(app, ran)
    proxy.refuse = True
    proxy.cut_all()
    result = fetch.apply(args=("a",))
    assert ran == []
    assert result.failed()
    assert isinstance(result.result, DatabaseUnavailable)
    assert str(proxy.port) in str(result.result)  # names the database it could not reach
    assert pg_guard.get("feed:a") is None


def test_guarded_task_does_not_run_when_acquire_outcome_unknown(
    app: Celery, proxy: FaultProxy, pg_guard: TaskGuard
) -> None:
    ran: list[Any] = []
    fetch = _task(app, ran)
    proxy.arm("partition", b"feed:b")
    result = fetch.apply(args=("b",))
    assert ran == []
    assert result.failed() and isinstance(result.result, OutcomeUnknown)
    message = str(result.result)
    assert "feed:b" in message and "could not be read back" in message
    # The grant did commit: the client never assumed either way, and says which
    # owner may hold the key.
    info = pg_guard.get("feed:b")
    assert info is not None and info.owner in message


def test_outcome_unknown_keeps_its_type_through_celery(app: Celery, proxy: FaultProxy) -> None:
    for exc in (
        OutcomeUnknown("m", "k", "o", "u"),
        InvalidKey("m", "k"),
        InvalidTTL("m", -1),
    ):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and vars(back) == vars(exc)
    fetch = _task(app, [])
    proxy.arm("partition", b"feed:d")
    result = fetch.apply(args=("d",))
    assert isinstance(result.result, OutcomeUnknown) and result.result.key == "feed:d"


@pytest.mark.parametrize("mode", ["before", "after"])
def test_guarded_task_runs_once_with_its_lock_after_a_cut(
    mode: str, app: Celery, proxy: FaultProxy, pg_guard: TaskGuard
) -> None:
    ran: list[Any] = []
    fetch = _task(app, ran)
    proxy.arm(mode, b"feed:c")
    result = fetch.apply(args=("c",))
    assert result.successful() and result.result == "ran"
    assert proxy.fired[mode] == 1
    assert len(ran) == 1 and ran[0] is not None
    info = pg_guard.get("feed:c")
    # The body ran under the lease the database granted, released on the way out.
    assert info is not None and info.owner == ran[0].owner and not info.held


# -- issue 28 D: a run that cannot reach the lock database is tried again ------------------


@dataclass
class OutageEnv:
    app: Celery
    proxy: FaultProxy
    guard: TaskGuard  # direct


@pytest.fixture(scope="module")
def outage_env(pg_template: str) -> Iterator[OutageEnv]:
    """An in-process worker (threads) on an in-memory broker, shared by the module's
    outage tests; the lock database is reached through the proxy."""
    from celery.contrib.testing.worker import start_worker as start_test_worker

    url = new_pg_database(pg_template)
    port = make_url(url).port or 5432
    app = Celery("tg_outage", broker="memory://", backend="cache+memory://", set_as_current=False)
    try:
        with FaultProxy(port) as proxy:
            proxied = make_url(url).set(port=proxy.port).render_as_string(hide_password=False)
            app.conf.update(
                taskguard_database_url=proxied,
                taskguard_outage_retry_for=3.0,
                # The memory:// broker is one per process: a queue of its own, so this
                # worker (which Celery 5.3's test helper may leave consuming after the
                # module) never takes another test's messages.
                task_default_queue=f"tg-outage-{os.getpid()}",
            )
            app.ran = []  # type: ignore[attr-defined]
            app.tokens = []  # type: ignore[attr-defined]

            @guarded_task(app=app, shared=False, key="out:{k}", ttl=30, name="outage.fetch")
            def fetch(k: str, fail_inside: bool = False) -> str:
                app.ran.append(k)  # type: ignore[attr-defined]
                app.tokens.append(current_lease().token)  # type: ignore[attr-defined, union-attr]
                if fail_inside:  # the body's own error: never run again for it
                    raise DatabaseUnavailable("the body's own database is down")
                return "ran"

            @guarded_task(
                app=app, shared=False, key="rated:{k}", ttl=30, rate="100/1s", name="outage.rated"
            )
            def rated(k: str) -> str:
                app.ran.append(k)  # type: ignore[attr-defined]
                app.tokens.append(current_lease().token)  # type: ignore[attr-defined, union-attr]
                return "ran"

            @guarded_task(
                app=app,
                shared=False,
                key="qr:{k}",
                ttl=30,
                lock="queue_and_run",
                name="outage.queued",
            )
            def queued(k: str) -> str:
                app.ran.append(k)  # type: ignore[attr-defined]
                app.tokens.append(current_lease().token)  # type: ignore[attr-defined, union-attr]
                return "ran"

            @guarded_task(
                app=app, shared=False, key="qo:{k}", ttl=30, lock="queue", name="outage.queue"
            )
            def queue_only(k: str) -> str:
                app.ran.append(k)  # type: ignore[attr-defined]
                return "ran"

            guard = TaskGuard(url)
            # Celery's test worker sets the root logger to ERROR for the whole process:
            # later tests in this process would see no warning (caplog) otherwise.
            root_level = logging.root.level
            try:
                with start_test_worker(
                    app, pool="threads", concurrency=2, perform_ping_check=False
                ):
                    yield OutageEnv(app, proxy, guard)
            finally:
                logging.root.setLevel(root_level)
                guard.dispose()
    finally:
        reset_guards()
        drop_pg_database(url)


@pytest.fixture
def worker_app(outage_env: OutageEnv) -> Iterator[Celery]:
    outage_env.app.ran.clear()  # type: ignore[attr-defined]
    outage_env.app.tokens.clear()  # type: ignore[attr-defined]
    outage_env.proxy.refuse = False
    yield outage_env.app
    outage_env.proxy.refuse = False


def _deferrals() -> tuple[list[float], Any]:
    from taskguard.signals import run_deferred

    seen: list[float] = []

    def receiver(sender: Any = None, reason: str = "", countdown: float = 0, **_: Any) -> None:
        if reason == "outage":
            seen.append(countdown)

    run_deferred.connect(receiver, weak=False, dispatch_uid="test-outage")
    return seen, lambda: run_deferred.disconnect(dispatch_uid="test-outage")


def test_a_run_delivered_during_an_outage_runs_once_the_database_is_back(
    worker_app: Celery, outage_env: OutageEnv
) -> None:
    """Issue 28 D: deliveries during a database outage ended FAILURE DatabaseUnavailable
    with no retry. They are published again with a backoff and run, locked, after it."""
    proxy = outage_env.proxy
    seen, disconnect = _deferrals()
    proxy.refuse = True
    proxy.cut_all()
    try:
        result = worker_app.tasks["outage.fetch"].apply_async(("a",))
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen, "the run was not deferred"
        assert worker_app.ran == []  # type: ignore[attr-defined]
        time.sleep(0.5)
        proxy.refuse = False
        assert result.get(timeout=20) == "ran"
    finally:
        disconnect()
    assert worker_app.ran == ["a"]  # type: ignore[attr-defined]
    info = outage_env.guard.get("out:a")
    assert info is not None and not info.held  # it ran under its lease, released after


def test_an_outage_longer_than_the_bound_fails_visibly(
    worker_app: Celery, outage_env: OutageEnv, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = outage_env.proxy
    seen, disconnect = _deferrals()
    proxy.refuse = True
    proxy.cut_all()
    t0 = time.monotonic()
    try:
        result = worker_app.tasks["outage.fetch"].apply_async(("b",))
        with pytest.raises(DatabaseUnavailable):
            result.get(timeout=30)
    finally:
        disconnect()
    took = time.monotonic() - t0
    assert 3.0 <= took < 3.0 + 10, took  # taskguard_outage_retry_for = 3
    assert len(seen) >= 2 and all(c <= 3.0 for c in seen), seen
    assert worker_app.ran == []  # type: ignore[attr-defined]
    assert "giving up on outage.fetch" in caplog.text


def test_a_body_that_started_is_not_run_again_for_an_outage(worker_app: Celery) -> None:
    seen, disconnect = _deferrals()
    try:
        result = worker_app.tasks["outage.fetch"].apply_async(("c",), {"fail_inside": True})
        with pytest.raises(DatabaseUnavailable, match="the body's own"):
            result.get(timeout=20)
    finally:
        disconnect()
    assert worker_app.ran == ["c"] and seen == []  # type: ignore[attr-defined]


def _cut_next(proxy: FaultProxy, pattern: bytes, then: Callable[[], Any] = lambda: None) -> Any:
    """Cut the proxied connection at the next statement that names ``pattern`` (after
    forwarding it: its answer is lost), call ``then()`` and wait until the cut came;
    ``then()``'s value."""
    fired = proxy.fired["partition"]
    proxy.arm("partition", pattern)
    value = then()
    deadline = time.monotonic() + 10
    while proxy.fired["partition"] == fired and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def _copy_runs_adopting(proxy: FaultProxy, result: Any, app: Celery, token: int) -> None:
    """The database answers again: the deferred copy runs within 10 s (not after the
    lease's 30 s ttl), under the lease it adopted (same token)."""
    proxy.refuse = False
    t0 = time.monotonic()
    assert result.get(timeout=20) == "ran"
    assert time.monotonic() - t0 < 10
    assert app.tokens == [token]  # type: ignore[attr-defined]


def test_a_deferred_run_adopts_the_lease_its_unknown_acquire_took(
    worker_app: Celery, outage_env: OutageEnv
) -> None:
    """The acquire committed but its answer was lost and could not be read back
    (OutcomeUnknown): the deferred copy adopts that lease (same token) instead of
    finding the key held by its own task id until the ttl (30 s) runs out."""
    proxy = outage_env.proxy
    result = _cut_next(proxy, b"out:u", lambda: worker_app.tasks["outage.fetch"].delay("u"))
    time.sleep(0.3)
    orphan = outage_env.guard.get("out:u")
    assert orphan is not None and orphan.held, "the cut acquire did not commit"
    _copy_runs_adopting(proxy, result, worker_app, orphan.token)


def test_an_outage_after_the_acquire_hands_the_lease_to_the_deferred_copy(
    worker_app: Celery, outage_env: OutageEnv
) -> None:
    """With rate=, the start is counted after the key's lease was taken; the
    connection breaks there: the deferred copy adopts the run's lease (same token)
    instead of finding the key held by its own task id until the ttl (30 s)."""
    proxy = outage_env.proxy
    rated = worker_app.tasks["outage.rated"]
    result = _cut_next(proxy, b"rated:r#rate", lambda: rated.delay("r"))
    time.sleep(0.3)
    taken = outage_env.guard.get("rated:r")
    assert taken is not None and taken.held, "the run's lease was not taken"
    _copy_runs_adopting(proxy, result, worker_app, taken.token)
    assert worker_app.ran == ["r"]  # type: ignore[attr-defined]


def test_a_deferred_run_adopts_a_hand_off_whose_outcome_was_unknown(
    worker_app: Celery, outage_env: OutageEnv
) -> None:
    """lock="queue_and_run": the worker's adoption of the queued lease committed but
    its answer was lost (OutcomeUnknown). The deferred copy adopts the lease under
    the owner id the adoption gave it (same token), instead of finding the key held
    by its own task id until the ttl (30 s)."""
    proxy = outage_env.proxy
    result = worker_app.tasks["outage.queued"].apply_async(("q",), countdown=1)
    queued = outage_env.guard.get("qr:q")
    assert queued is not None and queued.held
    _cut_next(proxy, b"qr:q")  # at the worker's adoption
    time.sleep(0.3)
    adopted = outage_env.guard.get("qr:q")
    assert adopted is not None and adopted.held and adopted.owner != queued.owner, adopted
    _copy_runs_adopting(proxy, result, worker_app, queued.token)
    assert worker_app.ran == ["q"]  # type: ignore[attr-defined]


def test_a_deferred_copy_revoked_in_its_countdown_gives_its_lease_back(
    worker_app: Celery, outage_env: OutageEnv
) -> None:
    """The copy of a run whose acquire's outcome was unknown carries the lease that
    acquire may have taken; revoked while it waits out its countdown, it releases
    that lease (the lease in its header used to be partial: nothing was released
    and the key stayed taken until its 30 s ttl)."""
    proxy = outage_env.proxy
    result = _cut_next(proxy, b"out:v", lambda: worker_app.tasks["outage.fetch"].delay("v"))
    worker_app.control.revoke(result.id)
    time.sleep(0.3)
    orphan = outage_env.guard.get("out:v")
    assert orphan is not None and orphan.held, "the cut acquire did not commit"
    proxy.refuse = False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = outage_env.guard.get("out:v")
        if info is not None and not info.held:
            break
        time.sleep(0.1)
    assert info is not None and not info.held, "the revoked copy kept the lease"
    assert worker_app.ran == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("lock", "task", "prefix"),
    [
        ("run", "outage.fetch", "out"),
        ("queue", "outage.queue", "qo"),
        ("queue_and_run", "outage.queued", "qr"),
    ],
)
def test_a_run_that_gives_up_on_an_outage_leaves_its_key_free(
    worker_app: Celery, outage_env: OutageEnv, lock: str, task: str, prefix: str
) -> None:
    """Issue 33, defect 10: a run that gave up after taskguard_outage_retry_for (3 s)
    ends FAILURE, and once the database answers again its key is free: a queue
    phase's lease (taken at enqueue, 30 s) used to stay held by the failed task id
    until it expired, and new calls were skipped against it."""
    proxy = outage_env.proxy
    k = f"gave-up-{lock}"
    result = worker_app.tasks[task].apply_async((k,), countdown=0.5)  # the lease is taken
    proxy.refuse = True
    proxy.cut_all()
    try:
        with pytest.raises(DatabaseUnavailable):
            result.get(timeout=30)
    finally:
        proxy.refuse = False
    deadline = time.monotonic() + 10  # well before the 30 s lease would expire
    info = outage_env.guard.get(f"{prefix}:{k}")
    while info is not None and info.held and time.monotonic() < deadline:
        time.sleep(0.1)
        info = outage_env.guard.get(f"{prefix}:{k}")
    assert info is None or not info.held, f"the failed run still holds its key: {info}"
    assert worker_app.tasks[task].delay(k).get(timeout=20) == "ran"
    assert worker_app.ran == [k]  # type: ignore[attr-defined]
