"""@guarded_task in one process: eager mode (task_always_eager), .apply(), direct
calls, conflict strategies at enqueue and at run, release on every way out,
retries keeping the lease, renewal and lost leases. Real PostgreSQL, no mocks."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject

from taskguard import (
    AlreadyLocked,
    LeaseLost,
    TaskGuard,
    TaskGuardError,
    check_lease,
    current_lease,
    guarded_task,
    held_lease,
    is_skipped,
    signals,
)
from taskguard.config import reset_guards


@pytest.fixture
def app(pg_url: str) -> Iterator[Celery]:
    app = Celery("tg_eager", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        task_eager_propagates=False,
        taskguard_database_url=pg_url,
    )
    yield app
    reset_guards()


@pytest.fixture
def guard(pg_url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(pg_url)
    yield g
    g.dispose()


class Recorder:
    """Collects taskguard signals sent during a test."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._receivers = []
        for name in ("lock_acquired", "lock_conflict", "lock_released", "lease_lost"):
            sig = getattr(signals, name)

            def receiver(sender: Any = None, _name: str = name, **kw: Any) -> None:
                self.events.append((_name, kw))

            sig.connect(receiver, weak=False)
            self._receivers.append((sig, receiver))

    def of(self, name: str) -> list[dict[str, Any]]:
        return [kw for n, kw in self.events if n == name]

    def close(self) -> None:
        for sig, receiver in self._receivers:
            sig.disconnect(receiver)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    yield rec
    rec.close()


# -- run phase -----------------------------------------------------------------------


def test_runs_with_a_lease_and_releases_it(
    app: Celery, guard: TaskGuard, recorder: Recorder
) -> None:
    seen: list[Any] = []

    @guarded_task(app=app, shared=False, key="feed:{url}", ttl=5)
    def fetch(url: str) -> str:
        lease = current_lease()
        assert lease is not None
        seen.append((lease.key, lease.token, guard.get(lease.key).held))  # type: ignore[union-attr]
        return url.upper()

    assert fetch.delay("a").get() == "A"
    assert seen[0][0] == "feed:a" and seen[0][2] is True
    info = guard.get("feed:a")
    assert info is not None and not info.held
    assert [e["key"] for e in recorder.of("lock_acquired")] == ["feed:a"]
    released = recorder.of("lock_released")
    assert len(released) == 1 and released[0]["released"] is True
    assert current_lease() is None  # outside the run


