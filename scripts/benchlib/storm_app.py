"""The Celery app the storm benchmark's worker runs (configured by environment).

One feed importer (``import_feed(feed_url)``: sleep for the work, then record the
run) under every lock the storm compares: none; the Celery docs' cookbook recipe
(``cache.add`` on Django's cache, backed by a private memcached); celery-once's
``QueueOnce``; celery-singleton's ``Singleton``; taskguard's ``@guarded_task`` with
``lock="run"``, ``lock="queue_and_run"`` and ``on_conflict="coalesce"``. Two more run longer than their lock's
expiry: the recipe with a 1 s expiry and ``lock="run"`` with a 1 s ttl.

Each body records its run (feed, start, end; ``time.monotonic()``, one clock for every
process on the host) in a Redis list, and every finished delivery, run or skipped,
bumps one counter per task: that is how the benchmark knows when the storm has
drained and how many duplicates reached the worker only to be skipped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import django
import redis
from celery import Celery, Task
from celery.signals import task_postrun
from celery_once import QueueOnce
from celery_singleton import Singleton
from django.conf import settings

from taskguard import guarded_task

BROKER = os.environ.get("TGBENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
QUEUE = os.environ.get("TGBENCH_STORM_QUEUE", "tgbench.storm")
DB_URL = os.environ.get("TGBENCH_STORM_DB_URL", "")
REDIS_URL = os.environ.get("TGBENCH_STORM_REDIS_URL", "redis://127.0.0.1:6379/12")
MEMCACHED = os.environ.get("TGBENCH_STORM_MEMCACHED", "127.0.0.1:11211")
PREFIX = os.environ.get("TGBENCH_STORM_PREFIX", "tgbench:storm:")

#: One feed import's work (seconds): a fetch and a few writes, spent waiting.
WORK = 0.02
#: Lock lifetime of the queue-phase libraries and of taskguard in the storm.
TTL = 60
#: The cookbook's own lock expiry (10 minutes).
RECIPE_EXPIRE = 600
#: The cookbook keeps the lock (lets it expire) when the run ends this close to its expiry.
RECIPE_MARGIN = 3.0
#: The overrun case: runs of LONG_WORK seconds under a lock of LONG_EXPIRE seconds.
LONG_WORK = 1.5
LONG_EXPIRE = 1

app = Celery("tgbench_storm", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    taskguard_database_url=DB_URL,
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": REDIS_URL, "default_timeout": TTL},
    },
    singleton_backend_url=REDIS_URL,
    singleton_key_prefix=f"{PREFIX}singleton:",
    singleton_lock_expiry=TTL,
)

if not settings.configured:
    settings.configure(
        CACHES={
            "default": {
                "BACKEND": "django.core.cache.backends.memcached.PyMemcacheCache",
                "LOCATION": MEMCACHED,
                "KEY_PREFIX": PREFIX,
            }
        },
        USE_TZ=True,
    )
    django.setup()

from django.core.cache import cache  # noqa: E402  (needs the settings above)

log = logging.getLogger(__name__)

PLAIN = f"{PREFIX}plain"
RECIPE = f"{PREFIX}recipe"
ONCE = f"{PREFIX}once"
SINGLETON = f"{PREFIX}singleton"
RUN = f"{PREFIX}run"
QUEUE_AND_RUN = f"{PREFIX}queue_and_run"
COALESCE = f"{PREFIX}coalesce"
RECIPE_LONG = f"{PREFIX}recipe_long"
RUN_LONG = f"{PREFIX}run_long"

_redis: redis.Redis | None = None


def _client() -> redis.Redis:
    global _redis
    if _redis is None:  # one client per worker process, made after the fork
        _redis = redis.Redis.from_url(REDIS_URL)
    return _redis


def runs_key(task_name: str) -> str:
    return f"{task_name}:runs"


def done_key(task_name: str) -> str:
    return f"{task_name}:done"


def _import(task_name: str, feed_url: str, seconds: float) -> None:
    started = time.monotonic()
    time.sleep(seconds)
    ended = time.monotonic()
    _client().rpush(runs_key(task_name), f"{feed_url} {started!r} {ended!r}")


# -- the cookbook recipe, as its text describes it -------------------------------------


@contextmanager
def memcache_lock(lock_id: str, owner: str, expire: int) -> Iterator[bool]:
    """``cache.add`` (atomic on memcached) takes the lock; it is deleted at the end only
    by its taker, and only while comfortably inside its expiry, so an expired lock that
    someone else has taken since is not deleted."""
    give_back_before = time.monotonic() + expire - RECIPE_MARGIN
    acquired = bool(cache.add(lock_id, owner, expire))
    try:
        yield acquired
    finally:
        if acquired and time.monotonic() < give_back_before:
            cache.delete(lock_id)


def _recipe(task: Task, feed_url: str, expire: int, seconds: float) -> None:
    digest = hashlib.md5(feed_url.encode()).hexdigest()
    lock_id = f"{task.name}-lock-{digest}"
    with memcache_lock(lock_id, task.app.oid, expire) as acquired:
        if acquired:
            _import(task.name, feed_url, seconds)
            return
    log.debug("feed %s is already being imported by another worker", feed_url)


# -- the variants ---------------------------------------------------------------------------


@app.task(name=PLAIN)
def plain(feed_url: str) -> None:
    _import(PLAIN, feed_url, WORK)


@app.task(bind=True, name=RECIPE)
def recipe(self: Task, feed_url: str) -> None:
    _recipe(self, feed_url, RECIPE_EXPIRE, WORK)


@app.task(name=ONCE, base=QueueOnce, once={"graceful": True, "timeout": TTL})
def once(feed_url: str) -> None:
    _import(ONCE, feed_url, WORK)


@app.task(name=SINGLETON, base=Singleton, lock_expiry=TTL)
def singleton(feed_url: str) -> None:
    _import(SINGLETON, feed_url, WORK)


@guarded_task(app=app, key=PREFIX + "run:{feed_url}", ttl=TTL, lock="run", name=RUN)
def run(feed_url: str) -> None:
    _import(RUN, feed_url, WORK)


@guarded_task(
    app=app, key=PREFIX + "qar:{feed_url}", ttl=TTL, lock="queue_and_run", name=QUEUE_AND_RUN
)
def queue_and_run(feed_url: str) -> None:
    _import(QUEUE_AND_RUN, feed_url, WORK)


@guarded_task(app=app, key=PREFIX + "co:{feed_url}", ttl=TTL, on_conflict="coalesce", name=COALESCE)
def coalesce(feed_url: str) -> None:
    _import(COALESCE, feed_url, WORK)


@app.task(bind=True, name=RECIPE_LONG)
def recipe_long(self: Task, feed_url: str) -> None:
    _recipe(self, feed_url, LONG_EXPIRE, LONG_WORK)


@guarded_task(app=app, key=PREFIX + "long:{feed_url}", ttl=LONG_EXPIRE, lock="run", name=RUN_LONG)
def run_long(feed_url: str) -> None:
    _import(RUN_LONG, feed_url, LONG_WORK)


@task_postrun.connect
def _count_delivery(sender: Any = None, state: str | None = None, **_: Any) -> None:
    if state == "RETRY":
        return  # a coalesced pending run deferred while its feed runs: it comes back
    name = getattr(sender, "name", "")
    if name.startswith(PREFIX):
        _client().incr(done_key(name))
