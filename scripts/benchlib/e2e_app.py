"""The Celery app the end-to-end benchmark's worker runs (configured by environment).

Three trivial tasks that differ only in their lock: none, taskguard's
``@guarded_task(lock="run")``, and celery-once's ``QueueOnce``. Every finished task
bumps one Redis counter per task name (same cost for all three), which is how the
benchmark knows when a batch is done without a result backend.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun
from celery_once import QueueOnce

BROKER = os.environ.get("TGBENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
QUEUE = os.environ.get("TGBENCH_QUEUE", "tgbench")
DB_URL = os.environ.get("TGBENCH_DB_URL", "")
REDIS_URL = os.environ.get("TGBENCH_REDIS_URL", "redis://127.0.0.1:6379/11")
PREFIX = os.environ.get("TGBENCH_PREFIX", "tgbench:")
TTL = 60

app = Celery("tgbench_e2e", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    taskguard_database_url=DB_URL,
    taskguard_durable=os.environ.get("TGBENCH_DURABLE", "1") == "1",
    taskguard_prefetch_grants=os.environ.get("TASKGUARD_PREFETCH", "1") == "1",
    taskguard_finished_retention=float(os.environ.get("TGBENCH_FINISHED_RETENTION", "7200")),
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": REDIS_URL, "default_timeout": TTL},
    },
)

PLAIN = f"{PREFIX}plain"
GUARDED = f"{PREFIX}guarded"
ONCE = f"{PREFIX}once"


@app.task(name=PLAIN)
def plain(i: int) -> None:
    return None


@app.task(name=ONCE, base=QueueOnce, once={"graceful": False, "timeout": TTL})
def once(i: int) -> None:
    return None


#: Why the guarded task could not be defined (None when it was).
GUARDED_UNAVAILABLE: str | None = None
try:
    from taskguard import guarded_task
except ImportError as exc:
    GUARDED_UNAVAILABLE = f"taskguard.guarded_task not importable ({exc})"
else:

    @guarded_task(app=app, key=PREFIX + "k:{i}", ttl=TTL, lock="run", name=GUARDED)
    def guarded(i: int) -> None:
        return None


_counter: redis.Redis | None = None


@task_postrun.connect
def _count_done(sender: Any = None, **_: Any) -> None:
    global _counter
    if _counter is None:  # one client per worker process, made after the fork
        _counter = redis.Redis.from_url(REDIS_URL)
    _counter.incr(f"{PREFIX}done:{getattr(sender, 'name', '?')}")
