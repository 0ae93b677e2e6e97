"""taskguard.otel: taskguard's signals as span events; nothing connected (and
opentelemetry not imported) unless instrument() is called."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from taskguard import guarded_task, otel, signals
from taskguard.lease import Holder, Lease, LockInfo


@pytest.fixture
def spans() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(tracer_provider=provider)
    yield exporter, provider
    otel.uninstrument()


@pytest.fixture
def task() -> Any:
    app = Celery("otel-tests", set_as_current=False)

    @guarded_task(app=app, name="feeds.import", shared=False, key="feed:{url}", on_conflict="raise")
    def import_feed(url: str) -> None: ...

    return app.tasks["feeds.import"]


def _lease(token: int) -> Lease:
    now = datetime.now(timezone.utc)
    return Lease(key="feed:x", owner="o", token=token, acquired_at=now, expires_at=now, ttl=5.0)


def test_events_on_the_current_span(spans: Any, task: Any) -> None:
    exporter, provider = spans
    holder = LockInfo(
        key="feed:x", slot=0, owner="o2", token=7, acquired_at=datetime.now(timezone.utc),
        expires_at=datetime.now(timezone.utc), holder=Holder("feeds.import", "t-1", "w1@h"),
        read_at=datetime.now(timezone.utc),
    )  # fmt: skip
    with provider.get_tracer("t").start_as_current_span("run/feeds.import"):
        signals.lock_acquired.send(sender=task, key="feed:x", lease=_lease(8))
        signals.lock_conflict.send(sender=task, key="feed:x", holder=holder, action="raise")
        signals.lock_released.send(sender=task, key="feed:x", lease=_lease(8), held_for=1.0,
                                   released=False)  # fmt: skip
    (run,) = exporter.get_finished_spans()
    events = {e.name: dict(e.attributes or {}) for e in run.events}
    assert events["taskguard.lock.acquired"] == {
        "taskguard.lock.outcome": "granted",
        "taskguard.lock.phase": "queue",  # sent outside the task's own run
        "taskguard.lock.strategy": "raise",
        "taskguard.lock.limit": 1,
        "taskguard.lock.token": 8,
    }
    refused = events["taskguard.lock.refused"]
    assert refused["taskguard.lock.holder.task_id"] == "t-1"
    assert refused["taskguard.lock.holder.host"] == "w1@h"
    assert events["taskguard.lock.released"]["taskguard.lock.outcome"] == "expired"
    assert not any("taskguard.lock.key" in attrs for attrs in events.values())


def test_spans_of_their_own_without_a_current_span(spans: Any) -> None:
    exporter, provider = spans
    otel.instrument(tracer_provider=provider, record_keys=True)
    signals.lock_conflict.send(sender=None, key="k", holder=None, action="wait", waited=2.0)
    signals.lease_lost.send(sender="t-1", key="k", lease=_lease(3), reason="expired")
    wait, lost = exporter.get_finished_spans()
    assert wait.name == "taskguard.wait"
    assert wait.end_time - wait.start_time == 2_000_000_000
    assert wait.attributes["taskguard.lock.key"] == "k"
    assert wait.attributes["taskguard.lock.strategy"] == "wait"
    assert lost.name == "taskguard.renew"
    assert lost.attributes["error.type"] == "taskguard.LeaseLost"


def test_uninstrument_disconnects() -> None:
    otel.instrument()
    otel.uninstrument()
    assert not signals.lock_acquired.receivers
    assert not signals.lock_released.receivers


def test_nothing_imports_opentelemetry_unless_asked() -> None:
    code = (
        "import sys, taskguard, taskguard.celery, taskguard.otel\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "sys.modules['opentelemetry'] = None  # as if not installed\n"
        "from taskguard import ConfigurationError\n"
        "try:\n"
        "    taskguard.otel.instrument()\n"
        "except ConfigurationError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "pip install 'taskguard-sql[otel]'" in proc.stdout
