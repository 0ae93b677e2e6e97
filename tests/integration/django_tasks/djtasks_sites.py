"""The database a Django Tasks test site keeps its tables and locks in: one fixture,
parametrized over PostgreSQL, MariaDB and SQLite, for every real-worker test here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import drop_maria_database, drop_pg_database, new_maria_database, new_pg_database
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "djangotasksfeeds"


@pytest.fixture(name="example_env", params=["postgresql", "mariadb", "sqlite"])
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
