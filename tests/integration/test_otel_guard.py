"""taskguard.otel on a real database (SQLite: cheap): every lease operation of
TaskGuard is a timed span, a child of the span current at the call; a renewal only
when it fails or is sampled, under the span its lease was granted in; a lost lease
is an event on that span."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from taskguard import AlreadyLocked, TaskGuard, otel, waiting
from taskguard import guard as guard_module
from taskguard.held_lease import Hold
from taskguard.options import CELERY
from taskguard.runs import GuardedRun, GuardSpec, enqueue_locked


def _job(item: str) -> None:
    """A guarded job's signature."""


@pytest.fixture
def traced() -> Iterator[tuple[InMemorySpanExporter, Any]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(tracer_provider=provider)
    yield exporter, provider
    otel.uninstrument()


@pytest.fixture
def sguard(sqlite_url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(sqlite_url)
    yield g
    g.dispose()


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_each_operation_is_a_span_under_the_current_one(traced: Any, sguard: TaskGuard) -> None:
    exporter, provider = traced
    with provider.get_tracer("t").start_as_current_span("job") as job:
        lease = sguard.acquire("k", 10, task_name="t.a", task_id="id-1")
        assert lease is not None
        refused = sguard.try_acquire("k", 10, limit=1)
        adopted = sguard.adopt("k", lease.owner, 10, exclusive=True, task_name="t.b")
        lapsed = sguard.adopt("k", "nobody", 10)
        assert refused.lease is None and adopted is not None and lapsed is None
        assert sguard.release(adopted)
        assert not sguard.release(lease)  # handed over: no longer this owner's
        assert sguard.acquire("k", 10) is not None
        assert sguard.force_release("k", by="ops")
        assert not sguard.force_release("k")
    job_id = job.get_span_context().span_id
    spans = [s for s in exporter.get_finished_spans() if s.name != "job"]
    assert [s.name for s in spans] == [
        "taskguard.acquire",
        "taskguard.acquire",
        "taskguard.adopt",  # adopt(exclusive=True) -> take_over: one span
        "taskguard.adopt",
        "taskguard.release",
        "taskguard.release",
        "taskguard.acquire",
        "taskguard.force_release",
        "taskguard.force_release",
    ]
    assert all(_parent(s) == job_id for s in spans)
    attrs = [dict(s.attributes or {}) for s in spans]
    assert attrs[0] == {
        "taskguard.lock.limit": 1,
        "taskguard.lock.outcome": "granted",
        "taskguard.lock.token": lease.token,
    }
    assert attrs[1]["taskguard.lock.outcome"] == "refused"
    assert attrs[1]["taskguard.lock.holder.task_id"] == "id-1"
    assert attrs[1]["taskguard.lock.holder.task_name"] == "t.a"
    assert attrs[1]["taskguard.lock.holder.token"] == lease.token
    assert [a["taskguard.lock.outcome"] for a in attrs[2:]] == [
        "adopted", "lapsed", "released", "expired", "granted", "released", "not_held"
    ]  # fmt: skip
    assert attrs[2]["taskguard.lock.token"] == lease.token  # the same row and token
    assert not any("taskguard.lock.key" in a for a in attrs)  # only when asked
    assert all(s.end_time is not None and s.start_time is not None for s in spans)


def test_keys_when_asked_and_errors(sguard: TaskGuard, tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(tracer_provider=provider, record_keys=True)
    broken = TaskGuard(f"sqlite:///{tmp_path / 'no-schema.sqlite'}")
    try:
        assert sguard.acquire("feed:1", 10) is not None
        with pytest.raises(Exception) as raised:
            broken.acquire("feed:2", 10)
    finally:
        otel.uninstrument()
        broken.dispose()
    ok, failed = _named(exporter, "taskguard.acquire")
    assert ok.attributes is not None and ok.attributes["taskguard.lock.key"] == "feed:1"
    assert failed.attributes is not None
    error = type(raised.value)
    assert failed.attributes["error.type"] == f"{error.__module__}.{error.__qualname__}"
    assert failed.status.status_code is StatusCode.ERROR


def test_a_wait_is_a_span_inside_the_acquire(traced: Any, sguard: TaskGuard) -> None:
    exporter, _provider = traced
    first = sguard.acquire("w", 2.0)
    assert first is not None
    assert sguard.acquire("w", 10, wait=0.05) is None  # gives up
    assert sguard.acquire("w", 10, wait=10) is not None  # the first lease expires
    waits = _named(exporter, "taskguard.wait")
    acquires = _named(exporter, "taskguard.acquire")
    assert len(waits) == 2 and len(acquires) == 3
    assert [_parent(w) for w in waits] == [a.context.span_id for a in acquires[1:]]
    gave_up, granted = (dict(w.attributes or {}) for w in waits)
    assert gave_up["error.type"] == "timeout" and gave_up["taskguard.lock.outcome"] == "timeout"
    assert gave_up["taskguard.lock.wait_timeout"] == 0.05
    assert granted["taskguard.lock.outcome"] == "granted"
    assert waits[1].end_time > waits[1].start_time  # it waited for the expiry
    assert acquires[1].attributes["taskguard.lock.outcome"] == "refused"


def test_a_wait_refused_for_good_ends_at_once_without_an_error(
    traced: Any, sguard: TaskGuard
) -> None:
    """``unless=``: the other key (a finished job's record) taken while it waits, the
    wait ends once the key is free, refused, not timed out."""
    exporter, _provider = traced
    assert sguard.acquire("u", 1.0) is not None
    threading.Timer(0.3, sguard.acquire, ("u:done", 60)).start()
    started = time.monotonic()
    attempt = sguard.try_acquire("u", 10, wait=30, unless="u:done")
    assert attempt.lease is None and attempt.holder is not None
    assert time.monotonic() - started < 20  # at the first lease's end, not the wait's
    (wait,) = _named(exporter, "taskguard.wait")
    attributes = dict(wait.attributes or {})
    assert attributes["taskguard.lock.outcome"] == "refused" and "error.type" not in attributes


def test_renewals_only_when_they_fail_or_are_sampled(traced: Any, sguard: TaskGuard) -> None:
    exporter, provider = traced
    otel.instrument(tracer_provider=provider, slow_renewal=60)  # none is slow, however loaded
    with provider.get_tracer("t").start_as_current_span("job") as job:
        lease = sguard.acquire("r", 10)
    assert lease is not None
    assert sguard.renew(lease)  # not slow, not sampled: no span
    assert not _named(exporter, "taskguard.renew")
    sguard.force_release("r")
    assert not sguard.renew(lease)
    (lost,) = _named(exporter, "taskguard.renew")
    assert _parent(lost) == job.get_span_context().span_id  # where it was granted
    assert lost.attributes is not None
    assert lost.attributes["taskguard.lock.outcome"] == "lost"
    assert lost.attributes["error.type"] == "taskguard.exceptions.LeaseLost"
    again = sguard.acquire("r", 10)
    assert again is not None
    for options in ({"renewal_sample_rate": 1.0}, {"slow_renewal": 1e-9}):  # sampled; slow
        otel.instrument(tracer_provider=provider, **options)
        assert sguard.renew(again)
        renewed = _named(exporter, "taskguard.renew")[-1]
        assert renewed.attributes is not None
        assert renewed.attributes["taskguard.lock.outcome"] == "renewed"
    assert len(_named(exporter, "taskguard.renew")) == 3
    with sqlite3.connect(sguard.engine.url.database) as db:
        db.execute("DROP TABLE task_locks")
    with pytest.raises(Exception) as raised:
        sguard.renew(again)
    failed = _named(exporter, "taskguard.renew")[-1]
    error = type(raised.value)
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == f"{error.__module__}.{error.__qualname__}"
    assert "taskguard.lock.outcome" not in failed.attributes
    assert failed.status.status_code is StatusCode.ERROR


def test_a_lost_lease_is_an_event_on_its_runs_span(traced: Any, sguard: TaskGuard) -> None:
    exporter, provider = traced
    with provider.get_tracer("t").start_as_current_span("run/t.x"):
        lease = sguard.acquire("lost", 0.6)
        assert lease is not None
        hold = Hold(sguard, "lost", lease, None)
        hold.start_renewing()  # on the renewer thread, every 0.2 s
        try:
            sguard.force_release("lost")
            deadline = time.monotonic() + 30
            while hold.lost is None and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            hold.stop_renewing()
        assert hold.lost is not None
    (run,) = _named(exporter, "run/t.x")
    (event,) = [e for e in run.events if e.name == "taskguard.lock.lost"]
    assert event.attributes is not None
    assert event.attributes["error.type"] == "taskguard.exceptions.LeaseLost"
    assert event.attributes["taskguard.lock.token"] == lease.token
    assert not _named(exporter, "taskguard.lease_lost")  # no root span of its own


def test_asyncio_calls_and_limits(traced: Any, sguard: TaskGuard) -> None:
    exporter, provider = traced

    async def main() -> None:
        with provider.get_tracer("t").start_as_current_span("job"):
            lease = await sguard.aacquire("a", 10, limit=2)  # on a lease thread
            assert lease is not None
            assert await sguard.arelease(lease)

    asyncio.run(main())
    (job,) = _named(exporter, "job")
    acquire, release = (s for s in exporter.get_finished_spans() if s.name != "job")
    assert _parent(acquire) == _parent(release) == job.context.span_id
    assert acquire.attributes is not None and acquire.attributes["taskguard.lock.limit"] == 2
    assert release.name == "taskguard.release"


def test_a_release_put_off_to_the_fenced_commit_is_one_span(
    traced: Any, sguard: TaskGuard, sqlite_url: str
) -> None:
    """A release called inside the transaction that fenced the lease is done at its
    commit (taskguard.fencing): one span, then, with its grant's attributes; not one
    for the call that put it off and another for the release."""
    exporter, provider = traced
    spec = GuardSpec.of(_job, CELERY, {"key": "fenced:{item}", "ttl": 30}, name="t.fenced")
    engine = create_engine(sqlite_url)
    run = GuardedRun(spec, None, (), {"item": "1"}, task_id="f-1", guard=sguard)

    def body() -> None:
        assert run.lease is not None
        with Session(engine) as session, session.begin():
            run.lease.fence(session)
            run.exit()  # the run's release, put off to the commit
            assert not _named(exporter, "taskguard.release")
            assert sguard.get("fenced:1").held  # type: ignore[union-attr]

    with provider.get_tracer("t").start_as_current_span("run/t.fenced"):
        run.run(body)
    engine.dispose()
    assert not sguard.get("fenced:1").held  # type: ignore[union-attr]
    (released,) = _named(exporter, "taskguard.release")
    (acquired,) = _named(exporter, "taskguard.acquire")
    assert dict(released.attributes or {}) == {
        "taskguard.lock.phase": "run",
        "taskguard.lock.strategy": "skip",
        "taskguard.lock.outcome": "released",
        "taskguard.lock.token": (acquired.attributes or {})["taskguard.lock.token"],
    }


def test_an_enqueues_acquire_says_phase_queue(traced: Any, sguard: TaskGuard) -> None:
    """The acquire an enqueue sends (lock="queue_and_run") says phase queue, also when
    a guarded run enqueues it (the run's own phase and strategy are not the enqueue's);
    the run adopting that lease says run, with its strategy."""
    exporter, provider = traced
    options = {"key": "q:{item}", "ttl": 30, "lock": "queue_and_run", "on_conflict": "raise"}
    spec = GuardSpec.of(_job, CELERY, options, name="t.queued")
    outer = GuardSpec.of(_job, CELERY, {"key": "outer:{item}", "ttl": 30}, name="t.outer")

    def enqueue(job_id: str) -> Any:
        return enqueue_locked(spec, None, (), {"item": "1"}, lambda: job_id, job_id=str,
                              task_id=job_id, guard=sguard)  # fmt: skip

    with provider.get_tracer("t").start_as_current_span("web.request"):
        assert enqueue("j-1") == "j-1"
        with pytest.raises(AlreadyLocked):
            GuardedRun(outer, None, (), {"item": "1"}, guard=sguard).run(lambda: enqueue("j-2"))
    run = GuardedRun(spec, None, (), {"item": "1"}, task_id="j-1", guard=sguard)
    assert run.run(lambda: "ran") == "ran"
    acquires = [dict(s.attributes or {}) for s in _named(exporter, "taskguard.acquire")]
    granted, outer_run, refused = acquires
    assert granted["taskguard.lock.phase"] == refused["taskguard.lock.phase"] == "queue"
    assert "taskguard.lock.strategy" not in refused  # not the enqueuing run's "skip"
    assert outer_run["taskguard.lock.phase"] == "run"
    (adopted,) = (dict(s.attributes or {}) for s in _named(exporter, "taskguard.adopt"))
    assert adopted["taskguard.lock.phase"] == "run"
    assert adopted["taskguard.lock.strategy"] == "raise"
    assert adopted["taskguard.lock.outcome"] == "adopted"


def test_uninstrument_puts_everything_back() -> None:
    before = dict(vars(TaskGuard))
    assert otel.instrument(tracer_provider=TracerProvider())
    assert TaskGuard.take is not before["take"]
    otel.instrument(tracer_provider=TracerProvider())  # again: replaces, never wraps twice
    otel.uninstrument()
    assert {name: vars(TaskGuard)[name] for name in before} == before
    assert guard_module.wait_for is waiting.wait_for
