"""The three migration guides (docs/migrating-from-celery-once.md, -celery-singleton.md,
-the-cookbook.md), each as a user follows it (issue 33): a fresh virtualenv with
taskguard installed from a checkout and the peer, the guide's own configuration block
(its URL replaced by the test database's) and nothing else: no
``taskguard_database_url`` for the compat guides, no ``TASKGUARD_*`` variable in any
process. ``taskguard db upgrade``, then a real prefork worker with ``-B`` and the
reaper scheduled as the guides say (``taskguard.schedule_reaper(app, every=…)``): it
starts (the start-up check logs ``ok``), a duplicate is refused, the lock ends with
the run, and the beat reaper removes the row. Each guide on one of PostgreSQL,
MariaDB and SQLite (CASES).

One virtualenv for the session, shared by all the cases.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from taskguard import TaskGuard
from tests import services
from tests.docs.blocks import REPO, blocks
from tests.journey.venvs import UserVenv, checkout

pytestmark = [pytest.mark.journey, pytest.mark.celery, pytest.mark.timeout(600)]

#: tests/services.py: the migration journeys' Redis database (broker and results).
JOURNEY_REDIS = 1
#: The URL the guides' blocks name.
GUIDE_URL = "postgresql+psycopg://app@db/app"
#: Seconds between the reaper's runs, as the journeys schedule it.
REAP_EVERY = 2

ONCE_TASK = '''
import time

from celery_once import QueueOnce


@app.task(base=QueueOnce, once={"keys": ["feed_url"]})
def import_feed(feed_url):
    time.sleep(4)
    return "imported " + feed_url


def duplicate(feed_url):
    """Publish a second copy: refused (celery-once raises AlreadyQueued)."""
    from celery_once import AlreadyQueued

    try:
        import_feed.delay(feed_url)
    except AlreadyQueued as exc:
        return f"refused, {exc.countdown:.0f}s left"
    return "accepted"
'''

SINGLETON_TASK = '''
import time

from celery_singleton import Singleton


@app.task(base=Singleton)
def import_feed(feed_url):
    time.sleep(4)
    return "imported " + feed_url


def duplicate(feed_url):
    """Publish a second copy: answered with the running copy (its id)."""
    return "refused, answered with the holder" if import_feed.delay(feed_url).id == FIRST[0] \\
        else "accepted"
'''

COOKBOOK_TASK = '''
import time
from hashlib import md5


@app.task(bind=True)
def import_feed(self, feed_url):
    lock_id = "{0}-lock-{1}".format(self.name, md5(feed_url.encode()).hexdigest())
    with memcache_lock(lock_id, self.app.oid) as acquired:
        if acquired:
            time.sleep(4)
            return "imported " + feed_url
    return "already being imported"


def duplicate(feed_url):
    """Run a second copy: the worker's second process finds the lock taken."""
    return import_feed.delay(feed_url).get(timeout=60)
