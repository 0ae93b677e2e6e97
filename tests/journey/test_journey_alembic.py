"""docs/alembic.md as a team adopting taskguard into an app with Alembic follows it:
way 1, then the switch to way 2, and way 2 from the start, each followed by what
comes next in a deploy: ``taskguard check`` and a worker start.

The page's blocks run exactly as in tests/docs (the same runner and mapping); after
each way the README Quickstart's tasks.py (its URLs mapped to the shop database and
the journeys' Redis database) is started with ``celery -A tasks worker`` and runs a
guarded task.
"""

from __future__ import annotations

import re

import pytest

from tests.docs.blocks import REPO, Block
from tests.docs.pages import PAGES, QUICKSTART_DB, SHOP
from tests.docs.plugin import runs
from tests.docs.runner import BACKGROUND, Page
from tests.services import redis_db

pytestmark = [pytest.mark.journey, pytest.mark.celery, pytest.mark.postgres]

ALEMBIC = REPO / "docs" / "alembic.md"
#: tests/services.py: this journey's Redis database
JOURNEY_REDIS = 9
FEED = "https://example.com/feeds/news.rss"


def _quickstart_tasks(page: Page) -> str:
    """The README's tasks.py on this page's database and the journey's Redis."""
    [tasks] = [b for b in runs(REPO / "README.md") if b.kind == "file"]
    broker = redis_db(JOURNEY_REDIS)
    text = tasks.body.replace(QUICKSTART_DB, page.urls[SHOP])
    return re.sub(r"redis://127\.0\.0\.1:6379/\d+", broker, text)


def _deploy_checks(page: Page, when: str) -> None:
    """``taskguard check``, then a worker starts and runs a guarded task."""
    done = page.shell(f"taskguard check --database-url {page.urls[SHOP]}")
    assert done.returncode == 0, f"after {when}: taskguard check: {done.stdout}{done.stderr}"
    assert ": ok" in done.stdout, done.stdout
    (page.dir / "tasks.py").write_text(_quickstart_tasks(page))
    [(_, ready)] = BACKGROUND.items()
    page.start("celery -A tasks worker", ready)
    out = page.python(
        "import importlib, tasks\n"
        "importlib.reload(tasks)\n"
        f"print(tasks.import_feed.delay({FEED!r}).get(timeout=60))\n"
    )
    assert out.strip() == f"imported {FEED}", f"after {when}: {out}"
    page.stop_background()


def _run(page: Page, todo: list[Block]) -> None:
    for block in todo:
        page.run(block)


def test_way_1_then_the_switch_to_way_2() -> None:
    page = Page(ALEMBIC, PAGES["docs/alembic.md"], "way1").open()
    try:
        blocks = runs(ALEMBIC, "way1")
        switch = next(i for i, b in enumerate(blocks) if b.heading.startswith("Switching"))
        _run(page, blocks[:switch])
        _deploy_checks(page, "way 1")
        _run(page, blocks[switch:])
        _deploy_checks(page, "switching to way 2")
    finally:
        page.close()


def test_way_2() -> None:
    page = Page(ALEMBIC, PAGES["docs/alembic.md"], "way2").open()
    try:
        _run(page, runs(ALEMBIC, "way2"))
        _deploy_checks(page, "way 2")
    finally:
        page.close()
