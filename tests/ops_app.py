"""Celery app for the operations tests: ``celery -A ops_app taskguard …`` and a
worker with embedded beat running the reaper.

Configured from the environment so each test points it at its own database and
queue: OPS_APP_DATABASE_URL, OPS_APP_BROKER (default memory://), OPS_APP_QUEUE,
OPS_APP_REAPER_EVERY (seconds), OPS_APP_REAPER_GRACE (seconds).
"""

from __future__ import annotations

import os

from celery import Celery

import taskguard

app = Celery("ops_app", broker=os.environ.get("OPS_APP_BROKER", "memory://"))
app.conf.update(
    taskguard_database_url=os.environ.get("OPS_APP_DATABASE_URL") or None,
    task_default_queue=os.environ.get("OPS_APP_QUEUE", "ops_app"),
    broker_connection_retry_on_startup=True,
)

_every = os.environ.get("OPS_APP_REAPER_EVERY")
_grace = os.environ.get("OPS_APP_REAPER_GRACE")
taskguard.schedule_reaper(
    app,
    every=float(_every) if _every else None,
    grace=float(_grace) if _grace else None,
)
