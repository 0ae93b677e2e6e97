"""``GuardedTask``: a Celery ``Task`` base class that holds a per-key lease.

Enqueue side (:meth:`GuardedTask.apply_async`): the key is derived once and put
in the message header; for ``lock="queue"``/``"queue_and_run"`` the lease is taken
before publishing and handed to the worker in the header.

Run side (:meth:`GuardedTask.__call__`, which Celery's tracer calls for every
execution, worker or eager): the lease is taken (or adopted from the header),
renewed while the body runs, and released in a ``finally`` so every way out
(return, exception, Reject, Ignore, soft time limit) gives it back exactly once.
A ``retry()`` hands the lease to the retry message instead. What no ``finally``
can see (hard kill, hard time limit, revoke with terminate) is handled in the
worker's main process by :mod:`taskguard.celery.worker`, or by expiry.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping
from typing import Any

from celery import Task
from celery import states as celery_states
from celery.exceptions import Retry
from celery.result import EagerResult
from celery.utils import uuid

from taskguard import signals
from taskguard.celery import common, handoff
from taskguard.celery.common import HEADER, header_of
from taskguard.celery.options import GuardOptions, build_options
from taskguard.celery.renewal import ActiveRun, Heartbeat, active_run, enter_run, exit_run
from taskguard.celery.results import skipped_result
from taskguard.config import guard_for, setting
from taskguard.exceptions import AlreadyLocked
from taskguard.guard import TaskGuard
from taskguard.keys import validate_ttl
from taskguard.lease import Lease, LockInfo

__all__ = ["GuardedTask"]

log = logging.getLogger("taskguard.celery")

_OPTION_ATTRS = {
    "taskguard_key": "key",
    "taskguard_key_args": "key_args",
    "taskguard_ttl": "ttl",
    "taskguard_queue_ttl": "queue_ttl",
    "taskguard_lock": "lock",
    "taskguard_on_conflict": "on_conflict",
    "taskguard_retry_countdown": "retry_countdown",
    "taskguard_limit": "limit",
    "taskguard_min_hold": "min_hold",
    "taskguard_wait_timeout": "wait_timeout",
}


class GuardedTask(Task):  # type: ignore[misc]
    """Celery task base class running at most one execution per lock key (at most
    ``taskguard_limit`` with a concurrency limit).

    Use :func:`taskguard.guarded_task`, or ``@app.task(base=GuardedTask,
    taskguard_key=..., taskguard_ttl=..., taskguard_lock=..., taskguard_on_conflict=...)``.
    """

    #: Lock key: None (task name + digest of all arguments), a template such as
    #: ``"feed:{feed_url}"``, or a callable taking the task's arguments.
    taskguard_key: Any = None
    #: Digest only these arguments (default key form).
    taskguard_key_args: Any = None
    #: Lease length (seconds); None: the app's ``taskguard_default_ttl``.
    taskguard_ttl: Any = None
    #: Lease length while queued (queue phases); None: ``taskguard_ttl``.
    taskguard_queue_ttl: Any = None
    #: "run", "queue" or "queue_and_run".
    taskguard_lock: Any = "run"
    #: "skip", "raise", "retry", "existing" or "wait".
    taskguard_on_conflict: Any = "skip"
    #: Countdown of conflict retries; None: until the holder's lease ends.
    taskguard_retry_countdown: Any = None
    #: Concurrency limit: at most this many runs per key at once.
    taskguard_limit: Any = 1
    #: Throttle window (seconds): the key stays taken this long after each grant.
    taskguard_min_hold: Any = None
    #: Longest wait of on_conflict="wait"; None: the app's ``taskguard_wait_timeout``.
    taskguard_wait_timeout: Any = None
    #: Releases what a killed child held (see taskguard.celery.worker).
    Request = "taskguard.celery.worker:GuardedRequest"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        key = cls.__dict__.get("taskguard_key")
        if inspect.isfunction(key):
            # A plain function stored on a class would be bound as a method.
            cls.taskguard_key = staticmethod(key)

    # -- options ---------------------------------------------------------------------

    @property
    def taskguard_options(self) -> GuardOptions:
        """The validated taskguard options (built on first use, then cached)."""
        opts = self.__dict__.get("_taskguard_options")
        if opts is None:
            raw = {name: getattr(self, attr) for attr, name in _OPTION_ATTRS.items()}
            opts = build_options(self.name, inspect.signature(self.run), **raw)
            self.__dict__["_taskguard_options"] = opts
        return opts

    def taskguard_key_for(self, args: Any = None, kwargs: Any = None) -> str:
        """The lock key a call with ``args``/``kwargs`` would use."""
        return self.taskguard_options.keys.derive(args, kwargs)

    def _guard(self) -> TaskGuard:
        return guard_for(self._get_app())

    def _ttl(self) -> float:
        return common.default_ttl(self._get_app(), self.taskguard_options.ttl)

    def _queue_ttl(self) -> float:
        queue_ttl = self.taskguard_options.queue_ttl
        return queue_ttl if queue_ttl is not None else self._ttl()

    # -- enqueue -----------------------------------------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: Any = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        """Publish like :meth:`celery.Task.apply_async`, carrying the lock key; with
        a queue phase, take the lock first and act on a conflict per ``on_conflict``
        (return a skipped result, raise :class:`AlreadyLocked`, return the holder's
        ``AsyncResult``, or publish with a countdown)."""
        opts = self.taskguard_options
        options.update(producer=producer, link=link, link_error=link_error, shadow=shadow)
        headers = dict(options.pop("headers", None) or {})
        incoming = headers.get(HEADER)
        if isinstance(incoming, Mapping) and incoming.get("via") == "retry":
            # Published by GuardedTask.retry(): carries its own lease (or none).
            return super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)
        key = opts.keys.derive(args, kwargs)
        header: dict[str, Any] = {"v": 1, "key": key, "via": "enqueue"}
        if not opts.locks_queue:
            headers[HEADER] = header
            return super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)

        task_id = task_id or uuid()
        guard = self._guard()
        ttl = common.clamp_ttl(self._queue_ttl() + common.publish_delay(options))
        lease, holder = common.acquire_or_holder(
            guard, key, ttl, task_name=self.name, task_id=task_id, **opts.acquire_options
        )
        if lease is None:
            return self._enqueue_conflict(key, holder, task_id, args, kwargs, headers, options)
        signals.lock_acquired.send(sender=self, key=key, lease=lease)
        header["lease"] = lease.to_dict()
        headers[HEADER] = header
        try:
            return super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)
        except BaseException:
            if not self._get_app().conf.task_always_eager:
                # Nothing was published: the lease must not wait for a worker.
                released = common.release_quietly(guard, lease)
                common.send_released(self, lease, released, common.held_seconds(lease))
            raise

    def _enqueue_conflict(
        self,
        key: str,
        holder: LockInfo | None,
        task_id: str,
        args: Any,
        kwargs: Any,
        headers: dict[str, Any],
        options: dict[str, Any],
    ) -> Any:
        strategy = self.taskguard_options.on_conflict
        holder_task = holder.holder.task_id if holder is not None else None
        if strategy == "existing" and holder_task is None:
            strategy = "skip"  # no task to point at (e.g. taken with guard.lock())
        signals.lock_conflict.send(sender=self, key=key, holder=holder, action=strategy)
        described = common.describe_holder(holder)
        if strategy == "raise":
            log.warning("refused %s[%s]: lock %r is held by %s", self.name, task_id, key, described)
            raise AlreadyLocked(key, holder)
        if strategy == "existing":
            log.warning(
                "not publishing %s: lock %r is held by %s; returning its result",
                self.name,
                key,
                described,
            )
            return self.AsyncResult(holder_task)
        if strategy == "retry":
            countdown = common.conflict_countdown(self.taskguard_options.retry_countdown, holder)
            log.warning(
                "deferring %s[%s] by %.1fs: lock %r is held by %s",
                self.name,
                task_id,
                countdown,
                key,
                described,
            )
            headers[HEADER] = {"v": 1, "key": key, "via": "enqueue", "deferred": True}
            options.pop("eta", None)
            options["countdown"] = countdown
            return super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)
        log.warning("skipped %s[%s]: lock %r is held by %s", self.name, task_id, key, described)
        value = skipped_result(
            task=self.name, task_id=task_id, key=key, phase="queue", holder=holder
        )
        conf = self._get_app().conf
        if not options.get("ignore_result", self.ignore_result) and (
            not conf.task_always_eager or conf.task_store_eager_result
        ):
            try:
                self.backend.store_result(task_id, value, celery_states.SUCCESS)
            except Exception as exc:  # the caller still gets the marker in hand
                log.warning("could not store the skipped result of %s: %s", task_id, exc)
        return EagerResult(task_id, value, celery_states.SUCCESS, name=self.name)

    # -- run ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        if (
            request is None
            or request.called_directly
            or getattr(request, "_taskguard_entered", False)
        ):
            # A direct call runs the function like plain Python: no lock.
            return super().__call__(*args, **kwargs)
        request._taskguard_entered = True
        return self._run_guarded(request, args, kwargs)

    def _run_guarded(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        opts = self.taskguard_options
        header = header_of(request)
        key = header.get("key")
        if not isinstance(key, str) or not key:
            key = opts.keys.derive(args, kwargs)
        guard = self._guard()
        if not opts.locks_run:
            blocked, holder = handoff.start_queue_phase(self, guard, request, key, header)
            if blocked:
                return self._run_conflict(request, key, holder)
            return self.run(*args, **kwargs)
        ttl = self._ttl()
        lease = claim = None
        handed = header.get("lease")
        if isinstance(handed, dict):
            lease, claim, blocked, holder = handoff.take_over(
                self, guard, request, key, handed, ttl
            )
            if blocked:
                return self._run_conflict(request, key, holder, own=True)
        if lease is None:
            lease, holder, waited = self._acquire_run(guard, request, key, ttl)
            if lease is None:
                return self._run_conflict(request, key, holder, waited=waited)
            signals.lock_acquired.send(sender=self, key=key, lease=lease)
        run = ActiveRun(guard, key, lease, request, claim)
        token = enter_run(run)
        heartbeat = Heartbeat(run, self, request.id)
        try:
            heartbeat.start()
            return self.run(*args, **kwargs)
        finally:
            heartbeat.stop()
            exit_run(token)
            self._finish(run)

    def _acquire_run(
        self, guard: TaskGuard, request: Any, key: str, ttl: float
    ) -> tuple[Lease | None, LockInfo | None, float | None]:
        """The run's lease, or the holder that kept it from us; with
        on_conflict="wait" also the seconds waited (one blocking acquire)."""
        opts = self.taskguard_options
        details = {"task_name": self.name, "task_id": request.id, "hostname": request.hostname}
        if opts.on_conflict != "wait":
            lease, holder = common.acquire_or_holder(
                guard, key, ttl, **details, **opts.acquire_options
            )
            return lease, holder, None
        timeout = opts.wait_timeout
        if timeout is None:
            setting_value = setting(self._get_app(), "taskguard_wait_timeout")
            timeout = validate_ttl(setting_value, name="taskguard_wait_timeout")
        started = time.monotonic()
        lease = guard.acquire(key, ttl, **details, **opts.acquire_options, wait=timeout)
        if lease is not None:
            return lease, None, None
        return None, common.live_holder(guard, key), time.monotonic() - started

    def _run_conflict(
        self,
        request: Any,
        key: str,
        holder: LockInfo | None,
        *,
        own: bool = False,
        waited: float | None = None,
    ) -> Any:
        opts = self.taskguard_options
        # Another delivery of this very message (broker redelivery) holds it: never
        # drop or fail it, run it once that copy is done or its lease ran out.
        own = own or (holder is not None and holder.holder.task_id == request.id)
        strategy = "retry" if own else opts.on_conflict
        if strategy in ("existing", "wait"):
            # A started task has nothing to point the caller at; a wait that timed
            # out gives up like "skip".
            strategy = "skip"
        signals.lock_conflict.send(sender=self, key=key, holder=holder, action=strategy)
        described = common.describe_holder(holder)
        if strategy == "skip":
            log.warning(
                "skipped %s[%s]%s: lock %r is held by %s",
                self.name,
                request.id,
                f" after waiting {waited:.1f}s" if waited is not None else "",
                key,
                described,
            )
            return skipped_result(
                task=self.name, task_id=request.id, key=key, phase="run", holder=holder
            )
        if strategy == "raise":
            log.warning(
                "refused %s[%s]: lock %r is held by %s", self.name, request.id, key, described
            )
            raise AlreadyLocked(key, holder)
        countdown = common.conflict_countdown(None if own else opts.retry_countdown, holder)
        log.warning(
            "retrying %s[%s] in %.1fs (%s): lock %r is held by %s",
            self.name,
            request.id,
            countdown,
            "another delivery of this task id" if own else f"retry {request.retries + 1}",
            key,
            described,
        )
        raise self.retry(countdown=countdown, exc=AlreadyLocked(key, holder))

    def _finish(self, run: ActiveRun) -> None:
        lease = run.lease
        assert lease is not None
        held_for = time.monotonic() - run.started
        if run.handed_over:
            log.debug("lock %r kept for the retry of %s", lease.key, self.name)
        else:
            released = common.release_quietly(run.guard, lease)
            if not released and run.lost is None:
                log.warning(
                    "lock %r (owner %s) had expired or been taken over before %s released it",
                    lease.key,
                    lease.owner,
                    self.name,
                )
            common.send_released(self, lease, released, held_for)
        if run.claim is not None:
            common.release_quietly(run.guard, run.claim)
            run.claim = None

    # -- retry -------------------------------------------------------------------------

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Any = None,
        throw: bool = True,
        eta: Any = None,
        countdown: Any = None,
        max_retries: Any = None,
        **options: Any,
    ) -> Any:
        """:meth:`celery.Task.retry`, keeping the lock for the retried run: the lease
        is extended to cover the countdown and handed over in the retry message."""
        request = self.request
        run = active_run()
        mine = run is not None and run.request is request and not request.called_directly
        header: dict[str, Any] = {"v": 1, "via": "retry"}
        key = run.key if mine and run is not None else header_of(request).get("key")
        if key:
            header["key"] = key
        handing = False
        # throw=False lets the body go on after publishing: no hand-off then; the lease
        # is released at the end and the retried run acquires (waiting for us if need be).
        if throw and mine and run is not None and run.lease is not None and run.lost is None:
            delay = common.retry_delay(countdown, eta, self.default_retry_delay)
            lease = run.lease
            extended = common.clamp_ttl(delay + self._ttl())
            try:
                handing = run.guard.renew(lease, extended)
            except Exception as err:  # no hand-off; the retried run acquires afresh
                log.warning("could not extend lock %r for the retry: %s", lease.key, err)
            if handing:
                header["lease"] = lease.to_dict()
        base_headers = options.pop("headers", None)
        if base_headers is None:
            base_headers = getattr(request, "headers", None) or {}
        options["headers"] = {**base_headers, HEADER: header}
        if handing and run is not None:
            # Before publishing: the retried run (same task id, so the same claim row)
            # may start, adopt and even finish at once.
            run.handed_over = True
            if run.claim is not None:
                common.release_quietly(run.guard, run.claim)
                run.claim = None
        try:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except Retry:
            raise
        except BaseException:
            # Max retries exceeded, or publishing failed (Reject): nothing took it over.
            if handing and run is not None:
                run.handed_over = False
            raise
