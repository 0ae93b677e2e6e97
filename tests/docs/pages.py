"""How each page runs: the mapping of its URLs to private services, its scenarios,
and the checks on what some of its blocks print.

A page not listed here runs with no mapping (its blocks need no service).
"""

from __future__ import annotations

import re

from tests.docs.runner import Page, PageSpec, Service

# -- README.md: the Quickstart's two submissions of one feed: one ran, one skipped ----

#: The lock database of the README's tasks.py (a journey moves it elsewhere).
QUICKSTART_DB = "sqlite:///locks.db"
QUICKSTART_CALLS = "calls = [import_feed.delay(url), import_feed.delay(url)]"


def _one_ran_one_skipped(page: Page, out: str) -> None:
    lines = sorted(out.split("\n")[:-1])
    assert lines == [
        "imported https://example.com/feeds/news.rss",
        "skipped: another worker is importing it",
    ], out


# -- docs/operations.md: the SQL section's queries find the holders it names ----------

OPS_KEY = "invoice:42"


def _ops_locks(page: Page) -> None:
    """Live locks for the page's queries to find: the example key and others."""
    from taskguard import TaskGuard

    guard = TaskGuard(str(page.sql_url))
    try:
        lease = guard.acquire(OPS_KEY, 300, task_name="billing.charge", task_id="t-42")
        assert lease is not None
        page.notes["owner"] = lease.owner
        assert guard.acquire("invoice:43", 300, task_name="billing.charge")
        assert guard.acquire("report:1", 300, task_name="reports.build", hostname="w2")
        assert guard.acquire("invoice:old", 0.001, task_name="billing.charge")
    finally:
        guard.dispose()


def _owner_shown(page: Page, out: str) -> None:
    assert page.notes["owner"] in out and "billing.charge" in out, out


def _per_task(page: Page, out: str) -> None:
    assert re.search(r"billing\.charge\s*\|\s*2\b", out), out


def _reapable(page: Page, out: str) -> None:
    # invoice:old expired (but within the 300 s grace): expired 1, reapable 0
    assert re.search(r"^\s*1\s*\|\s*0\s*\|", out, flags=re.M), out


def _force_released(page: Page, out: str) -> None:
    from taskguard import TaskGuard

    assert page.notes["owner"] in out, out
    guard = TaskGuard(str(page.sql_url))
    try:
        info = guard.get(OPS_KEY)
        assert info is not None and not info.held, info
    finally:
        guard.dispose()


# -- docs/alembic.md: the reader's own revision is based on their head -------------

SHOP = "postgresql+psycopg://app@127.0.0.1:5432/shop"
OWN_REVISION = 'alembic revision -m "add notes to orders" --head 5f2c1a9d0e11'


def _own_revision(page: Page, out: str) -> None:
    [path] = (page.dir / "migrations" / "versions").glob("*_add_notes_to_orders.py")
    assert re.search(r"^down_revision\b.*5f2c1a9d0e11", path.read_text(), re.M), path.read_text()


PAGE_PG = "postgresql+psycopg://app@db/app"

PAGES: dict[str, PageSpec] = {
    "docs/getting-started.md": PageSpec(
        urls={
            PAGE_PG: Service("pg+schema"),
            "redis://localhost:6379/0": Service("redis", 6),
            "redis://localhost:6379/1": Service("redis", 6),
        },
    ),
    "docs/options.md": PageSpec(
        urls={
            PAGE_PG: Service("pg+schema"),
            "redis://localhost:6379/0": Service("redis", 12),
            "redis://localhost:6379/1": Service("redis", 12),
        },
    ),
    "docs/behaviour.md": PageSpec(
        urls={
            PAGE_PG: Service("pg+schema"),
            "redis://localhost:6379/0": Service("redis", 7),
            "redis://localhost:6379/1": Service("redis", 7),
        },
    ),
    "docs/django-tasks.md": PageSpec(urls={PAGE_PG: Service("pg+schema")}),
    "docs/dramatiq.md": PageSpec(urls={PAGE_PG: Service("pg+schema")}),
    "docs/mariadb.md": PageSpec(urls={"mysql://app:secret@db:3306/app": Service("maria")}),
    "docs/alembic.md": PageSpec(
        urls={SHOP: Service("pg")},
        sql=SHOP,
        # Each way from the example application on; the switch continues way 1.
        scenarios={
            "way1": ("The example application", "Way 1", "Switching from way 1 to way 2"),
            "way2": ("The example application", "Way 2"),
        },
        checks={OWN_REVISION: _own_revision},
        run_by="tests/journey/test_journey_alembic.py",
    ),
    "README.md": PageSpec(
        urls={
            "redis://127.0.0.1:6379/0": Service("redis", 14),
            "redis://127.0.0.1:6379/1": Service("redis", 15),
        },
        checks={QUICKSTART_CALLS: _one_ran_one_skipped},
    ),
    "docs/operations.md": PageSpec(
        sql=Service("pg+schema"),
        setup=_ops_locks,
        checks={
            "FROM task_locks_held\nWHERE key = 'invoice:42'": _owner_shown,
            "AS expired_since": _owner_shown,
            "GROUP BY 1": _per_task,
            "AS reapable": _reapable,
            "SET expires_at = statement_timestamp()": _force_released,
        },
    ),
}
