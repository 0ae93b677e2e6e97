"""Run with tinysite's settings: taskguard.otel around @guarded runs (ImmediateBackend,
in-process); prints the finished spans as one JSON line."""

import json

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from tinytasks import tasks  # noqa: E402

from taskguard import otel  # noqa: E402
from taskguard.contrib.django_tasks import project_guard  # noqa: E402

call_command("migrate", verbosity=0)
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
otel.instrument(tracer_provider=provider)
tracer = provider.get_tracer("scenario")
guard = project_guard()

with tracer.start_as_current_span("run/ran"):
    assert tasks.skipping.enqueue(1).status == "SUCCESSFUL"
held = guard.acquire("item:1", 30, task_name="someone.else")
with tracer.start_as_current_span("run/refused"):
    tasks.skipping.enqueue(1)
guard.release(held)
print(json.dumps([
    {
        "name": s.name,
        "id": s.context.span_id,
        "parent": s.parent.span_id if s.parent else None,
        "attributes": dict(s.attributes or {}),
        "events": {e.name: dict(e.attributes or {}) for e in s.events},
    }
    for s in exporter.get_finished_spans()
]))  # fmt: skip
