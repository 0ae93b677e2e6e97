"""Shared fixtures: an isolated, migrated database per test.

PostgreSQL: taskguard's migrations run once into a template database; each test
gets ``CREATE DATABASE … TEMPLATE`` (tens of milliseconds) and drops it after.
SQLite: a migrated file is copied per test.
MariaDB: migrations run once into a template database; each test gets a fresh
database whose tables, sequence and view are copied from it (``CREATE TABLE …
LIKE``: ~0.2 s, a third of running the migrations) and drops it after.

When PostgreSQL or MariaDB is unreachable the tests that need it FAIL (never
skip), unless TASKGUARD_ALLOW_NO_PG=1 / TASKGUARD_ALLOW_NO_MARIADB=1 is set for
a local run without that server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from taskguard import TaskGuard, held_lease, schema
from tests import services
from tests.services import (  # the service URLs and admin connections live there
    AMQP_URL,
    MARIADB_URL,
    PG_URL,
    REDIS_URL,
    drop_maria_database,
    drop_pg_database,
    maria_admin,
    pg_admin,
)

__all__ = ["AMQP_URL", "REDIS_URL", "drop_maria_database", "drop_pg_database", "new_pg_database"]


@pytest.fixture(scope="session", autouse=True)
def _test_databases() -> None:
    """The databases PG_URL and MARIADB_URL name (``test``), created when missing:
    some tests use those URLs as they are. (A server that cannot be reached is
    reported by the fixtures that need it.)"""
    for create in (services.create_pg_database, services.create_maria_database):
        with contextlib.suppress(Exception):
            create()


@pytest.fixture(autouse=True)
def _no_run_left_active() -> Iterator[None]:
    """A test that leaves a guarded run active in this thread fails, not a later test
    whose spans or ``current_lease()`` would see it (a run started here is exited here)."""
    yield
    left = held_lease.active_run()
    if left is not None:
        held_lease._current.set(None)
        pytest.fail(f"the test left a guarded run active in this thread: {left!r}")


def _template_name() -> str:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    return f"taskguard_tpl_{worker}_{os.getpid()}"


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """Name of a migrated template database (created once per test session)."""
    try:
        admin = pg_admin()
    except psycopg.OperationalError as exc:
        if os.environ.get("TASKGUARD_ALLOW_NO_PG") == "1":
            pytest.skip(f"PostgreSQL unreachable at {PG_URL}: {exc}")
        pytest.fail(
            f"PostgreSQL is required at {PG_URL} (set TASKGUARD_TEST_PG_URL), "
            f"but it is unreachable: {exc}",
            pytrace=False,
        )
    name = _template_name()
    with admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    schema.upgrade(make_url(PG_URL).set(database=name))
    yield name
    with pg_admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def new_pg_database(template: str | None) -> str:
    """Create a fresh database (a clone of ``template`` or empty); returns its URL."""
    return services.new_pg_database("tg", template)


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """URL of a migrated, empty PostgreSQL database private to this test."""
    url = new_pg_database(pg_template)
    yield url
    drop_pg_database(url)


@pytest.fixture
def empty_pg_url(pg_template: str) -> Iterator[str]:
    """URL of an empty PostgreSQL database (no taskguard schema) private to this test."""
    url = new_pg_database(None)
    yield url
    drop_pg_database(url)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.sqlite"
    schema.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    """URL of a migrated SQLite file private to this test."""
    path = tmp_path / "locks.sqlite"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


_URL_FIXTURES = {"postgresql": "pg_url", "sqlite": "sqlite_url", "mariadb": "maria_url"}


@pytest.fixture(params=list(_URL_FIXTURES))
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test using this runs once per supported database."""
    return str(request.getfixturevalue(_URL_FIXTURES[request.param]))


@pytest.fixture
def guard(db_url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(db_url)
    yield g
    g.dispose()


@pytest.fixture
def pg_guard(pg_url: str) -> Iterator[TaskGuard]:
    g = TaskGuard(pg_url)
    yield g
    g.dispose()


def _maria_url(database: str) -> str:
    return make_url(MARIADB_URL).set(database=database).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def maria_template() -> Iterator[str]:
    """Name of a migrated MariaDB template database (created once per test session)."""
    try:
        admin = maria_admin()
    except Exception as exc:
        if os.environ.get("TASKGUARD_ALLOW_NO_MARIADB") == "1":
            pytest.skip(f"MariaDB unreachable at {MARIADB_URL}: {exc}")
        pytest.fail(
            f"MariaDB is required at {MARIADB_URL} (set TASKGUARD_TEST_MARIADB_URL), "
            f"but it is unreachable: {exc}",
            pytrace=False,
        )
    name = f"tg_tpl_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{os.getpid()}"
    cur = admin.cursor()
    cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    cur.execute(f"CREATE DATABASE `{name}`")
    schema.upgrade(_maria_url(name))
    yield name
    cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    admin.close()


def new_maria_database(template: str | None) -> str:
    """Create a fresh MariaDB database (a copy of ``template``'s objects, or empty); its URL."""
    name = f"tg_{uuid.uuid4().hex[:12]}"
    admin = maria_admin()
    try:
        cur = admin.cursor()
        cur.execute(f"CREATE DATABASE `{name}`")
        if template:
            cur.execute(
                "SELECT TABLE_NAME, TABLE_TYPE FROM information_schema.TABLES"
                " WHERE TABLE_SCHEMA = %s",
                (template,),
            )
            objects = cur.fetchall()
            for table, kind in objects:
                if kind != "VIEW":  # tables and the sequence (a SEQUENCE copies as one)
                    cur.execute(f"CREATE TABLE `{name}`.`{table}` LIKE `{template}`.`{table}`")
            cur.execute(
                f"INSERT INTO `{name}`.taskguard_alembic_version"
                f" SELECT * FROM `{template}`.taskguard_alembic_version"
            )
            cur.execute(
                "SELECT TABLE_NAME, VIEW_DEFINITION FROM information_schema.VIEWS"
                " WHERE TABLE_SCHEMA = %s",
                (template,),
            )
            for view, definition in cur.fetchall():
                body = definition.replace(f"`{template}`.", f"`{name}`.")
                cur.execute(f"CREATE VIEW `{name}`.`{view}` AS {body}")
    finally:
        admin.close()
    return _maria_url(name)


@pytest.fixture
def maria_url(maria_template: str) -> Iterator[str]:
    """URL of a migrated, empty MariaDB database private to this test."""
    url = new_maria_database(maria_template)
    yield url
    drop_maria_database(url)


@pytest.fixture
def empty_maria_url(maria_template: str) -> Iterator[str]:
    """URL of an empty MariaDB database (no taskguard schema) private to this test."""
    url = new_maria_database(None)
    yield url
    drop_maria_database(url)
