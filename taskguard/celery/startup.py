"""The start-up check when a Celery worker starts (``taskguard_startup_check``).

Runs :func:`taskguard.preflight.check_database` once in the worker's main process
(``celeryd_after_setup``: once the worker's logging is set up, before the pool
starts) and logs one line: ``ok``, or each problem with its fix; and a warning for
each unknown ``taskguard_*`` setting, naming the closest known one. What a failed
check does depends on the setting:

* ``"stop"`` (default): stop the worker when the configuration is wrong - an
  unusable URL, a schema that is not at this taskguard's head, a missing
  privilege. These never fix themselves, and a worker running with them fails
  every guarded task (closed: the bodies do not run) while looking healthy. An
  *unreachable* database only logs: it is usually transient, guarded tasks fail
  closed and retry meanwhile, and a fleet that refuses to start during a database
  blip turns a short outage into a long one.
* ``"strict"``: stop on any failed check, unreachable included.
* ``"log"``: only log. ``"off"``: no check.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery.signals import celeryd_after_setup

from taskguard.compat import configured
from taskguard.config import ENV_DATABASE_URL, database_url, setting, unknown_settings
from taskguard.exceptions import ConfigurationError
from taskguard.preflight import check_database

__all__ = ["MODES", "run_startup_check", "uses_taskguard"]

log = logging.getLogger("taskguard.celery")

MODES = ("stop", "strict", "log", "off")


def run_startup_check(app: Any) -> bool:
    """Check ``app``'s lock database; ``False`` if the worker should stop."""
    mode = str(setting(app, "taskguard_startup_check")).lower()
    if mode not in MODES:
        log.error(
            "taskguard_startup_check=%r is not one of %s; checking in 'stop' mode",
            mode,
            ", ".join(MODES),
        )
        mode = "stop"
    if mode == "off":
        return True
    try:
        url = database_url(app)
    except ConfigurationError as exc:  # names the unknown settings too
        log.error("taskguard start-up check: %s", exc)
        return mode == "log"
    for line in unknown_settings(app):
        log.warning("taskguard start-up check: %s", line)
    timeout = min(5.0, float(setting(app, "taskguard_call_timeout")))
    result = check_database(url, timeout=timeout)
    if result.ok:
        log.info("%s", result.line())
        return True
    stop = mode == "strict" or (mode == "stop" and not result.unreachable)
    suffix = f" - stopping the worker (taskguard_startup_check={mode!r})" if stop else ""
    log.error("%s%s", result.line(), suffix)
    return not stop


def uses_taskguard(app: Any) -> bool:
    """Whether ``app`` uses taskguard: a guarded task, a ``taskguard_*`` setting, the
    database URL in the environment, or a compat backend. A worker of an app that
    does not is never checked (installing taskguard must not stop unrelated workers)."""
    from taskguard.celery.task import GuardedTask

    conf = app.conf
    if any(isinstance(task, GuardedTask) for task in app.tasks.values()):
        return True
    if os.environ.get(ENV_DATABASE_URL) or any(
        name.startswith("taskguard_") and conf.get(name) is not None for name in conf
    ):
        return True
    return bool(configured(conf))


def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    app = getattr(instance, "app", None)
    if app is None or not uses_taskguard(app) or run_startup_check(app):
        return
    # Signal handlers' exceptions are logged and swallowed; SystemExit is not.
    raise SystemExit(1)


celeryd_after_setup.connect(_on_worker_setup, weak=False, dispatch_uid="taskguard.celery.startup")
