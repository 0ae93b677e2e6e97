"""Celery app for test_otel.py: every pool process traces its runs
(opentelemetry-instrumentation-celery) and taskguard's lock events
(:func:`taskguard.otel.instrument`), and appends each finished span as a JSON
line to the file ``TG_OTEL_SPANS`` names (the test reads it)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from celery import Celery
from celery.signals import worker_process_init
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from workers import worker_settings

from taskguard import guarded_task, otel


def as_dict(span: ReadableSpan) -> dict[str, Any]:
    """What the test checks of a span: name, ids, parent, attributes, events."""
    assert span.context is not None
    return {
        "name": span.name,
        "trace_id": span.context.trace_id,
        "span_id": span.context.span_id,
        "parent_id": span.parent.span_id if span.parent is not None else None,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
    }


class FileExporter(SpanExporter):
    """Appends each span as one JSON line (one write: pool processes share the file)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = "".join(json.dumps(as_dict(span)) + "\n" for span in spans)
        with open(self.path, "a") as out:
            out.write(text)
        return SpanExportResult.SUCCESS


@worker_process_init.connect(weak=False)
def _trace_this_process(**_: Any) -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(os.environ["TG_OTEL_SPANS"])))
    CeleryInstrumentor().instrument(tracer_provider=provider)
    otel.instrument(tracer_provider=provider)


def make_app(broker_url: str, result_backend: str | None, queue: str, database_url: str) -> Celery:
    app = Celery("tg_otel_app", set_as_current=False)
    app.conf.update(worker_settings(broker_url, result_backend, queue, database_url))

    @guarded_task(app=app, shared=False, name="tg.otel_hold", key="otel:{key_id}", ttl=30)
    def hold(key_id: str, duration: float) -> str:
        time.sleep(duration)
        return "ran"

    @guarded_task(
        app=app,
        shared=False,
        name="tg.otel_queued",
        key="otelq:{key_id}",
        ttl=30,
        lock="queue",
        on_conflict="raise",
    )
    def queued(key_id: str) -> str:
        return "ran"

    return app


app = make_app(
    os.environ.get("TASKGUARD_TEST_BROKER_URL", "memory://"),
    os.environ.get("TASKGUARD_TEST_RESULT_BACKEND") or None,
    os.environ.get("TASKGUARD_TEST_QUEUE", "tg_otel_app"),
    os.environ.get("TASKGUARD_DATABASE_URL", ""),
)
