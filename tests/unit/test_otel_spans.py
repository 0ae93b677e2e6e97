"""taskguard.otel without a database: the events integrations send (a conflict acted
on, a lost lease) on the current span; the settings checked; nothing wrapped (and
opentelemetry not imported) unless instrument() is called. The spans of the lease
operations themselves: tests/integration/test_otel_guard.py."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from taskguard import otel, signals
from taskguard.lease import Lease


@pytest.fixture
def spans() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(tracer_provider=provider)
    yield exporter, provider
    otel.uninstrument()


def _lease(token: int) -> Lease:
    now = datetime.now(timezone.utc)
    return Lease(key="feed:x", owner="o", token=token, acquired_at=now, expires_at=now, ttl=5.0)


def test_a_conflict_acted_on_is_an_event_of_the_current_span(spans: Any) -> None:
    exporter, provider = spans
    with provider.get_tracer("t").start_as_current_span("web.request"):
        signals.lock_conflict.send(sender=None, key="feed:x", holder=None, action="raise")
    signals.lock_conflict.send(sender=None, key="feed:x", holder=None, action="raise")  # no span
    (web,) = exporter.get_finished_spans()
    (event,) = web.events
    assert event.name == "taskguard.lock.conflict"
    assert dict(event.attributes or {}) == {
        "taskguard.lock.phase": "queue",  # sent outside a guarded run: at enqueue
        "taskguard.lock.strategy": "raise",
    }


def test_a_lost_lease_not_granted_under_a_span_is_a_span_of_its_own(spans: Any) -> None:
    exporter, provider = spans
    otel.instrument(tracer_provider=provider, record_keys=True)
    signals.lease_lost.send(sender="t-1", key="k", lease=_lease(3), reason="expired")
    (lost,) = exporter.get_finished_spans()
    assert lost.name == "taskguard.lease_lost"
    assert lost.attributes is not None
    assert lost.attributes["error.type"] == "taskguard.exceptions.LeaseLost"
    assert lost.attributes["taskguard.lock.key"] == "feed:x"  # the lease's
    assert lost.attributes["taskguard.lock.token"] == 3


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"renewal_sample_rate": 2}, "renewal_sample_rate must be from 0 to 1, got 2"),
        ({"slow_renewal": 0}, "slow_renewal must be a positive number of seconds, got 0"),
    ],
)
def test_bad_settings_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        otel.instrument(**options)
    assert not signals.lock_conflict.receivers  # nothing half-done


def test_uninstrument_disconnects() -> None:
    # Other modules of the same process may have receivers of their own (a test app's).
    before = {s: list(s.receivers) for s in (signals.lock_conflict, signals.lease_lost)}
    assert otel.instrument(tracer_provider=TracerProvider())
    assert all(len(s.receivers) > len(was) for s, was in before.items())
    otel.uninstrument()
    assert all(s.receivers == was for s, was in before.items())


def test_without_a_tracer_provider_nothing_is_wrapped() -> None:
    code = (
        "import logging, taskguard.otel\n"
        "from taskguard.guard import TaskGuard\n"
        "logging.basicConfig()\n"
        "assert taskguard.otel.instrument() is False  # no global provider set\n"
        "assert TaskGuard.take.__module__ == 'taskguard.guard'\n"
        "from opentelemetry.trace import NoOpTracerProvider\n"
        "assert taskguard.otel.instrument(tracer_provider=NoOpTracerProvider()) is False\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "no tracer provider is set, so nothing is traced" in proc.stderr


def test_nothing_imports_opentelemetry_or_wraps_unless_asked() -> None:
    code = (
        "import sys, taskguard, taskguard.celery, taskguard.otel\n"
        "from taskguard.guard import TaskGuard\n"
        "assert TaskGuard.take.__module__ == 'taskguard.guard'\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "sys.modules['opentelemetry'] = None  # as if not installed\n"
        "from taskguard import ConfigurationError\n"
        "try:\n"
        "    taskguard.otel.instrument()\n"
        "except ConfigurationError as exc:\n"
        "    print(exc)\n"
        "assert TaskGuard.take.__module__ == 'taskguard.guard'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "pip install 'taskguard-sql[otel]'" in proc.stdout
