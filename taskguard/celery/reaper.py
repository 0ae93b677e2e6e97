"""The reaper: a Celery task that deletes lock rows whose lease ended long ago,
and one call that puts it on an app's beat schedule.

A released or expired lease leaves its row behind on purpose (the row keeps a
late, slow acquire from reusing an older fencing token), so something must
delete rows once they are safely dead. That is this task::

    import taskguard
    taskguard.schedule_reaper(app, every=60)   # then run `celery beat` as usual

or, without code, ``taskguard_reaper_interval = 60`` in the Celery configuration
(taskguard must be imported by the app, e.g. ``imports = ["taskguard"]``).

The work is :meth:`taskguard.TaskGuard.reap`: batches of short transactions, live
leases never touched, several reapers at once safe (``FOR UPDATE SKIP LOCKED``).
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from typing import Any

from celery import shared_task
from celery._state import _get_active_apps, connect_on_app_finalize
from celery.schedules import BaseSchedule

from taskguard.config import guard_for, setting
from taskguard.exceptions import ConfigurationError
from taskguard.signals import locks_reaped

__all__ = ["reap_expired_locks", "schedule_reaper"]

log = logging.getLogger("taskguard.reaper")

#: Registered name of the reaper task.
TASK_NAME = "taskguard.reap_expired_locks"
#: Key of the reaper's entry in ``app.conf.beat_schedule``.
SCHEDULE_KEY = "taskguard-reaper"
#: Seconds between runs when neither ``every`` nor ``taskguard_reaper_interval`` says.
DEFAULT_INTERVAL = 60.0


def _reap(
    task: Any,
    grace: float | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
) -> int:
    app = task.app
    grace_s = float(setting(app, "taskguard_reaper_grace") if grace is None else grace)
    size = int(setting(app, "taskguard_reaper_batch_size") if batch_size is None else batch_size)
    guard = guard_for(app)
    started = time.monotonic()
    result = guard.reap(grace=grace_s, batch_size=size, max_batches=max_batches)
    elapsed = time.monotonic() - started
    removed = int(result)
    log.info(
        "reaper removed %d lock row(s) expired more than %gs ago from %s "
        "(%d batch(es) of up to %d, %.2fs)",
        removed,
        grace_s,
        guard.url,
        result.batches,
        size,
        elapsed,
    )
    # Sent on every run, also with count=0, so receivers can tell the reaper is alive.
    locks_reaped.send(sender=task, count=removed)
    return removed


#: The reaper task, registered on every Celery app of the process under
#: :data:`TASK_NAME`. Arguments (all optional; settings fill the gaps):
#: ``grace`` seconds (``taskguard_reaper_grace``), ``batch_size``
#: (``taskguard_reaper_batch_size``), ``max_batches`` (default: until done).
#: Returns the number of rows removed.
reap_expired_locks: Any = shared_task(name=TASK_NAME, bind=True)(_reap)


def _interval(every: Any) -> float | BaseSchedule:
    if isinstance(every, BaseSchedule):
        return every
    if isinstance(every, timedelta):
        seconds = every.total_seconds()
    elif isinstance(every, (int, float)) and not isinstance(every, bool):
        seconds = float(every)
    else:
        raise ConfigurationError(
            "reaper interval must be seconds, a timedelta or a celery schedule "
            f"(e.g. crontab), not {type(every).__name__}"
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(
            f"reaper interval must be a positive number of seconds, got {every!r}"
        )
    return seconds


def schedule_reaper(
    app: Any,
    every: float | timedelta | BaseSchedule | None = None,
    *,
    grace: float | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    queue: str | None = None,
) -> str:
    """Put :data:`reap_expired_locks` on ``app``'s beat schedule; returns the entry's key
    (:data:`SCHEDULE_KEY`). Calling it again replaces the entry.

    ``every``: seconds, a ``timedelta`` or a Celery schedule such as ``crontab(...)``;
    default ``taskguard_reaper_interval``, else 60 seconds. ``grace``/``batch_size``/
    ``max_batches`` are fixed into the entry only when given; otherwise the worker's
    settings apply at each run. A run that waits in the queue longer than one interval
    is dropped (``expires``): the next one does the same work.
    """
    if every is None:
        every = setting(app, "taskguard_reaper_interval") or DEFAULT_INTERVAL
    schedule = _interval(every)
    if grace is not None and (not math.isfinite(grace) or grace < 0):
        raise ConfigurationError(f"reaper grace must be >= 0 seconds, got {grace!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or int(batch_size) < 1):
        raise ConfigurationError(f"reaper batch_size must be a positive int, got {batch_size!r}")
    kwargs: dict[str, Any] = {}
    if grace is not None:
        kwargs["grace"] = float(grace)
    if batch_size is not None:
        kwargs["batch_size"] = int(batch_size)
    if max_batches is not None:
        kwargs["max_batches"] = int(max_batches)
    options: dict[str, Any] = {}
    if isinstance(schedule, float):
        options["expires"] = schedule
    if queue is not None:
        options["queue"] = queue
    app.add_periodic_task(
        schedule, app.signature(TASK_NAME), kwargs=kwargs, name=SCHEDULE_KEY, **options
    )
    return SCHEDULE_KEY


def _schedule_from_setting(app: Any) -> None:
    if setting(app, "taskguard_reaper_interval") is not None:
        schedule_reaper(app)


# The settings route: any app finalized from now on (and any already finalized) that
# sets taskguard_reaper_interval gets the beat entry, before beat reads its schedule.
connect_on_app_finalize(_schedule_from_setting)
for _app in list(_get_active_apps()):
    if _app.finalized:
        _schedule_from_setting(_app)
