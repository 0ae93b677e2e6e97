"""examples/djangofeeds as its README says to run it, from a fresh checkout into a
fresh virtualenv (the README's install line), on SQLite, PostgreSQL and MariaDB:

- SQLite: the embedded default, ``python manage.py import_feeds``;
- PostgreSQL: the README's command (Redis broker and results), then separate
  workers as the README says: ``celery -A feedsite worker -Q djangofeeds`` and
  ``python manage.py import_feeds --no-worker --feeds 1``;
- MariaDB: the same with ``DJANGOFEEDS_DATABASE=mysql://...``, i.e. Django's
  ``django.db.backends.mysql`` ENGINE (after the README's MariaDB install line,
  the extra docs/mariadb.md names);

each followed by ``python manage.py taskguard explain`` for one feed: acquired and
released, and no normal hand-over reported as a crash ("taken over"). The embedded
run prints its table without the expected skips' WARNING lines before it (they go
to ``var/import_feeds.log``).

The README's URLs are rewritten like the docs' (tests/docs/runner.py): its database
to a private one, its Redis databases to this journey's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.blocks import REPO, blocks
from tests.docs.runner import BACKGROUND, Page, PageSpec, Service, commands
from tests.journey.venvs import UserVenv, checkout

pytestmark = [pytest.mark.journey, pytest.mark.celery, pytest.mark.timeout(900)]

EXAMPLE_README = REPO / "examples" / "djangofeeds" / "README.md"
#: tests/services.py: this journey's Redis database
JOURNEY_REDIS = 8
README_PG = "postgresql://postgres@127.0.0.1:5432/djangofeeds"
README_MARIADB = "mysql://root@127.0.0.1:3306/djangofeeds"
OK = "OK: every feed was imported by one worker at a time"
FEED_KEY = "feed:https://example.com/feeds/0.rss"


def _installs() -> list[str]:
    """The README's install-from-a-checkout lines: the page's own, then MariaDB's."""
    text = EXAMPLE_README.read_text()
    install = [line for line in text.split("`") if line.startswith("pip install -e ")]
    assert len(install) == 2 and "mysql" in install[1], install
    return install


def _commands() -> tuple[str, str, str]:
    """The README's install line, its embedded-default command and its PostgreSQL one."""
    text = EXAMPLE_README.read_text()
    install = _installs()
    runs = [" ".join(commands(b.source)) for b in blocks(EXAMPLE_README, text)]
    assert runs[0] == "python manage.py import_feeds", runs
    assert README_PG in runs[1] and runs[1].endswith("python manage.py import_feeds"), runs
    return install[0], runs[0], runs[1]


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UserVenv, Path]]:
    base = tmp_path_factory.mktemp("djangofeeds")
    src = checkout(base / "taskguard")
    env = UserVenv(base / "venv")
    here = src / "examples" / "djangofeeds"
    install, _, _ = _commands()
    env.must(install, cwd=here)
    yield env, here


def _page(env: UserVenv, here: Path, database: str, service: Service) -> Page:
    spec = PageSpec(
        urls={
            database: service,
            "redis://127.0.0.1:6379/0": Service("redis", JOURNEY_REDIS),
            "redis://127.0.0.1:6379/1": Service("redis", JOURNEY_REDIS),
        },
        timeout=300,
    )
    return Page(EXAMPLE_README, spec, python=env.python, directory=here).open()


def _explain(page: Page, env_prefix: str = "") -> None:
    done = page.shell(f'{env_prefix}python manage.py taskguard explain "{FEED_KEY}" --limit 1000')
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "acquired" in out and "released" in out, out
    assert "taken over" not in out, f"a normal hand-over reported as a crash:\n{out}"


def _separate_workers(page: Page, env_prefix: str) -> None:
    """The README: `celery -A feedsite worker -Q djangofeeds` with the same
    environment, and `python manage.py import_feeds --no-worker --feeds 1`."""
    [(_, ready)] = BACKGROUND.items()
    page.start(f"{env_prefix}celery -A feedsite worker -Q djangofeeds", ready)
    done = page.shell(f"{env_prefix}python manage.py import_feeds --no-worker --feeds 1")
    assert done.returncode == 0 and OK in done.stdout, done.stdout + done.stderr
    log = page.background_log()
    assert "is held by owner" in log, log[-3000:]  # conflicts logged with the holder
    page.stop_background()


def test_sqlite_embedded_default(example: tuple[UserVenv, Path]) -> None:
    env, here = example
    _, embedded, _ = _commands()
    page = Page(EXAMPLE_README, PageSpec(timeout=300), python=env.python, directory=here).open()
    try:
        done = page.shell(embedded)
        assert done.returncode == 0 and OK in done.stdout, done.stdout + done.stderr
        assert (here / "var" / "djangofeeds.sqlite3").is_file()
        # The expected skips are logged to a file, not printed before the table.
        assert "is held by" not in done.stderr, done.stderr[-3000:]
        assert "is held by owner" in (here / "var" / "import_feeds.log").read_text()
        _explain(page)
    finally:
        page.close()


def test_postgresql_with_redis(example: tuple[UserVenv, Path]) -> None:
    env, here = example
    _, _, postgres = _commands()
    page = _page(env, here, README_PG, Service("pg"))
    try:
        command = page.map(postgres)
        done = page.shell(command)
        assert done.returncode == 0 and OK in done.stdout, done.stdout + done.stderr
        env_prefix = command.rsplit("python manage.py", 1)[0]
        _separate_workers(page, env_prefix)
        _explain(page, env_prefix)
    finally:
        page.close()


def test_mariadb_with_the_mysql_engine(example: tuple[UserVenv, Path]) -> None:
    env, here = example
    env.must(_installs()[1], cwd=here)
    _, _, postgres = _commands()
    page = _page(env, here, README_MARIADB, Service("maria"))
    try:
        command = page.map(postgres.replace(README_PG, README_MARIADB))
        env_prefix = command.rsplit("python manage.py", 1)[0]
        done = page.shell(command)
        assert done.returncode == 0 and OK in done.stdout, done.stdout + done.stderr
        engine = page.shell(
            f"{env_prefix}python manage.py shell -c "
            "'from django.db import connection; print(connection.vendor, connection.mysql_is_mariadb)'"
        )
        # (Django 5.2's shell may first say what it imported automatically.)
        assert engine.stdout.split()[-2:] == ["mysql", "True"], engine.stdout + engine.stderr
        _separate_workers(page, env_prefix)
        _explain(page, env_prefix)
    finally:
        page.close()
