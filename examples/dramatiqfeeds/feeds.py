"""The Celery cookbook's feed importer ("one import of a feed at a time") on Dramatiq,
with taskguard's locks in your SQL database. Run by ``dramatiq feeds``; sent to by
``python storm.py``. Settings from the environment (see README.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker

from taskguard.dramatiq import TaskGuardMiddleware

HERE = Path(__file__).resolve().parent
BROKER = os.environ.get("DRAMATIQFEEDS_BROKER", "redis://localhost:6379/0")
DATABASE = os.environ.get("DRAMATIQFEEDS_DATABASE", f"sqlite:///{HERE / 'var' / 'locks.db'}")
#: The imports' own record: one line per import started and ended (not taskguard's).
LOG = Path(os.environ.get("DRAMATIQFEEDS_LOG", HERE / "var" / "imports.log"))
QUEUE = os.environ.get("DRAMATIQFEEDS_QUEUE", "feeds")
LOG.parent.mkdir(parents=True, exist_ok=True)

broker = RabbitmqBroker(url=BROKER) if BROKER.startswith("amqp") else RedisBroker(url=BROKER)
broker.add_middleware(TaskGuardMiddleware(DATABASE, history=True))
dramatiq.set_broker(broker)


def _note(event: str, feed_url: str) -> None:
    with open(LOG, "a") as out:
        out.write(f"{event} {feed_url} {time.time():.6f}\n")


@dramatiq.actor(queue_name=QUEUE, key="feed:{feed_url}", ttl=60)
def import_feed(feed_url: str) -> None:
    """One import of a feed at a time; a duplicate that finds it running is skipped."""
    _note("start", feed_url)
    time.sleep(float(os.environ.get("DRAMATIQFEEDS_FETCH_SECONDS", "0.2")))  # the download
    _note("end", feed_url)


@dramatiq.actor(queue_name=QUEUE, key="feed:{feed_url}", ttl=60, lock="queue_and_run",
                on_conflict="raise")  # fmt: skip
def import_feed_once(feed_url: str) -> None:
    """One queued or running import of a feed: a duplicate send raises AlreadyLocked."""
    import_feed.fn(feed_url)