'''

GUIDES: dict[str, tuple[str, str]] = {
    "celery_once": ("migrating-from-celery-once.md", ONCE_TASK),
    "celery_singleton": ("migrating-from-celery-singleton.md", SINGLETON_TASK),
    "cookbook": ("migrating-from-the-cookbook.md", COOKBOOK_TASK),
}


def _configuration(guide: str) -> str:
    """The guide's Step 1 configuration block, as written."""
    page = REPO / "docs" / GUIDES[guide][0]
    found = [
        b
        for b in blocks(page)
        if b.heading == "Step 1: switch the store"
        and b.language == "python"
        and b.marker is None
        and 'app = Celery("proj")' in b.source
    ]
    assert len(found) == 1, f"{page.name}: one configuration block in Step 1"
    return found[0].source


@pytest.fixture(scope="session")
def migrator(tmp_path_factory: pytest.TempPathFactory) -> tuple[UserVenv, str]:
    """A virtualenv with taskguard from a fresh checkout (Redis and MariaDB extras) and both
    peers."""
    base = tmp_path_factory.mktemp("migrator")
    src = checkout(base / "taskguard")
    env = UserVenv(base / "venv")
    env.must(f'pip install "{src}[redis,mysql]" celery-once celery-singleton', cwd=base)
    return env, services.redis_db(JOURNEY_REDIS)  # emptied once: a queue per case


@pytest.fixture
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database (no taskguard schema: the guide's ``db upgrade`` makes it)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.sqlite'}"
        return
    if request.param == "mariadb":
        url = services.new_maria_database("tgmig")
        yield url
        services.drop_maria_database(url)
    else:
        url = services.new_pg_database("tgmig", None)
        yield url
        services.drop_pg_database(url)


def _app_module(guide: str, url: str, broker: str, queue: str) -> str:
    configuration = _configuration(guide).replace(GUIDE_URL, url)
    if guide == "cookbook":
        # The recipe's guard_for(app) reads the app's taskguard_database_url.
        configuration += f"\napp.conf.taskguard_database_url = {url!r}\n"
    return (
        configuration
        + f"""
# -- the journey's own: broker, queue, and the reaper as the guides schedule it
import taskguard

app.conf.update(
    broker_url={broker!r},
    result_backend={broker!r},
    task_default_queue={queue!r},
    broker_connection_retry_on_startup=True,
)
taskguard.schedule_reaper(app, every={REAP_EVERY}, grace=0)
FIRST = []
"""
        + GUIDES[guide][1]
    )


def _wait_for(
    predicate: Callable[[], Any], what: str, log: Callable[[], str], t: float = 60
) -> Any:
    deadline = time.monotonic() + t
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {t}s waiting for {what}\n{log()[-4000:]}")


#: Each guide on one database, each database under one guide: what differs between
#: the databases is the store's, which the store suites run on all three.
CASES = [("celery_once", "postgresql"), ("celery_singleton", "mariadb"), ("cookbook", "sqlite")]


@pytest.mark.parametrize(
    ("guide", "empty_database"), CASES, indirect=["empty_database"], ids=[g for g, _ in CASES]
)
def test_a_migration_guide_alone(
    guide: str, empty_database: str, migrator: tuple[UserVenv, str], tmp_path: Path
) -> None:
    env, broker = migrator
    url = empty_database
    env.must(f"taskguard db upgrade --database-url '{url}'", cwd=tmp_path)
    queue = f"tg-migrate-{uuid.uuid4().hex[:8]}"
    (tmp_path / "proj.py").write_text(_app_module(guide, url, broker, queue))
    clean = {k: v for k, v in env.env().items() if not k.startswith("TASKGUARD_")}
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log_file:
        worker = subprocess.Popen(
            [
                "celery",
                "-A",
                "proj",
                "worker",
                "-B",
                "-P",
                "prefork",
                "-c",
                "2",
                "-l",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-s",
                str(tmp_path / "beat-schedule"),
            ],
            cwd=tmp_path,
            env=clean,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    log = log_path.read_text
    guard = TaskGuard(url)
    try:
        _wait_for(lambda: "ready." in log() or worker.poll() is not None, "the worker", log)
        assert worker.poll() is None, f"the worker exited {worker.returncode}:\n{log()[-4000:]}"
        assert ": ok (schema at " in log(), log()[-4000:]

        feed = "https://example.com/feeds/news.rss"
        script = f"""
import json, proj
first = proj.import_feed.delay({feed!r})
proj.FIRST.append(first.id)
import time; time.sleep(0.5)
second = proj.duplicate({feed!r})
print(json.dumps([second, first.get(timeout=60)]))
"""
        out = subprocess.run(
            [str(env.python), "-c", script], cwd=tmp_path, env=clean, capture_output=True,
            text=True, timeout=120, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-4000:] + log()[-4000:]
        second, first = json.loads(out.stdout.strip().splitlines()[-1])
        assert first == f"imported {feed}", log()[-4000:]
        assert second.startswith(("refused", "already being imported")), second

        # Released at the end of the run; the row stays until the beat reaper removes it.
        _wait_for(lambda: guard.held() == [], "the release", log, t=20)
        _wait_for(lambda: guard.held(include_expired=True) == [], "the beat reaper", log, t=30)
        assert "reaper removed" in log() and "raised unexpected" not in log(), log()[-4000:]
    finally:
        guard.dispose()
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
