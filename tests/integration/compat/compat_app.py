"""Celery app for the compat worker tests: a celery-once ``QueueOnce`` task and a
celery-singleton ``Singleton`` task, switched to taskguard's SQL locks by the
configuration below alone.

A worker imports this module (``celery -A compat_app worker``, see
``workers.start_worker``) and builds its app from the environment; the test
process calls :func:`make_app` with the same settings to publish.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, signals
from celery_once import QueueOnce
from celery_singleton import Singleton, clear_locks
from integration.celery.workers import worker_settings


def make_app(broker_url: str, result_backend: str | None, queue: str, database_url: str) -> Celery:
    """The app (tasks registered) for these settings; the current app, as Celery()
    makes it by default."""
    app = Celery("compat_app")
    app.conf.update(
        worker_settings(broker_url, result_backend, queue, database_url),
        # The switch, as docs/migrating-from-celery-*.md give it:
        ONCE={
            "backend": "taskguard.compat.celery_once.Backend",
            "settings": {"default_timeout": 60},  # no url: taskguard_database_url
        },
        singleton_backend_class="taskguard.compat.celery_singleton.Backend",
        singleton_backend_url=database_url,
    )

    @app.task(name="compat.once_sleep", base=QueueOnce, shared=False, once={"keys": ["key_id"]})
    def once_sleep(key_id: str, seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()

    @app.task(name="compat.singleton_sleep", base=Singleton, shared=False, unique_on=["key_id"])
    def singleton_sleep(key_id: str, seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()

    @app.task(
        name="compat.singleton_short", base=Singleton, shared=False, unique_on=["key_id"],
        lock_expiry=1,
    )  # fmt: skip
    def singleton_short(key_id: str, seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()

    return app


@signals.worker_ready.connect
def _clear_stale_locks(sender: Any, **_: Any) -> None:
    # celery-singleton's advice against locks left by a killed worker.
    clear_locks(sender.app)


app = make_app(
    broker_url=os.environ.get("TASKGUARD_TEST_BROKER_URL", "memory://"),
    result_backend=os.environ.get("TASKGUARD_TEST_RESULT_BACKEND") or None,
    queue=os.environ.get("TASKGUARD_TEST_QUEUE", "compat_app"),
    database_url=os.environ.get("TASKGUARD_DATABASE_URL", ""),
)
