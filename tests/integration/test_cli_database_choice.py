"""Which database the command line acts on (issue 33): ``--database-url`` beats the
app's configuration (``celery -A proj taskguard``, ``manage.py taskguard``), which beats
``$TASKGUARD_DATABASE_URL``; a SQLite path that does not exist is refused, not created."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_runner import CELERY, TASKGUARD, base_env, run

from taskguard import TaskGuard
from taskguard.config import ENV_DATABASE_URL


@pytest.fixture
def two(sqlite_template: Path, tmp_path: Path) -> tuple[str, str]:
    """Two migrated SQLite databases: A for the environment, B for the app."""
    urls = []
    for name in ("a", "b"):
        shutil.copyfile(sqlite_template, tmp_path / f"{name}.sqlite")
        urls.append(f"sqlite:///{tmp_path / name}.sqlite")
    return urls[0], urls[1]


def _hold(url: str, key: str) -> None:
    guard = TaskGuard(url)
    try:
        assert guard.acquire(key, 300) is not None
    finally:
        guard.dispose()


def test_celery_taskguard_acts_on_the_apps_database_not_the_environments(
    two: tuple[str, str],
) -> None:
    a, b = two
    _hold(a, "in-a")
    _hold(b, "in-b")
    env = {**base_env(), ENV_DATABASE_URL: a, "OPS_APP_DATABASE_URL": b}
    assert "b.sqlite: ok" in run([*CELERY, "check"], env).stdout
    listed = run([*CELERY, "locks"], env).stdout
    assert "in-b" in listed and "in-a" not in listed
    # an explicit --database-url still wins; the plain command reads the environment
    assert "in-a" in run([*CELERY, "locks", "--database-url", a], env).stdout
    assert "in-a" in run([*TASKGUARD, "locks"], env).stdout


def test_manage_py_taskguard_ignores_the_environment(two: tuple[str, str], tmp_path: Path) -> None:
    """docs/django.md: the variable is not consulted; the project's database is."""
    import sys

    from integration.django.djangoproject import DjangoSite
    from integration.django.djangoproject import run as run_django

    a, _ = two
    _hold(a, "in-a")
    site = DjangoSite("sqlite", str(tmp_path / "site.sqlite"))
    site.manage("migrate")
    _hold(f"sqlite:///{tmp_path / 'site.sqlite'}", "in-site")
    env = {**site.env(), ENV_DATABASE_URL: a}
    for argv in (["locks"], ["check"]):
        out = run_django([sys.executable, "manage.py", "taskguard", *argv], env).stdout
        assert "a.sqlite" not in out and "in-a" not in out, out
    assert "in-site" in run_django([sys.executable, "manage.py", "taskguard", "locks"], env).stdout


@pytest.mark.parametrize(
    "argv", [["locks"], ["show", "k"], ["explain", "k"], ["check"], ["db", "current"]]
)
def test_a_sqlite_path_that_does_not_exist_is_refused_not_created(
    argv: list[str], tmp_path: Path
) -> None:
    new = tmp_path / "new.db"
    code = 1 if argv == ["check"] else 2
    proc = run([*TASKGUARD, *argv, "--database-url", f"sqlite:///{new}"], base_env(), code=code)
    assert f"no SQLite database at '{new}'" in proc.stderr, proc.stderr
    assert not new.exists()
