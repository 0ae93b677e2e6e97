"""docs/alembic.md, run as written: its files are written, its commands run, and
their output compared with the page, on a scratch PostgreSQL database.

The page marks each block with ``<!-- doctest: SCENARIOS ACTION [PATH] -->``:
SCENARIOS is a comma-separated list (way1, way2); ACTION is ``file`` (write the
block to PATH), ``append`` (append it), ``console`` (run each ``$`` command and
compare its output with the lines under it) or ``sql`` (execute the block).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from collections import Counter
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

import alembic.config
import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from conftest import REDIS_URL
from integration.celery.workers import start_worker
from sqlalchemy import create_engine, inspect, text

import taskguard
from taskguard import schema
from taskguard.cli import cli as taskguard_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "alembic.md"
DOC_URL = "postgresql+psycopg://app@127.0.0.1:5432/shop"
APP_REVISION = "5f2c1a9d0e11"

_STEP = re.compile(
    r"<!-- doctest: (?P<scenarios>[\w,]+) (?P<action>file|append|console|sql)(?: (?P<path>\S+))? -->\n"
    r"```\w*\n(?P<body>.*?)```",
    re.S,
)


@dataclass
class Step:
    scenarios: set[str]
    action: str
    path: str | None
    body: str


def steps(scenario: str) -> list[Step]:
    found = [
        Step(set(m["scenarios"].split(",")), m["action"], m["path"], m["body"])
        for m in _STEP.finditer(DOC.read_text())
    ]
    assert found, "docs/alembic.md has no doctest blocks"
    return [s for s in found if scenario in s.scenarios]


def _normalize(lines: list[str], url: str) -> Counter[str]:
    """Output lines, order-free (``alembic current`` lists heads in any order), with
    the scratch URL shown as the page's and taskguard's revision ids generalized
    (a new taskguard revision must not break this page)."""
    out = Counter[str]()
    for line in lines:
        line = line.replace(url, DOC_URL).rstrip()
        if line:
            out[re.sub(r"\btg\d{4}\b", "tgNNNN", line)] += 1
    return out


def _invoke(command: list[str], workdir: Path) -> tuple[int, str, str]:
    """Run an ``alembic`` or ``taskguard`` command line in this process (their own
    entry points, as the shell would; a subprocess per command would only add
    interpreter start-up), from ``workdir``."""
    out, err = io.StringIO(), io.StringIO()
    saved_path = list(sys.path)
    saved_modules = set(sys.modules)
    code: object = 0
    try:
        with contextlib.chdir(workdir), redirect_stdout(out), redirect_stderr(err):
            try:
                if command[0] == "alembic":
                    # Config's stdout default is bound at import time: hand it ours.
                    with mock.patch.object(alembic.config, "Config", partial(Config, stdout=out)):
                        alembic.config.main(argv=command[1:], prog="alembic")
                elif command[0] == "taskguard":
                    taskguard_cli.main(args=command[1:], prog_name="taskguard")
                else:
                    raise AssertionError(f"docs/alembic.md runs an unexpected command: {command}")
            except SystemExit as exc:
                code = exc.code
    finally:
        sys.path[:] = saved_path
        # The example app's modules belong to this workdir only.
        for name in set(sys.modules) - saved_modules:
            if name == "shop" or name.startswith("shop."):
                del sys.modules[name]
    return (
        (0 if code is None else int(code) if isinstance(code, int) else 1),
        out.getvalue(),
        err.getvalue(),
    )


def run_console(body: str, workdir: Path, url: str) -> None:
    blocks: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            blocks.append((line[2:], []))
        else:
            assert blocks, f"output before any command in:\n{body}"
            blocks[-1][1].append(line)
    for command_line, expected in blocks:
        command = shlex.split(command_line.replace(DOC_URL, url))
        redirect = None
        if ">" in command:
            at = command.index(">")
            command, redirect = command[:at], workdir / command[at + 1]
        code, stdout, stderr = _invoke(command, workdir)
        assert code == 0, f"$ {command_line}\n{stdout}\n{stderr}"
        if redirect is not None:
            redirect.write_text(stdout)
            assert "CREATE TABLE task_locks" in stdout
            continue
        assert _normalize(stdout.splitlines(), url) == _normalize(expected, url), (
            f"$ {command_line}: output differs from docs/alembic.md\n{stdout}"
        )


def run_page(
    scenario: str, workdir: Path, url: str, before_append: Callable[[], None] | None = None
) -> None:
    appended = False
    for step in steps(scenario):
        if step.action == "append" and not appended:
            appended = True
            if before_append is not None:
                before_append()
        body = step.body.replace(DOC_URL, url)
        if step.action in ("file", "append"):
            assert step.path is not None
            target = workdir / step.path
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("a" if step.action == "append" else "w") as fh:
                fh.write(body)
        elif step.action == "sql":
            engine = create_engine(url)
            with engine.begin() as conn:
                conn.execute(text(body))
            engine.dispose()
        else:
            run_console(body, workdir, url)


def _versions(url: str, table: str) -> set[str]:
    engine = create_engine(url)
    with engine.connect() as conn:
        found = {row[0] for row in conn.execute(text(f"SELECT version_num FROM {table}"))}
    engine.dispose()
    return found


def _objects(url: str) -> set[str]:
    engine = create_engine(url)
    insp = inspect(engine)
    names = (
        set(insp.get_table_names()) | set(insp.get_view_names()) | set(insp.get_sequence_names())
    )
    engine.dispose()
    return names


#: The application's Celery app, as a user following the page would have it.
_TASKS = """
import os

