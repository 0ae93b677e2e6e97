"""The README's quickstart, executed for real: its ``tasks.py`` is written out as
is, its shell commands run (``taskguard db upgrade`` on an empty PostgreSQL
database, ``celery -A tasks worker`` as a real prefork worker), and its calling
code runs against that worker, once with the feed free and once with it locked.

Only the service URLs are swapped for test ones (each swap is checked to have
happened, so a changed README cannot silently skip it). The broker is a SQLite
file rather than the README's Redis: a shared Redis queue could hand this
worker other tests' messages.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import celery
import pytest

from taskguard import TaskGuard

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def _one(lang: str, marker: str) -> str:
    found = [b for b in _blocks(lang) if marker in b]
    assert len(found) == 1, f"README.md needs exactly one ```{lang} block containing {marker!r}"
    return found[0]


def _swap(text: str, old: str, new: str) -> str:
    assert old in text, f"the README quickstart no longer contains {old!r}; update this test"
    return text.replace(old, new)


def test_readme_names_the_two_commands_ci_runs() -> None:
    text = README.read_text()
    assert "pip install . && taskguard demo" in _one("bash", "taskguard demo")
    tests = _one("bash", "scripts/test.sh")
    assert [line.split("#")[0].strip() for line in tests.splitlines()] == [
        "scripts/test.sh",
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert '-e ".[dev]"' in ci and "\nbash scripts/test.sh\n" in ci
    # The test command installs what the tests start private copies of, then pytest.
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "scripts/services.sh" in script and 'python3 -m pytest "$@"' in script
    for doc in re.findall(r"\]\((docs/[\w.]+)\)", text):
        assert (REPO / doc).is_file(), doc


def test_quickstart_is_short() -> None:
    tasks = _one("python", "@guarded_task")
    commands = _one("bash", "taskguard db upgrade")
    assert len(tasks.strip().splitlines()) <= 15
    assert len(tasks.strip().splitlines()) + len(commands.strip().splitlines()) <= 20


@contextlib.contextmanager
def _worker(command: list[str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.celery
@pytest.mark.postgres
def test_quickstart_runs_as_written(empty_pg_url: str, tmp_path: Path) -> None:
    readme_db = "postgresql+psycopg://app@127.0.0.1:5432/app"
    broker = f"sqla+sqlite:///{tmp_path / 'broker.sqlite'}"
    results = f"db+sqlite:///{tmp_path / 'results.sqlite'}"

    tasks = _one("python", "@guarded_task")
    tasks = _swap(tasks, "redis://127.0.0.1:6379/0", broker)
    tasks = _swap(tasks, "redis://127.0.0.1:6379/1", results)
    tasks = _swap(tasks, readme_db, empty_pg_url)
    (tmp_path / "tasks.py").write_text(tasks)

    commands = _swap(_one("bash", "taskguard db upgrade"), readme_db, empty_pg_url)
    upgrade, worker = [shlex.split(line) for line in commands.strip().splitlines()]
    assert upgrade[:3] == ["taskguard", "db", "upgrade"] and worker == [
        "celery",
        "-A",
        "tasks",
        "worker",
    ]
    env = {k: v for k, v in os.environ.items() if k != "TASKGUARD_DATABASE_URL"}
    done = subprocess.run(
        [sys.executable, "-c", "from taskguard.cli import main; main()", *upgrade[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr

    # The README's worker command, plus what keeps a test worker small and local.
    argv = [sys.executable, "-m", "celery", *worker[1:], "--concurrency", "1", "--loglevel", "INFO"]
    caller = _one("python", "is_skipped(result)")
    # Importing tasks.py makes its app Celery's current app: put ours back after.
    previous_app = celery.current_app._get_current_object()
    sys.path.insert(0, str(tmp_path))
    sys.modules.pop("tasks", None)
    guard = TaskGuard(empty_pg_url)
    try:
        with _worker(argv, tmp_path, tmp_path / "worker.log"):
            # Feed free: the worker imports it.
            first = _run_caller(caller)
            assert first["printed"] == ""
            assert first["result"] == "imported https://example.com/feeds/news.rss"

            # Feed being imported elsewhere: the worker skips it, and says so.
            key = first["import_feed"].taskguard_key_for(("https://example.com/feeds/news.rss",))
            lease = guard.acquire(key, 60, task_name="elsewhere")
            assert lease is not None
            second = _run_caller(caller)
            assert second["printed"].startswith("skipped: another worker")
            assert second["result"]["holder"]["owner"] == lease.owner
            assert guard.release(lease)
    finally:
        guard.dispose()
        sys.path.remove(str(tmp_path))
        sys.modules.pop("tasks", None)
        previous_app.set_current()
    log = (tmp_path / "worker.log").read_text()
    assert "is held by" in log and key in log  # the conflict was logged with its holder


def _run_caller(code: str) -> dict[str, object]:
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (quickstart caller)", "exec"), namespace)
    namespace["printed"] = out.getvalue()
    return namespace
