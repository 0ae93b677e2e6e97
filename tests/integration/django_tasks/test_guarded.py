"""@guarded and GuardedBackend in a Django project (tinysite: SQLite, ImmediateBackend),
in a subprocess so Django's settings stay out of this one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from djtasks_sites import run_tinysite

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

pytestmark = pytest.mark.django_tasks


def test_guarded_tasks_in_a_project(tmp_path: Path) -> None:
    proc = run_tinysite(tmp_path, "scenario_guarded.py")
    lines = proc.stdout.splitlines()
    seen = json.loads(next(line for line in lines if line.startswith("{")))
    assert seen == dict.fromkeys(seen, True), seen
    # The skipped run's conflict is logged with the key and the holder.
    assert any("]: lock 'item:1' is held by" in line and "skipped" in line and "someone.else" in line
               for line in lines), proc.stdout  # fmt: skip
