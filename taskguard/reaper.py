"""Moved to :mod:`taskguard.celery.reaper` (Celery-only code lives under
``taskguard.celery``). This name stays importable for Celery configurations that
list ``imports = ["taskguard.reaper"]``; new code imports ``taskguard`` or
``taskguard.celery.reaper``."""

from taskguard.celery.reaper import (
    DEFAULT_INTERVAL,
    SCHEDULE_KEY,
    TASK_NAME,
    reap_expired_locks,
    schedule_reaper,
)

__all__ = [
    "DEFAULT_INTERVAL",
    "SCHEDULE_KEY",
    "TASK_NAME",
    "reap_expired_locks",
    "schedule_reaper",
]