from celery import Celery

from taskguard import guarded_task

app = Celery("tasks", broker=os.environ["TASKGUARD_TEST_BROKER_URL"])
app.conf.taskguard_database_url = os.environ["TASKGUARD_DATABASE_URL"]
app.conf.taskguard_startup_check = "stop"


@guarded_task(app=app, key="order:{order_id}")
def ship(order_id):
    return order_id
"""


def ready_for_work(url: str, workdir: Path) -> None:
    """What the page's reader does next: ``taskguard check`` passes, and a worker
    whose start-up check stops on a wrong schema starts."""
    code, stdout, stderr = _invoke(["taskguard", "check", "--database-url", url], workdir)
    assert code == 0, stdout + stderr
    assert f"(schema at {schema.head()})" in stdout, stdout
    apps = workdir / "celeryapp"
    apps.mkdir(exist_ok=True)
    (apps / "tasks.py").write_text(_TASKS)
    # start_worker fails unless the worker reports "ready" (the check stops it before).
    with start_worker("tasks", REDIS_URL, url, concurrency=1, pythonpath=(apps,)) as worker:
        assert worker.proc.poll() is None


@pytest.mark.postgres
@pytest.mark.celery
@pytest.mark.parametrize("scenario", ["way1", "way2"])
def test_alembic_page_runs_as_written(scenario: str, empty_pg_url: str, tmp_path: Path) -> None:
    checked: list[str] = []

    def way1_leaves_the_app_alone() -> None:
        # The page's claim for way 1, checked before it switches to way 2.
        assert _versions(empty_pg_url, "alembic_version") == {APP_REVISION}
        assert _versions(empty_pg_url, "taskguard_alembic_version") == {schema.head()}
        ready_for_work(empty_pg_url, tmp_path)
        checked.append("way1")

    hook = way1_leaves_the_app_alone if scenario == "way1" else None
    run_page(scenario, tmp_path, empty_pg_url, before_append=hook)
    assert checked == (["way1"] if scenario == "way1" else [])
    # Way 2, and way 1 after the switch: taskguard's revision is in the app's table.
    ready_for_work(empty_pg_url, tmp_path)
    # The objects the page names exist; the app's own table is still there.
    assert {
        "orders",
        "task_locks",
        "task_locks_held",
        "task_lock_events",
        "task_locks_token_seq",
    } <= _objects(empty_pg_url)
    # Both scenarios end with taskguard's revisions in the app's alembic_version
    # (way 1 after switching) and no taskguard version table.
    assert _versions(empty_pg_url, "alembic_version") == {APP_REVISION, schema.head()}
    assert "taskguard_alembic_version" not in _objects(empty_pg_url)
    guard = taskguard.TaskGuard(empty_pg_url)
    try:
        assert guard.acquire("shop:order:1", 30) is not None
    finally:
        guard.dispose()


@pytest.mark.postgres
def test_without_the_hook_autogenerate_would_drop_taskguard(empty_pg_url: str) -> None:
    """Why the page's env.py has include_object (and why target_metadata=[...] is
    enough only for way 2)."""
    import sqlalchemy as sa

    app_metadata = sa.MetaData()
    sa.Table("orders", app_metadata, sa.Column("id", sa.Integer, primary_key=True))
    engine = create_engine(empty_pg_url)
    with engine.begin() as conn:
        app_metadata.create_all(conn)
    schema.upgrade(empty_pg_url)  # way 1: also creates taskguard_alembic_version

    def diff(metadata: object, **opts: object) -> list[object]:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts=opts)
            return list(compare_metadata(ctx, metadata))

    def removed_tables(ops: list[object]) -> set[str]:
        return {op[1].name for op in ops if isinstance(op, tuple) and op[0] == "remove_table"}

    try:
        assert "task_locks" in removed_tables(diff(app_metadata))
        assert diff(app_metadata, include_object=schema.exclude_taskguard_objects) == []
        # Listing taskguard's metadata hides its tables but not way 1's version table.
        assert removed_tables(diff([app_metadata, taskguard.metadata])) == {
            "taskguard_alembic_version"
        }
    finally:
        engine.dispose()
