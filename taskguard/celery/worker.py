"""The worker's main-process hooks: the start-up check, and the ways a run ends
without its ``finally``.

The start-up check (:func:`run_startup_check`) runs once in the worker's main
process (``celeryd_after_setup``: once the worker's logging is set up, before the
pool starts) and logs one line: ``ok``, or each problem with its fix; and a
warning for each unknown ``taskguard_*`` setting, naming the closest known one.
What a failed check does depends on ``taskguard_startup_check``:

* ``"stop"`` (default): stop the worker when the configuration is wrong - an
  unusable URL, a schema that is not at this taskguard's head, a missing
  privilege. These never fix themselves, and a worker running with them fails
  every guarded task (closed: the bodies do not run) while looking healthy. An
  *unreachable* database only logs: it is usually transient, guarded tasks fail
  closed and retry meanwhile, and a fleet that refuses to start during a database
  blip turns a short outage into a long one.
* ``"strict"``: stop on any failed check, unreachable included.
* ``"log"``: only log. ``"off"``: no check.

Inside a pool child every catchable way out unwinds through the run's
``finally`` (billiard turns SIGTERM into ``SystemExit``; a soft time limit is an
exception), which releases the lease. What no ``finally`` sees:

* ``revoke(terminate=True, signal="SIGKILL")`` — released by
  :meth:`GuardedRequest.terminate` right after the kill;
* a child that dies (OOM killer, ``kill -9``): ``WorkerLostError`` — released
  by :meth:`GuardedRequest.on_failure` before Celery requeues or retries it;
* a hard time limit — billiard sends SIGTERM (the child unwinds and releases)
  and SIGKILL 0.1 s later if it did not exit; a second later the main process
  releases whatever that child still holds;
* a message revoked or expired before it started — gives back the queue-phase
  lease or pending place it carried (``task_revoked`` receiver); one waiting out a
  countdown in the worker's ETA timer gives it back when the worker receives the
  revoke, by id or by stamped headers (:func:`give_back_at_revoke`), not when the
  countdown ends, so a submission right after the revoke does not merge into a run
  that will not happen; an execution that deferred itself meanwhile ends REVOKED,
  not RETRY (:meth:`GuardedRequest.on_retry`).

Rows are matched by task id, worker node *and* the dead child's pid, so another
delivery's lease is never touched. A hard kill of the whole worker runs no hook
at all: the lease then ends by expiry, within one ttl.
"""

from __future__ import annotations

import logging
import os
import signal as _signal
import threading
from typing import Any

from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.platforms import signals as platform_signals
from celery.signals import celeryd_after_setup, task_received, task_revoked, worker_init
from celery.utils.functional import maybe_list
from celery.worker import state as worker_state
from celery.worker.control import Panel
from celery.worker.request import Request
from kombu.asynchronous import get_event_loop

from taskguard.celery import pending
from taskguard.celery.lease_calls import (
    held_seconds,
    lease_from_info,
    release_quietly,
    send_released,
)
from taskguard.celery.message import Handed, Header, stored_task_id
from taskguard.celery.task import GuardedTask
from taskguard.compat import configured
from taskguard.config import ENV_DATABASE_URL, database_url, guard_for, setting, unknown_settings
from taskguard.exceptions import ConfigurationError
from taskguard.startup_check import check_database

__all__ = ["MODES", "GuardedRequest"]

log = logging.getLogger("taskguard.celery")


# -- the start-up check ------------------------------------------------------------------

#: The values of ``taskguard_startup_check``.
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


celeryd_after_setup.connect(
    _on_worker_setup, weak=False, dispatch_uid="taskguard.celery.worker.startup"
)


# -- a run that ends without its ``finally`` ---------------------------------------------

#: Seconds after a hard time limit before the main process checks the child's rows
#: (billiard waits 0.1 s after SIGTERM before it sends SIGKILL).
HARD_LIMIT_GRACE = 1.0


