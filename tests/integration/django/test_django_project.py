"""taskguard.contrib.django in a real Django project (tests/integration/django/project),
on PostgreSQL and SQLite: migrate, system checks, ``manage.py taskguard``, and the
admin/fence/test-database scenarios run by Django's own test runner."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import (
    MARIADB_URL,
    PG_URL,
    drop_maria_database,
    drop_pg_database,
    new_maria_database,
    new_pg_database,
)
from djangoproject import REPO, DjangoSite, run
from schema_snapshot import snapshot
from sqlalchemy.engine import make_url

from taskguard import TaskGuard, schema

pytestmark = pytest.mark.slow


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DjangoSite]:
    """The project on an empty database of its own (nothing migrated)."""
    if request.param == "postgresql":
        request.getfixturevalue("pg_template")  # fails clearly without a server
        url = new_pg_database(None)
        yield DjangoSite("postgresql", str(make_url(url).database), pg_url=PG_URL)
        drop_pg_database(url)
    else:
        yield DjangoSite("sqlite", str(tmp_path / "site.sqlite"))


def _url(site: DjangoSite) -> str:
    if site.db == "postgresql":
        return make_url(PG_URL).set(database=site.name).render_as_string(hide_password=False)
    return f"sqlite:///{site.name}"


def test_migrate_creates_the_same_schema_as_db_upgrade(
    empty_site: DjangoSite, request: pytest.FixtureRequest
) -> None:
    empty_site.manage("migrate", "--noinput")
    if empty_site.db == "postgresql":
        reference = make_url(PG_URL).set(database=request.getfixturevalue("pg_template"))
    else:
        reference = make_url(f"sqlite:///{request.getfixturevalue('sqlite_template')}")
    via_django = snapshot(_url(empty_site))
    via_cli = snapshot(reference.render_as_string(hide_password=False))
    assert via_django == via_cli
    assert via_django["tables"], "no taskguard table was created"
    assert schema.current(_url(empty_site)) == [schema.head()]
    _manage_py_taskguard_works(empty_site)


def test_migrate_after_db_upgrade_changes_nothing_and_reverses(empty_site: DjangoSite) -> None:
    url = _url(empty_site)
    schema.upgrade(url)  # the project used `taskguard db upgrade` before switching
    before = snapshot(url)
    out = empty_site.manage("migrate", "--noinput").stdout
    assert "Applying taskguard.0001_initial... OK" in out
    assert snapshot(url) == before
    empty_site.manage("migrate", "taskguard", "zero", "--noinput")
    # As after `taskguard db downgrade`: only Alembic's (empty) version table is left.
    assert set(snapshot(url)["tables"]) <= {"taskguard_alembic_version"}
    assert schema.current(url) == []
    empty_site.manage("migrate", "--noinput")
    assert snapshot(url) == before


def test_the_latest_django_migration_reaches_alembic_head() -> None:
    latest = sorted((REPO / "taskguard/contrib/django/migrations").glob("0*.py"))[-1]
    assert f'AlembicUpgrade("{schema.head()}"' in latest.read_text(), (
        "add a Django migration upgrading to taskguard's newest Alembic revision"
    )


def _manage_py_taskguard_works(empty_site: DjangoSite) -> None:
    """``manage.py taskguard …`` on the migrated database (part of the test above:
    one migrate fewer)."""
    key = f"feed:https://example.com/{uuid.uuid4().hex[:6]}.rss"
    guard = TaskGuard(_url(empty_site))
    try:
        lease = guard.acquire(key, ttl=60, task_name="feeds.import_feed", hostname="w1", pid=7)
        assert lease is not None
        rows = json.loads(empty_site.manage("taskguard", "locks", "--json").stdout)
        assert [(r["key"], r["task_name"], r["token"]) for r in rows] == [
            (key, "feeds.import_feed", lease.token)
        ]
        shown = json.loads(empty_site.manage("taskguard", "show", key, "--json").stdout)
        assert shown[0]["owner"] == lease.owner
        missing = empty_site.manage("taskguard", "show", "nope", check=False)
        assert missing.returncode == 1
        assert missing.stderr.startswith("taskguard: no lock row for 'nope'")
        current = empty_site.manage("taskguard", "db", "current").stdout
        assert current.startswith(schema.head())
    finally:
        guard.dispose()


def test_system_checks_catch_a_bad_alias(tmp_path: Path) -> None:
    site = DjangoSite("sqlite", str(tmp_path / "site.sqlite"))
    assert "no issues" in site.manage("check").stdout
    # The app's migration matches its models (Django would otherwise ask for a new one).
    assert "No changes detected" in site.manage("makemigrations", "--check", "--dry-run").stdout
    site.extra = {"TASKGUARD_DATABASE_ALIAS": "locks", "TASKGUARD_HISTROY": True}
    bad = site.manage("check", check=False)
    assert bad.returncode != 0
    assert "(taskguard.E001) TASKGUARD_DATABASE_ALIAS = 'locks' is not a DATABASES alias" in (
        bad.stderr
    )
    assert "HINT: set TASKGUARD_DATABASE_ALIAS to one of: 'default'" in bad.stderr
    assert "(taskguard.W001) unknown taskguard setting TASKGUARD_HISTROY" in bad.stderr
    assert "did you mean TASKGUARD_HISTORY?" in bad.stderr
    # The command line says the same in one line instead of a traceback.
    cli = site.manage("taskguard", "locks", check=False)
    assert cli.returncode == 2
    assert "TASKGUARD_DATABASE_ALIAS = 'locks' is not in DATABASES" in cli.stderr
    assert "Traceback" not in cli.stderr


def test_scenarios_under_djangos_test_runner(empty_site: DjangoSite) -> None:
    """Admin pages, audited force-release, permission refusal, fence with the ORM and
    locks following the test database (shop/scenarios.py)."""
    out = empty_site.manage("test", "shop.scenarios", "--noinput", "-v", "2", timeout=400)
    report = out.stderr
    assert "Ran 19 tests" in report and "\nOK" in report, report[-3000:]
    if empty_site.db == "postgresql":
        with psycopg.connect(
            make_url(PG_URL).set(drivername="postgresql").render_as_string(False)
        ) as c:
            left = c.execute(
                "SELECT count(*) FROM pg_database WHERE datname = %s", (f"test_{empty_site.name}",)
            ).fetchone()
        assert left == (0,), "the test database was not dropped"
    else:
        assert not Path(empty_site.name + "-test").exists()


def test_locking_off_under_djangos_test_runner(tmp_path: Path) -> None:
    site = DjangoSite("sqlite", str(tmp_path / "site.sqlite"))
    env = site.env()
    env["TASKGUARD_LOCKING"] = "off"
    out = run([sys.executable, "manage.py", "test", "shop.scenarios_off", "--noinput"], env)
    assert "Ran 1 test" in out.stderr and "\nOK" in out.stderr, out.stderr[-3000:]


def test_a_project_on_mariadb_with_djangos_mysql_engine(maria_template: str) -> None:
    """Issue 27, item 2: ``ENGINE: django.db.backends.mysql`` on MariaDB passes the
    checks, ``migrate`` creates the lock tables, and the admin, fence and test
    database scenarios pass under Django's test runner; ``mysql://`` and
    ``mariadb://`` in ``TASKGUARD_DATABASE_URL`` are accepted too."""
    url = new_maria_database(None)
    site = DjangoSite("mariadb", str(make_url(url).database), pg_url=MARIADB_URL)
    try:
        assert "no issues" in site.manage("check").stdout
        site.manage("migrate", "--noinput")
        assert schema.current(url) == [schema.head()]
        guard = TaskGuard(url)
        try:
            lease = guard.acquire("feed:maria", ttl=3600, task_name="feeds.import_feed")
            assert lease is not None
            rows = json.loads(site.manage("taskguard", "locks", "--json").stdout)
            assert [(r["key"], r["token"]) for r in rows] == [("feed:maria", lease.token)]
        finally:
            guard.dispose()
        out = site.manage("test", "shop.scenarios", "--noinput", "-v", "2", timeout=400)
        assert "Ran 19 tests" in out.stderr and "\nOK" in out.stderr, out.stderr[-3000:]
        server = make_url(MARIADB_URL).set(database=site.name, query={})
        for scheme in ("mysql", "mariadb"):
            as_url = server.set(drivername=scheme).render_as_string(hide_password=False)
            site.extra = {"TASKGUARD_DATABASE_URL": as_url}
            assert "no issues" in site.manage("check").stdout, scheme
            listed = json.loads(site.manage("taskguard", "locks", "--json").stdout)
            assert [r["key"] for r in listed] == ["feed:maria"], scheme
    finally:
        drop_maria_database(url)
