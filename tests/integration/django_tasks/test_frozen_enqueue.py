"""Issue 41, defect 3: a GuardedBackend enqueue cut off by a frozen connection ends in
OutcomeUnknown; when the connection thaws its acquire lands. The key must not stay
held for the rest of queue_ttl (300 s here) with no job behind it: the enqueue gives
it back once the database answers (taskguard.held_lease.release_when_reachable)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from taskguard import TaskGuard
from tests.harness.proxy import FaultProxy

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

pytestmark = [pytest.mark.django_tasks, pytest.mark.slow]


def _line(proc: subprocess.Popen[str]) -> str:
    """The scenario's next line of its own (log lines, also on stdout, skipped)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        print(time.strftime("%T"), "scenario:", line.rstrip(), flush=True)
        if line.split()[:1] in (["ready"], ["raised"], ["enqueued"]):
            return line.strip()
    return ""


def test_a_frozen_enqueue_gives_its_key_back(pg_url: str, tmp_path: Path) -> None:
    guard = TaskGuard(pg_url)
    with FaultProxy(make_url(pg_url).port or 5432) as proxy:
        env = dict(os.environ)
        env.pop("TASKGUARD_DATABASE_URL", None)
        env.update({
            "DJANGO_SETTINGS_MODULE": "tinysite.settings",
            "TINYSITE_DB": str(tmp_path / "tiny.sqlite3"),
            "TINYSITE_LOCKS_URL": make_url(pg_url).set(port=proxy.port).render_as_string(
                hide_password=False
            ),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")]),
        })  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "scenario_frozen.py")], cwd=tmp_path, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert _line(proc) == "ready"
            proxy.freeze()
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert _line(proc) == "raised OutcomeUnknown"
            proxy.thaw()
            deadline, landed = time.monotonic() + 30, False
            while time.monotonic() < deadline:
                info = guard.get("frozen:1")
                # Seen held, or its release recorded (history on: tinysite).
                released = any(e.event == "released" for e in guard.events("frozen:1"))
                landed = landed or released or (info is not None and info.held)
                if landed and (info is None or not info.held):
                    break
                time.sleep(0.2)
            assert landed, "the cut-off acquire never landed (nothing to test)"
            info = guard.get("frozen:1")
            assert info is not None and not info.held, "still held, no job behind it"
        finally:
            proc.kill()
            proc.wait()
            guard.dispose()
