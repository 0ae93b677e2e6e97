"""The Celery app the end-to-end benchmark's worker runs (configured by environment).

Trivial tasks that differ only in their lock: none, taskguard's
``@guarded_task(lock="run")`` and ``lock="queue_and_run"`` (taken at publish, like
celery-once's), and celery-once's ``QueueOnce``. Every finished task
bumps one Redis counter per task name (same cost for all), which is how the
benchmark knows when a batch is done without a result backend; a task that raised
also leaves its error (:func:`benchlib.common.failed_tasks`), reported instead of
its figures.

One more, ``minimal``, takes the minimal correct lock (the pairs section's anchor,
:class:`benchlib.pairs.MinimalLock`) by hand in its body, prepared, on a psycopg
connection of its pool process: what a lock costs end to end without the library.

``TGBENCH_STUB`` (diagnosis only, e.g. ``TGBENCH_STUB=release python
scripts/bench.py --sections e2e``) makes TaskGuard calls in the worker answer
without the database: ``release`` (every release reports success) or ``adopt``
(every adoption of a lease handed over in the message, ``lock="queue_and_run"``,
succeeds; releases are sent): what the guarded run would cost if those statements
cost nothing. No lock holds while it is set.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun, worker_init
from celery_once import QueueOnce

BROKER = os.environ.get("TGBENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
QUEUE = os.environ.get("TGBENCH_QUEUE", "tgbench")
DB_URL = os.environ.get("TGBENCH_DB_URL", "")
REDIS_URL = os.environ.get("TGBENCH_REDIS_URL", "redis://127.0.0.1:6379/11")
PREFIX = os.environ.get("TGBENCH_PREFIX", "tgbench:")
TTL = 60
#: "", "release" or "adopt": see the module docstring.
STUB = os.environ.get("TGBENCH_STUB", "")
if STUB not in ("", "release", "adopt"):
    raise SystemExit(f"TGBENCH_STUB={STUB!r}: use 'release' or 'adopt' (or leave it unset)")

app = Celery("tgbench_e2e", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    taskguard_database_url=DB_URL,
    taskguard_durable=os.environ.get("TGBENCH_DURABLE", "1") == "1",
    taskguard_finished_retention=float(os.environ.get("TGBENCH_FINISHED_RETENTION", "7200")),
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": REDIS_URL, "default_timeout": TTL},
    },
)

PLAIN = f"{PREFIX}plain"
GUARDED = f"{PREFIX}guarded"
ONCE = f"{PREFIX}once"
MINIMAL = f"{PREFIX}minimal"
QUEUE_AND_RUN = f"{PREFIX}queue_and_run"


@app.task(name=PLAIN)
def plain(i: int) -> None:
    return None


@app.task(name=ONCE, base=QueueOnce, once={"graceful": False, "timeout": TTL})
def once(i: int) -> None:
    return None


_minimal: list[Any] = []  # this pool process's hand-written lock


@app.task(name=MINIMAL)
def minimal(i: int) -> None:
    if not _minimal:  # connected in the pool process, after the fork
        from benchlib.common import Row
        from benchlib.pairs import MinimalLock

        _minimal.append(MinimalLock(Row("e2e.minimal", "", ""), DB_URL))
    _minimal[0].pair(f"{PREFIX}m:{i}")


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

    @guarded_task(app=app, key=PREFIX + "q:{i}", ttl=TTL, lock="queue_and_run", name=QUEUE_AND_RUN)
    def queue_and_run(i: int) -> None:
        return None


_counter: redis.Redis | None = None


@worker_init.connect
def _stub_statements(**_: Any) -> None:
    """In the worker only (the publisher's process may run other sections next)."""
    if not STUB or GUARDED_UNAVAILABLE is not None:
        return
    from datetime import datetime, timedelta, timezone

    from taskguard import TaskGuard
    from taskguard.lease import Lease

    def release(self: TaskGuard, lease: Lease, *, marker: Any = None) -> bool:
        return True

    def adopt(self: TaskGuard, key: str, owner: str, ttl: float, **_: Any) -> Lease:
        now = datetime.now(timezone.utc)
        return Lease(key, os.urandom(16).hex(), 1, now, now + timedelta(seconds=ttl), ttl)

    if STUB == "adopt":
        TaskGuard.adopt = adopt  # type: ignore[assignment]
        return
    TaskGuard.release = release  # type: ignore[method-assign]


@task_postrun.connect
def _count_done(sender: Any = None, state: str = "", retval: Any = None, **_: Any) -> None:
    global _counter
    if _counter is None:  # one client per worker process, made after the fork
        _counter = redis.Redis.from_url(REDIS_URL)
    name = getattr(sender, "name", "?")
    if state == "FAILURE":  # its row reports this, not a figure (common.failed_tasks)
        _counter.hsetnx(f"{PREFIX}failed", name, f"{type(retval).__name__}: {retval}")
    _counter.incr(f"{PREFIX}done:{name}")