def test_skip_returns_a_marker_and_logs_the_holder(
    app: Celery, guard: TaskGuard, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []

    @guarded_task(app=app, shared=False, key="feed:{url}", ttl=5)
    def fetch(url: str) -> None:
        ran.append(url)

    caplog.set_level(logging.WARNING, logger="taskguard.celery")
    with guard.lock("feed:a", 10, task_name="holder.task", task_id="holder-id") as held:
        result = fetch.delay("a")
    value = result.get()
    assert ran == [] and result.state == "SUCCESS"
    assert is_skipped(value) and not is_skipped(None) and not is_skipped({"x": 1})
    assert value["key"] == "feed:a" and value["phase"] == "run"
    assert value["task_id"] == result.id and value["holder"]["task_id"] == "holder-id"
    assert value["holder"]["token"] == held.token
    record = next(r for r in caplog.records if "skipped" in r.getMessage())
    assert record.levelno == logging.WARNING
    assert "'feed:a'" in record.getMessage() and "holder-id" in record.getMessage()
    assert held.expires_at.isoformat() in record.getMessage()
    conflict = recorder.of("lock_conflict")
    assert conflict[0]["action"] == "skip" and conflict[0]["holder"].owner == held.owner


def test_raise_fails_the_run_with_already_locked(app: Celery, guard: TaskGuard) -> None:
    @guarded_task(app=app, shared=False, key="k", ttl=5, on_conflict="raise")
    def job() -> None: ...

    with guard.lock("k", 10, task_id="holder-id"):
        result = job.delay()
        assert result.state == "FAILURE"
        assert isinstance(result.result, AlreadyLocked)
        assert result.result.holder.holder.task_id == "holder-id"
        app.conf.task_eager_propagates = True
        with pytest.raises(AlreadyLocked):
            job.delay()


def test_retry_on_conflict_counts_against_max_retries(
    app: Celery, guard: TaskGuard, recorder: Recorder
) -> None:
    @guarded_task(app=app, shared=False, key="k", ttl=5, on_conflict="retry", max_retries=2)
    def job() -> None: ...

    with guard.lock("k", 10):
        result = job.delay()
    # eager retries run at once: 1 try + 2 retries, then the AlreadyLocked surfaces
    assert result.state == "FAILURE" and isinstance(result.result, AlreadyLocked)
    assert [e["action"] for e in recorder.of("lock_conflict")] == ["retry"] * 3


@pytest.mark.parametrize("outcome", ["exception", "reject", "ignore", "retry-exhausted"])
def test_every_way_out_releases_exactly_once(
    app: Celery, guard: TaskGuard, recorder: Recorder, outcome: str
) -> None:
    @guarded_task(app=app, shared=False, key="k", ttl=5, bind=True, max_retries=0)
    def job(self: Any) -> None:
        if outcome == "exception":
            raise ValueError("boom")
        if outcome == "reject":
            raise Reject("no", requeue=False)
        if outcome == "ignore":
            raise Ignore()
        raise self.retry(countdown=0)

    job.delay()
    info = guard.get("k")
    assert info is not None and not info.held
    released = recorder.of("lock_released")
    assert len(released) == 1 and released[0]["released"] is True


def test_retry_keeps_the_lease_for_the_retried_run(
    app: Celery, guard: TaskGuard, recorder: Recorder
) -> None:
    tokens: list[int] = []

    @guarded_task(app=app, shared=False, key="k", ttl=5, bind=True, max_retries=3)
    def job(self: Any) -> int:
        lease = current_lease()
        assert lease is not None
        tokens.append(lease.token)
        if self.request.retries < 2:
            raise self.retry(countdown=0)
        return self.request.retries

    assert job.delay().get() == 2
    assert len(tokens) == 3 and len(set(tokens)) == 1  # one lease across all runs
    assert len(recorder.of("lock_released")) == 1
    info = guard.get("k")
    assert info is not None and not info.held
    # the hand-over companion row is gone too
    assert [i.key for i in guard.held(companions=True)] == []


def test_queue_and_run_retries_keep_the_enqueue_lease(app: Celery, guard: TaskGuard) -> None:
    tokens: list[int] = []

    @guarded_task(
        app=app, shared=False, key="k", ttl=5, lock="queue_and_run", bind=True, max_retries=3
    )
    def job(self: Any) -> None:
        tokens.append(current_lease().token)  # type: ignore[union-attr]
        if self.request.retries < 2:
            raise self.retry(countdown=0)

    job.delay()
    assert len(tokens) == 3 and len(set(tokens)) == 1
    assert guard.held(companions=True) == []  # the lease and every hand-over claim row are gone


def test_autoretry_keeps_the_lease(app: Celery, recorder: Recorder) -> None:
    tokens: list[int] = []

    @guarded_task(
        app=app,
        shared=False,
        key="k",
        ttl=5,
        autoretry_for=(KeyError,),
        max_retries=2,
        retry_backoff=False,
    )
    def job() -> None:
        lease = current_lease()
        assert lease is not None
        tokens.append(lease.token)
        raise KeyError("again")

    result = job.delay()
    assert result.state == "FAILURE" and isinstance(result.result, KeyError)
    assert len(tokens) == 3 and len(set(tokens)) == 1
    assert len(recorder.of("lock_released")) == 1


def test_key_is_computed_once_per_submission(app: Celery) -> None:
    calls: list[str] = []

    def key(url: str) -> str:
        calls.append(url)
        return f"feed:{url}"

    @guarded_task(app=app, shared=False, key=key, ttl=5)
    def fetch(url: str) -> str:
        return current_lease().key  # type: ignore[union-attr]

    assert fetch.delay("a").get() == "feed:a"
    assert calls == ["a"]


def test_apply_is_guarded_and_a_direct_call_is_not(app: Celery, guard: TaskGuard) -> None:
    @guarded_task(app=app, shared=False, key="k", ttl=5)
    def job() -> Any:
        lease = current_lease()
        return None if lease is None else lease.key

    with guard.lock("k", 10):
        assert is_skipped(job.apply().get())
        assert job() is None  # plain function call: no lock taken, none checked
    assert job.apply().get() == "k"


# -- renewal and lost leases ------------------------------------------------------------


def test_heartbeat_renews_past_the_ttl_and_stops(app: Celery, guard: TaskGuard) -> None:
    expiries: list[Any] = []

    @guarded_task(app=app, shared=False, key="k", ttl=1.0)
    def slow() -> None:
        for _ in range(4):
            time.sleep(0.5)  # 2 s in all: twice the ttl
            info = guard.get("k")
            assert info is not None and info.held
            expiries.append(info.expires_at)
        check_lease(verify=True)

    result = slow.delay()
    assert result.state == "SUCCESS", result.result
    assert expiries == sorted(expiries) and len(set(expiries)) > 1
    assert held_lease.renewing() == 0  # nothing renews after the run


def test_lost_lease_is_reported_to_the_task(
    app: Celery, guard: TaskGuard, recorder: Recorder
) -> None:
    observed: list[str] = []

    @guarded_task(app=app, shared=False, key="k", ttl=0.6)
    def slow() -> None:
        assert guard.force_release("k")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                current_lease()
            except LeaseLost as exc:
                observed.append(exc.reason)
                break
            time.sleep(0.05)
        assert current_lease(check=False) is not None
        check_lease()

    result = slow.delay()
    assert observed and "taken over" in observed[0]
    assert isinstance(result.result, LeaseLost)
    assert recorder.of("lease_lost")[0]["key"] == "k"
    released = recorder.of("lock_released")
    assert len(released) == 1 and released[0]["released"] is False


def test_check_lease_outside_a_run_raises() -> None:
    with pytest.raises(TaskGuardError, match="outside a guarded run"):
        check_lease()


# -- queue phases at enqueue -------------------------------------------------------------


def test_queue_phase_skip_at_enqueue(app: Celery, guard: TaskGuard) -> None:
    @guarded_task(app=app, shared=False, key="q:{n}", ttl=5, lock="queue_and_run")
    def job(n: int) -> int:
        return n

    app.conf.task_store_eager_result = True
    with guard.lock("q:1", 10, task_id="first"):
        result = job.delay(1)
    value = result.get()
    assert is_skipped(value) and value["phase"] == "queue" and value["task_id"] == result.id
    assert app.AsyncResult(result.id).get() == value  # stored for lookups by id
    assert job.delay(1).get() == 1


def test_queue_phase_raise_at_enqueue_carries_the_holder(app: Celery, guard: TaskGuard) -> None:
    @guarded_task(app=app, shared=False, key="q", ttl=5, lock="queue", on_conflict="raise")
    def job() -> str:
        return "ran"

    with guard.lock("q", 10, task_id="first"), pytest.raises(AlreadyLocked) as info:
        job.delay()
    assert info.value.key == "q" and info.value.holder.holder.task_id == "first"
    assert job.delay().get() == "ran"
    assert not guard.get("q").held  # type: ignore[union-attr]


def test_queue_phase_existing_returns_the_holders_result(app: Celery, guard: TaskGuard) -> None:
    @guarded_task(
        app=app, shared=False, key="q", ttl=5, lock="queue_and_run", on_conflict="existing"
    )
    def job() -> None: ...

    with guard.lock("q", 10, task_id="first-id"):
        result = job.delay()
    assert result.id == "first-id"


def test_queue_and_run_hands_the_enqueue_lease_to_the_run(app: Celery, recorder: Recorder) -> None:
    @guarded_task(app=app, shared=False, key="q", ttl=5, lock="queue_and_run")
    def job() -> int:
        return current_lease().token  # type: ignore[union-attr]

    token = job.delay().get()
    acquired = recorder.of("lock_acquired")
    assert [e["lease"].token for e in acquired] == [token, token]  # enqueue, then adopted
    assert len(recorder.of("lock_released")) == 1


def test_queue_phase_lease_is_released_when_publishing_fails(pg_url: str, guard: TaskGuard) -> None:
    app = Celery("tg_down", broker="amqp://guest:guest@127.0.0.1:1//", set_as_current=False)
    app.conf.update(taskguard_database_url=pg_url, broker_connection_timeout=1)
    try:

        @guarded_task(app=app, shared=False, key="q", ttl=30, lock="queue")
        def job() -> None: ...

        with pytest.raises(Exception, match=r"(?i)connect|refused"):
            job.apply_async(retry=False)
        info = guard.get("q")
        assert info is not None and not info.held
    finally:
        reset_guards()
