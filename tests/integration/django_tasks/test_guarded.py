"""@guarded and GuardedBackend in a Django project (tinysite: SQLite, ImmediateBackend),
in a subprocess so Django's settings stay out of this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

pytestmark = pytest.mark.django_tasks


def test_guarded_tasks_in_a_project(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("TASKGUARD_DATABASE_URL", None)
    env.update({
        "DJANGO_SETTINGS_MODULE": "tinysite.settings",
        "TINYSITE_DB": str(tmp_path / "tiny.sqlite3"),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")]),
    })  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(HERE / "scenario_guarded.py")], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    seen = json.loads(next(line for line in lines if line.startswith("{")))
    assert seen == dict.fromkeys(seen, True), seen
    # The skipped run's conflict is logged with the key and the holder.
    assert any("]: lock 'item:1' is held by" in line and "skipped" in line and "someone.else" in line
               for line in lines), proc.stdout  # fmt: skip
