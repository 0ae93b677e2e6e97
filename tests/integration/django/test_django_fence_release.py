"""Issue 41, defect 4: a Django view that fences inside a nested atomic block under
the request's transaction, then releases before that transaction commits, on
PostgreSQL, MariaDB and SQLite (shop/fence_views.py, run by Django's test runner in
the test project)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    MARIADB_URL,
    PG_URL,
    drop_maria_database,
    drop_pg_database,
    new_maria_database,
    new_pg_database,
)
from djangoproject import DjangoSite
from sqlalchemy.engine import make_url

pytestmark = pytest.mark.slow


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DjangoSite]:
    if request.param == "postgresql":
        request.getfixturevalue("pg_template")  # fails clearly without a server
        url = new_pg_database(None)
        yield DjangoSite("postgresql", str(make_url(url).database), pg_url=PG_URL)
        drop_pg_database(url)
    elif request.param == "mariadb":
        request.getfixturevalue("maria_template")
        url = new_maria_database(None)
        yield DjangoSite("mariadb", str(make_url(url).database), pg_url=MARIADB_URL)
        drop_maria_database(url)
    else:
        yield DjangoSite("sqlite", str(tmp_path / "site.sqlite"))


def test_a_view_releasing_inside_its_fenced_transaction(site: DjangoSite) -> None:
    out = site.manage("test", "shop.fence_views", "--noinput", "-v", "2", timeout=400)
    report = out.stderr
    assert "Ran 4 tests" in report and "\nOK" in report, report[-3000:]
