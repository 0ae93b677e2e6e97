"""The Django Tasks test sites: the database examples/djangotasksfeeds keeps its tables
and locks in (one fixture, parametrized over the databases of DATABASES, for every
real-worker test here), and tinysite's scenarios run in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import django
import pytest
from conftest import drop_maria_database, drop_pg_database, new_maria_database, new_pg_database
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "djangotasksfeeds"
HERE = Path(__file__).resolve().parent
#: Each database once and each django.tasks once: Django 6's own (.ci/run's Python 3.12
#: step) on PostgreSQL, the backport (the main run, Django 5.2) on MariaDB and SQLite;
#: the Celery bridge, Django 6 only, on all three. The store under them is the same.
DATABASES = ["postgresql", "mariadb", "sqlite"] if django.VERSION >= (6,) else ["mariadb", "sqlite"]


def run_tinysite(tmp_path: Path, scenario: str) -> subprocess.CompletedProcess[str]:
    """``scenario`` (a script here) run against tinysite (SQLite in ``tmp_path``,
    ImmediateBackend), in a subprocess so Django's settings stay out of the test's;
    it must exit 0."""
    env = dict(os.environ)
    env.pop("TASKGUARD_DATABASE_URL", None)
    env.update({
        "DJANGO_SETTINGS_MODULE": "tinysite.settings",
        "TINYSITE_DB": str(tmp_path / "tiny.sqlite3"),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO), env.get("PYTHONPATH", "")]),
    })  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(HERE / scenario)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(name="example_env", params=DATABASES)
def example_env_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment that runs examples/djangotasksfeeds on that database (SQLite: a
    file in the test's directory); the database is dropped afterwards."""
    env = dict(os.environ)
    for name in ("TASKGUARD_DATABASE_URL", "DJANGO_SETTINGS_MODULE", "DJANGOTASKSFEEDS_DATABASE"):
        env.pop(name, None)
    env["DJANGOTASKSFEEDS_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE), str(REPO), env.get("PYTHONPATH", "")])
    url, drop = None, None
    if request.param == "postgresql":
        request.getfixturevalue("pg_template")
        url, drop = new_pg_database(None), drop_pg_database
        django_url = make_url(url).set(drivername="postgresql")
    elif request.param == "mariadb":
        request.getfixturevalue("maria_template")
        url, drop = new_maria_database(None), drop_maria_database
        django_url = make_url(url).set(drivername="mysql", query={})
    if url is not None:
        env["DJANGOTASKSFEEDS_DATABASE"] = django_url.render_as_string(hide_password=False)
    yield env
    if drop is not None and url is not None:
        drop(url)
