"""``celery -A proj taskguard``, run as real subprocesses against real databases
(cli_runner.py), and the guards its commands build."""

from __future__ import annotations

import json

import pytest
from cli_runner import CELERY, base_env, guard, lock_url, run, url, with_password  # noqa: F401 - fixtures

from taskguard import TaskGuard

pytestmark = pytest.mark.postgres


# -- celery -A proj taskguard ------------------------------------------------------------------


def test_celery_taskguard_commands_use_the_app_configuration(guard: TaskGuard, url: str) -> None:
    env = {**base_env(), "OPS_APP_DATABASE_URL": url}
    lease = guard.acquire("celery:1", 300, task_name="proj.task")
    assert lease is not None

    rows = json.loads(run([*CELERY, "locks", "--json"], env).stdout)
    assert [(r["key"], r["owner"]) for r in rows] == [("celery:1", lease.owner)]
    assert "task:       proj.task" in run([*CELERY, "show", "celery:1"], env).stdout
    run([*CELERY, "show", "celery:none"], env, code=1)
    assert "up to date" in run([*CELERY, "db", "current"], env).stdout
    out = run([*CELERY, "reap", "--grace", "0"], env).stdout
    assert out.startswith("removed 0 ") and ":***@" in out
    assert "released" in run([*CELERY, "release", "celery:1", "--owner", lease.owner], env).stdout
    assert not guard.is_held_by(lease)
    help_text = run([*CELERY, "--help"], env).stdout
    for command in ("locks", "show", "release", "reap", "db"):
        assert command in help_text


def test_celery_taskguard_without_a_configured_url(pg_url: str) -> None:
    proc = run([*CELERY, "locks"], base_env(), code=2)
    assert "taskguard_database_url" in proc.stderr
    # An explicit --database-url still works.
    out = run([*CELERY, "locks", "--json", "--database-url", with_password(pg_url)], base_env())
    assert json.loads(out.stdout) == []


def test_celery_taskguard_dash_h_is_help(url: str) -> None:
    env = {**base_env(), "OPS_APP_DATABASE_URL": url}
    assert run([*CELERY, "-h"], env).stdout == run([*CELERY, "--help"], env).stdout
    assert "--database-url" in run([*CELERY, "locks", "-h"], env).stdout


def test_celery_taskguard_usage_errors_are_one_line(url: str) -> None:
    """An unknown subcommand under ``celery -A proj taskguard`` is one line naming the
    command meant, like ``taskguard lock`` (it printed Click's usage block)."""
    env = {**base_env(), "OPS_APP_DATABASE_URL": url}
    err = run([*CELERY, "lock"], env, code=2).stderr.strip()
    assert err.count("\n") == 0 and err.startswith("taskguard: no command 'lock'")
    assert "taskguard locks`?" in err


# -- one guard factory (issue 12) ------------------------------------------------------------


def test_cli_guards_honour_every_setting(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under ``celery -A proj taskguard`` every command's guard carries the app's
    taskguard_* settings (durable, history, retention, engine options)."""
    from celery import Celery

    from taskguard.cli.celery import taskguard_command

    built: list[TaskGuard] = []
    original = TaskGuard.__init__

    def spy(self: TaskGuard, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        built.append(self)

    monkeypatch.setattr(TaskGuard, "__init__", spy)
    app = Celery("settings_app", set_as_current=False)
    app.conf.update(
        taskguard_database_url=pg_url,
        taskguard_durable=False,
        taskguard_history=True,
        taskguard_history_retention=3600.0,
        taskguard_engine_options={"pool_size": 2},
    )

    class Root:  # what celery's CLIContext carries for its subcommands
        pass

    root = Root()
    root.app = app  # type: ignore[attr-defined]
    for argv in (["locks"], ["show", "k"], ["explain", "k"], ["reap"]):
        built.clear()
        with pytest.raises(SystemExit):
            taskguard_command.main(args=argv, prog_name="celery taskguard", obj=root)
        assert built, argv
        guard = built[-1]
        assert (guard.durable, guard.history, guard.history_retention) == (False, True, 3600.0), (
            argv
        )
        assert guard.engine.pool.size() == 2, argv  # type: ignore[attr-defined]
    capsys.readouterr()
