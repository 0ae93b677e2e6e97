"""taskguard.otel with django.tasks (tinysite: SQLite, ImmediateBackend, in a
subprocess so Django's settings stay out of this one): a @guarded run's acquire and
release spans are children of the span current when it runs; a refused run's acquire
span names the holder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from djtasks_sites import run_tinysite

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

pytestmark = pytest.mark.django_tasks


def _children(spans: list[dict[str, Any]], parent: str) -> list[dict[str, Any]]:
    (span,) = [s for s in spans if s["name"] == parent]
    return [s for s in spans if s["parent"] == span["id"]]


def test_guarded_runs_spans_nest(tmp_path: Path) -> None:
    proc = run_tinysite(tmp_path, "scenario_otel.py")
    spans = json.loads(proc.stdout.splitlines()[-1])
    in_run = {"taskguard.lock.phase": "run", "taskguard.lock.strategy": "skip"}
    acquire, release = _children(spans, "run/ran")
    assert (acquire["name"], release["name"]) == ("taskguard.acquire", "taskguard.release")
    token = acquire["attributes"]["taskguard.lock.token"]
    assert acquire["attributes"] == {
        **in_run, "taskguard.lock.limit": 1, "taskguard.lock.outcome": "granted",
        "taskguard.lock.token": token,
    }  # fmt: skip
    assert release["attributes"] == {
        **in_run, "taskguard.lock.outcome": "released", "taskguard.lock.token": token
    }  # fmt: skip
    (refused,) = _children(spans, "run/refused")
    assert refused["name"] == "taskguard.acquire"
    assert refused["attributes"]["taskguard.lock.outcome"] == "refused"
    assert refused["attributes"]["taskguard.lock.holder.task_name"] == "someone.else"
    assert refused["attributes"]["taskguard.lock.phase"] == "run"
    (run,) = [s for s in spans if s["name"] == "run/refused"]
    assert run["events"]["taskguard.lock.conflict"] == in_run  # what the run did about it