def release_dead_run(
    task: Any,
    *,
    task_id: str,
    nodename: str | None,
    pid: int | None,
    header: Header,
    args: Any,
    kwargs: Any,
    why: str,
) -> int:
    """Release the leases the dead pool child ``pid`` of worker ``nodename`` held
    for ``task_id``. Returns how many rows were released. Never raises."""
    if pid is None:
        return 0
    try:
        key = header.message_key(task.taskguard_options.deriver.derive, args, kwargs)
        stored_id = stored_task_id(task_id)
        guard = guard_for(task._get_app())
        count = 0
        for info in guard.get_all(key):
            # An adopted hand-over names its run's pool process too (exclusive adopt).
            own_row = info.holder.hostname == nodename and info.holder.pid == pid
            if not (info.held and info.holder.task_id == stored_id and own_row):
                continue  # another delivery's, or not this run's
            lease = lease_from_info(info, task.taskguard_options.min_hold)
            released = release_quietly(guard, lease, reason=f"by the worker's main process: {why}")
            count += int(released)
            _report(key, task, task_id, pid, nodename, why)
            send_released(task, lease, released, (info.read_at - info.acquired_at).total_seconds())
        pending.give_up(task, header)  # [coalesce] a dead pending run gives its place back
        return count
    except Exception:
        log.exception("could not release the lock of %s[%s] after %s", task.name, task_id, why)
        return 0


def _report(key: str, task: Any, task_id: str, pid: int, nodename: str | None, why: str) -> None:
    log.warning(
        "released lock %r held by %s[%s] (pid %s on %s): %s",
        key,
        task.name,
        task_id,
        pid,
        nodename,
        why,
    )


def release_unstarted(task: Any, request: Any, header: Header) -> None:
    """A message discarded before it ran (revoked, expired) gives back the lease it
    carried (``task_revoked``; see also :func:`give_back_at_revoke`)."""
    pending.give_up(task, header)  # [coalesce] a revoked pending run gives its place back
    if header.lease is None:
        return
    try:
        lease = Handed.of(header.lease).lease(header.key)
        guard = guard_for(task._get_app())
        # By the owner id in the message: a lease another delivery of this task id
        # adopted has an owner id of its own, and is left alone.
        released = release_quietly(guard, lease)
        if released:
            log.info("released lock %r of revoked %s[%s]", lease.key, task.name, request.id)
        send_released(task, lease, released, held_seconds(lease))
    except Exception:
        log.exception("could not release the lock of revoked %s[%s]", task.name, request.id)


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if isinstance(sender, GuardedTask) and request is not None and not terminated:
        release_unstarted(sender, request, Header.of(request))


task_revoked.connect(_on_revoked, weak=False, dispatch_uid="taskguard.celery.worker.revoked")


def give_back_at_revoke(**_: Any) -> None:
    """Make the worker's ``revoke`` and ``revoke_by_stamped_headers`` remote control
    commands also give back what the guarded messages they revoke carry
    (:func:`release_unstarted`) when the worker receives them, once Celery has
    flagged them revoked (so none of them starts after): those waiting out a
    countdown in the worker's ETA timer, and those being executed (a pending run's
    re-check: the copy it publishes is found revoked before it runs). Celery itself
    sends ``task_revoked`` for a message in the timer only when its countdown ends,
    so a submission meanwhile would merge into a run that will not happen.
    Connected to ``worker_init``: the worker's main process only."""
    for name, argument, revokes in (
        ("revoke", "task_id", _by_id),
        ("revoke_by_stamped_headers", "headers", _by_stamps),
    ):
        command = Panel.data.get(name)
        if command is not None and not getattr(command, "taskguard", False):
            Panel.data[name] = _giving_back(command, argument, revokes)


def _by_id(task_id: Any) -> Any:
    ids = set(maybe_list(task_id) or ())
    return lambda request: request.id in ids


def _by_stamps(headers: Any) -> Any:
    if isinstance(headers, list):  # the command line's ["name=value", ...]
        headers = dict(header.split("=", 1) for header in headers)

    def matches(request: Any) -> bool:
        stamps = getattr(request, "stamps", None) or {}
        return any(
            set(maybe_list(stamps.get(name)) or ()) & set(maybe_list(values) or ())
            for name, values in headers.items()
        )

    return matches


