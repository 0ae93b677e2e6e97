"""taskguard.otel in a real prefork worker traced by opentelemetry-instrumentation-celery:
a run's acquire and release are spans, children of its ``run/<task>`` span; a refused
duplicate's acquire span says refused and by whom (and the run's span, what it did
about it); a queue-phase refusal at publish is a span of the publishing process (this
one, with its own tracer provider), as is an operator's force-release."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import AMQP_URL, REDIS_URL
from harness import wait_for
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tg_otel_app import make_app
from workers import purge_queue, start_worker, unique_queue

from taskguard import AlreadyLocked, TaskGuard, is_skipped, otel
from taskguard.config import reset_guards

pytestmark = [pytest.mark.celery, pytest.mark.postgres]


def _spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _runs(path: Path) -> list[dict[str, Any]]:
    """The ``run/tg.otel_hold`` spans the worker exported, once both are there."""
    found = [s for s in _spans(path) if s["name"] == "run/tg.otel_hold"]
    return found if len(found) == 2 else []


def _child(spans: list[dict[str, Any]], parent: dict[str, Any], name: str) -> dict[str, Any]:
    """The one span ``name`` whose parent is ``parent``."""
    (found,) = [s for s in spans if s["name"] == name and s["parent_id"] == parent["span_id"]]
    assert found["trace_id"] == parent["trace_id"]
    return found


def test_lock_events_in_traced_worker_and_publisher(pg_url: str, tmp_path: Path) -> None:
    spans_file = tmp_path / "spans.jsonl"
    queue = unique_queue("tg-otel")
    app = make_app(AMQP_URL, REDIS_URL, queue, pg_url)
    guard = TaskGuard(pg_url)
    exporter = InMemorySpanExporter()  # the publishing side: this process
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.instrument(tracer_provider=provider)
    kid = uuid.uuid4().hex[:8]
    idle_queue = unique_queue("tg-otel-idle")
    try:
        with start_worker(
            "tg_otel_app",
            AMQP_URL,
            pg_url,
            2,
            queue=queue,
            result_backend=REDIS_URL,
            env={"TG_OTEL_SPANS": str(spans_file)},
        ):
            hold, queued = app.tasks["tg.otel_hold"], app.tasks["tg.otel_queued"]
            first = hold.delay(kid, 6.0)  # wide room on a loaded machine
            wait_for(lambda: guard.get(f"otel:{kid}"), 30, "the first run to hold its key")
            duplicate = hold.delay(kid, 0.0)
            value = duplicate.get(timeout=60)
            assert is_skipped(value), value

            # Queue phase: taken here, at publish; to a queue no worker consumes, so
            # the key stays taken (for queue_ttl) until the refused publish below.
            queued_first = queued.apply_async((kid,), queue=idle_queue)
            tracer = provider.get_tracer("test")
            with tracer.start_as_current_span("web.request"), pytest.raises(AlreadyLocked):
                queued.delay(kid)
            assert first.get(timeout=60) == "ran"
            runs = wait_for(lambda: _runs(spans_file), 30, "both runs' spans")
            assert guard.force_release(f"otelq:{kid}", by="test")  # an operator, here
    finally:
        purge_queue(AMQP_URL, idle_queue, delete=True)
        otel.uninstrument()
        guard.dispose()
        app.close()
        reset_guards()

    worker_spans = _spans(spans_file)
    by_task = {s["attributes"]["messaging.message.id"]: s for s in runs}  # the task id
    ran, refused = by_task[first.id], by_task[duplicate.id]
    acquired = _child(worker_spans, ran, "taskguard.acquire")["attributes"]
    assert acquired == {
        "taskguard.lock.phase": "run",
        "taskguard.lock.strategy": "skip",
        "taskguard.lock.limit": 1,
        "taskguard.lock.outcome": "granted",
        "taskguard.lock.token": acquired["taskguard.lock.token"],
    }  # no taskguard.lock.key: only with instrument(record_keys=True)
    released = _child(worker_spans, ran, "taskguard.release")["attributes"]
    assert released["taskguard.lock.outcome"] == "released"
    assert released["taskguard.lock.strategy"] == "skip"  # the grant's
    assert released["taskguard.lock.token"] == acquired["taskguard.lock.token"]
    refusal = _child(worker_spans, refused, "taskguard.acquire")["attributes"]
    assert refusal["taskguard.lock.outcome"] == "refused"
    assert refusal["taskguard.lock.holder.task_id"] == first.id
    assert refusal["taskguard.lock.holder.task_name"] == "tg.otel_hold"
    assert refusal["taskguard.lock.holder.host"].startswith(queue)
    assert refusal["taskguard.lock.holder.token"] == acquired["taskguard.lock.token"]
    acted = {e["name"]: e["attributes"] for e in refused["events"]}["taskguard.lock.conflict"]
    assert acted == {"taskguard.lock.phase": "run", "taskguard.lock.strategy": "skip"}

    published = exporter.get_finished_spans()
    (web,) = [s for s in published if s.name == "web.request"]
    at_publish = [s for s in published if s.name == "taskguard.acquire"]
    granted, refused_here = at_publish  # the first outside any span: a root span
    assert granted.parent is None
    assert granted.attributes is not None
    assert granted.attributes["taskguard.lock.outcome"] == "granted"
    assert refused_here.parent is not None
    assert refused_here.parent.span_id == web.context.span_id
    assert refused_here.attributes is not None
    assert refused_here.attributes["taskguard.lock.outcome"] == "refused"
    assert refused_here.attributes["taskguard.lock.holder.task_id"] == queued_first.id
    (event,) = [e for e in web.events if e.name == "taskguard.lock.conflict"]
    assert dict(event.attributes or {}) == {
        "taskguard.lock.phase": "queue",
        "taskguard.lock.strategy": "raise",
    }
    (forced,) = [s for s in published if s.name == "taskguard.force_release"]
    assert forced.attributes is not None
    assert forced.attributes["taskguard.lock.outcome"] == "released"
