"""The README, from a fresh checkout into a fresh virtualenv, command by command:

1. ``pip install . && taskguard demo`` (the README's "See it work" command);
2. ``taskguard demo --broker redis://...`` before the redis extra: one line naming it;
3. the Quickstart's install line, ``pip install ".[redis]"``, then the demo on Redis;
4. the Quickstart after it: its tasks.py, ``taskguard db upgrade``, ``celery -A tasks
   worker --concurrency 2`` (a real prefork worker from that virtualenv) and its two
   submissions of one feed: one ran, one was skipped.

One virtualenv for the module, grown by the README's own install lines (the tests
run in file order: the plain install first, so that step 2 finds no redis extra).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.blocks import REPO, Block, blocks
from tests.docs.pages import PAGES, QUICKSTART_CALLS
from tests.docs.plugin import runs
from tests.docs.runner import Page, Service
from tests.journey.venvs import UserVenv, checkout
from tests.services import redis_db

pytestmark = [pytest.mark.journey, pytest.mark.celery, pytest.mark.timeout(900)]

README = REPO / "README.md"
#: tests/services.py: the journeys' Redis database
JOURNEY_REDIS = 10


def _block(heading: str, starts: str) -> Block:
    """The README's block under ``heading`` whose text starts with ``starts``."""
    found = [
        b for b in blocks(README) if b.heading.startswith(heading) and b.source.startswith(starts)
    ]
    assert len(found) == 1, f"README.md: one block under {heading!r} starting {starts!r}"
    return found[0]


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UserVenv, Path]]:
    base = tmp_path_factory.mktemp("newcomer")
    src = checkout(base / "taskguard")
    yield UserVenv(base / "venv"), src


def test_first_command_installs_and_runs_the_demo(newcomer: tuple[UserVenv, Path]) -> None:
    env, src = newcomer
    command = _block("See it work", "pip install .").source.strip()
    assert command == "pip install . && taskguard demo"
    out = env.must(command, cwd=src)
    assert "OK: no feed was imported twice at once" in out, out
    # The installed package, not the checkout, is what ran.
    assert env.installed_from("taskguard", cwd=src.parent).startswith(str(env.path))


def test_demo_on_redis_without_the_extra_names_it(newcomer: tuple[UserVenv, Path]) -> None:
    """README: ``--broker redis://...`` needs ``pip install ".[redis]"``; before it,
    one line says so (issue 27, item 6)."""
    env, src = newcomer
    broker = redis_db(JOURNEY_REDIS)
    done = env.run(f"taskguard demo --broker {broker} --waves 1", cwd=src.parent)
    assert done.returncode != 0, done.stdout
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "[redis]" in lines[0], done.stderr


def test_quickstart_install_line_then_demo_on_redis(newcomer: tuple[UserVenv, Path]) -> None:
    env, src = newcomer
    install = _block("Quickstart", "pip install").source.strip()
    assert shlex.split(install) == ["pip", "install", ".[redis]"]
    env.must(install, cwd=src)
    broker = redis_db(JOURNEY_REDIS)
    out = env.must(f"taskguard demo --broker {broker} --waves 1", cwd=src.parent)
    assert "OK: no feed was imported twice at once" in out, out


def test_quickstart_runs_in_that_virtualenv(newcomer: tuple[UserVenv, Path]) -> None:
    """The Quickstart's blocks as written (Redis mapped to the journeys' database), in
    the virtualenv its install line made: two submissions of one feed, one ran and one
    was skipped (tests/docs/pages.py checks the printout), by that virtualenv's worker,
    which logged the conflict with its holder."""
    env, _ = newcomer
    spec = PAGES["README.md"]
    redis = {
        url: Service("redis", JOURNEY_REDIS) for url, s in spec.urls.items() if s.kind == "redis"
    }
    page = Page(README, dataclasses.replace(spec, urls={**spec.urls, **redis}), python=env.python)
    page.open()
    try:
        quickstart = [b for b in runs(README) if b.heading == "Quickstart"]
        assert [b.kind for b in quickstart] == ["file", "bash", "python"]
        assert QUICKSTART_CALLS in quickstart[-1].source
        for block in quickstart:
            page.run(block)  # the README's check of the printout runs with it
        log = page.background_log()
        assert page.background_command_line().startswith(str(env.bin))
        assert str(env.path) in page.python("import celery; print(celery.__file__)")
        key = "feed:https://example.com/feeds/news.rss"
        assert re.search(rf"lock '{re.escape(key)}' is held by", log), log[-3000:]
    finally:
        page.close()