def _giving_back(command: Any, argument: str, revokes: Any) -> Any:
    # Called as the command is: ``command(state, **arguments)`` (its own argument names).
    def revoke_and_give_back(state: Any, *args: Any, **kwargs: Any) -> Any:
        reply = command(state, *args, **kwargs)
        matches = revokes(kwargs[argument] if argument in kwargs else args[0])
        # The consumer's timer holds the messages waiting out a countdown, on every
        # Celery version (not the worker state's requests: a deferred copy shares its task id
        # with the run that published it, whose end drops the id from there).
        for event in state.consumer.timer.queue:
            for request in event.entry.args:
                if isinstance(request, GuardedRequest) and matches(request):
                    release_unstarted(request.task, request, Header.of(request.request_dict))
        for request in list(worker_state.active_requests):  # its body may still run
            if isinstance(request, GuardedRequest) and matches(request):
                pending.give_up(request.task, Header.of(request.request_dict))
        return reply

    revoke_and_give_back.taskguard = True  # type: ignore[attr-defined]
    return revoke_and_give_back


worker_init.connect(give_back_at_revoke, weak=False, dispatch_uid="taskguard.celery.worker.revoke")


def _on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    # A copy published by an execution under way when its stamped headers were revoked
    # (a pending run's re-check): Celery finds it revoked only when its countdown ends
    # (a revoked task id it discards on receipt, sending task_revoked).
    stamps = worker_state.revoked_stamps
    if stamps and isinstance(request, GuardedRequest) and _by_stamps(stamps)(request):
        release_unstarted(request.task, request, Header.of(request.request_dict))


task_received.connect(_on_received, weak=False, dispatch_uid="taskguard.celery.worker.received")


def _is_sigkill(signum: Any) -> bool:
    try:
        return bool(platform_signals.signum(signum) == _signal.SIGKILL)
    except (TypeError, ValueError, AttributeError):
        return False


class GuardedRequest(Request):  # type: ignore[misc]
    """Worker request class of guarded tasks (set as ``GuardedTask.Request``).

    A task that brings its own ``Request`` class should derive it from this one.
    """

    def terminate(self, pool: Any, signal: Any = None) -> None:
        started = bool(self.time_start)
        super().terminate(pool, signal)
        if started and _is_sigkill(signal):
            self._release_dead("terminated by revoke (signal 9)")

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:
            why = f"hard time limit ({timeout}s) exceeded"
            hub: Any = get_event_loop()
            if hub is not None:
                # On the worker's own event loop, not a thread: billiard forks the
                # replacement child from this process, and a child forked while a
                # thread held a lock (the guard cache's, the pool's) inherits it held.
                hub.call_later(HARD_LIMIT_GRACE, self._release_dead, why)
            else:  # a worker without an event loop (e.g. the solo pool)
                timer = threading.Timer(HARD_LIMIT_GRACE, self._release_dead, (why,))
                timer.daemon = True
                timer.start()

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)
        if isinstance(exc, WorkerLostError) and not isinstance(exc, TimeLimitExceeded):
            # Before requeue/retry handling, so a redelivery finds the key free.
            self._release_dead(f"worker process lost ({exc})")
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def on_retry(self, exc_info: Any) -> None:
        super().on_retry(exc_info)
        # Revoked while this execution deferred itself (a pending run's re-check) or
        # retried: the copy it published is discarded as revoked, possibly before this
        # execution stored RETRY. What happened is the revoke.
        if self.id in worker_state.revoked or _by_stamps(worker_state.revoked_stamps)(self):
            self.task.backend.mark_as_revoked(
                self.id, "revoked", request=self._context, store_result=self.store_errors
            )

    def _release_dead(self, why: str) -> None:
        release_dead_run(
            self.task,
            task_id=self.id,
            nodename=self.hostname,
            pid=self.worker_pid,
            header=Header.of(self.request_dict),
            args=self.args,
            kwargs=self.kwargs,
            why=why,
        )
