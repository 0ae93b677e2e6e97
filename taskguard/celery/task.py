"""``GuardedTask``: a Celery ``Task`` base class that holds a per-key lease.

Enqueue side (:meth:`GuardedTask.apply_async`): :mod:`taskguard.celery.enqueue`.
Run side (:meth:`GuardedTask.__call__`, which Celery's tracer calls for every
execution, worker or eager): :mod:`taskguard.celery.running`. A ``retry()``
hands the lease to the retry message (below). What no ``finally`` can see (hard
kill, hard time limit, revoke with terminate) is handled in the worker's main
process by :mod:`taskguard.celery.worker`, or by expiry.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from celery import Task
from celery.exceptions import Retry
from celery.signals import task_revoked

from taskguard.celery import enqueue
from taskguard.celery.countdowns import retry_delay
from taskguard.celery.header import HEADER, Header
from taskguard.celery.leasing import clamp_ttl, default_ttl
from taskguard.celery.options import ATTR_PREFIX, GuardOptions, option_defaults
from taskguard.celery.renewal import active_run
from taskguard.celery.running import Run
from taskguard.celery.worker import release_unstarted

__all__ = ["GuardedTask"]

log = logging.getLogger("taskguard.celery")


class GuardedTask(Task):  # type: ignore[misc]
    """Celery task base class running at most one execution per lock key (at most
    ``taskguard_limit`` with a concurrency limit).

    Use :func:`taskguard.guarded_task`, or ``@app.task(base=GuardedTask,
    taskguard_key=..., taskguard_ttl=..., taskguard_lock=..., taskguard_on_conflict=...)``:
    every field of :class:`~taskguard.celery.options.GuardOptions` is a
    ``taskguard_<name>`` attribute with the field's default.
    """

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
            opts = GuardOptions.from_attributes(self)
            self.__dict__["_taskguard_options"] = opts
        return opts

    def taskguard_key_for(self, args: Any = None, kwargs: Any = None) -> str:
        """The lock key a call with ``args``/``kwargs`` would use."""
        return self.taskguard_options.deriver.derive(args, kwargs)

    def _ttl(self) -> float:
        """The run's lease length (read once per task object, like every setting)."""
        ttl = self.__dict__.get("_taskguard_ttl")
        if ttl is None:
            ttl = default_ttl(self._get_app(), self.taskguard_options.ttl)
            self.__dict__["_taskguard_ttl"] = ttl
        return float(ttl)

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
        options.update(producer=producer, link=link, link_error=link_error, shadow=shadow)
        return enqueue.publish(self, self._send, args, kwargs, task_id, options)

    def _send(
        self, args: Any, kwargs: Any, task_id: Any, headers: Any, options: dict[str, Any]
    ) -> Any:
        return super().apply_async(args, kwargs, task_id=task_id, headers=headers, **options)

    # -- run ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        if request is None or request.called_directly:
            # A direct call runs the function like plain Python: no lock.
            return super().__call__(*args, **kwargs)
        run = active_run()
        if run is not None and run.request is request:  # called again inside its own run
            return super().__call__(*args, **kwargs)
        return Run(self, request, args, kwargs).execute()

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
        mine = isinstance(run, Run) and run.request is request and not request.called_directly
        key = run.key if mine and run is not None else Header.of(request).key
        # deferred: a lock="queue" conflict (Run.conflict); the retry checks the key again.
        deferred = mine and isinstance(run, Run) and run.deferred
        handed: dict[str, Any] | None = None
        handing = False
        # throw=False lets the body go on after publishing: no hand-off then; the lease
        # is released at the end and the retried run acquires (waiting for us if need be).
        if throw and mine and run is not None and run.lease is not None and run.lost is None:
            delay = retry_delay(countdown, eta, self.default_retry_delay)
            lease = run.lease
            extended = clamp_ttl(delay + self._ttl())
            try:
                handing = run.guard.renew(lease, extended)
            except Exception as err:  # no hand-off; the retried run acquires afresh
                log.warning("could not extend lock %r for the retry: %s", lease.key, err)
            if handing:
                handed = lease.to_dict()
        base_headers = options.pop("headers", None)
        if base_headers is None:
            base_headers = getattr(request, "headers", None) or {}
        header = Header(key or None, "retry", lease=handed, deferred=deferred or None)
        options["headers"] = {**base_headers, HEADER: header.to_message()}
        if handing and run is not None:
            # Before publishing: the retried run may start, adopt and even finish at once.
            run.handed_over = True
        try:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        except Retry:
            raise
        except BaseException:
            # Max retries exceeded, or publishing failed (Reject): nothing took it over.
            if handing and run is not None:
                run.handed_over = False
            raise


# One attribute per option, with the option's default (the declaration is GuardOptions).
for _name, _default in option_defaults().items():
    setattr(GuardedTask, ATTR_PREFIX + _name, _default)


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if isinstance(sender, GuardedTask) and request is not None and not terminated:
        release_unstarted(sender, request, Header.of(request))


task_revoked.connect(_on_revoked, weak=False, dispatch_uid="taskguard.celery.worker.revoked")
