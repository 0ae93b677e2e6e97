"""The task surface: ``GuardedTask``, a Celery ``Task`` base class that holds a
per-key lease, and ``@guarded_task``.

Enqueue side (:meth:`GuardedTask.apply_async`): the key is derived once and put in
the message header; a pending run (coalesce, debounce) takes its place first
(:mod:`taskguard.celery.pending`), a queue phase its lease
(:mod:`taskguard.celery.handover`). Run side (:meth:`GuardedTask.__call__`, which
Celery's tracer calls for every execution, worker or eager):
:mod:`taskguard.celery.running`. A ``retry()`` hands the lease to the retry
message (below). What no ``finally`` can see (hard kill, hard time limit, revoke
with terminate) is handled in the worker's main process by
:mod:`taskguard.celery.worker`, or by expiry.

``@guarded_task`` (below) is the drop-in for ``@shared_task`` / ``@app.task``
that makes such tasks.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

from celery import Task, shared_task
from celery.exceptions import Retry
from celery.utils import uuid

from taskguard.celery import handover, pending
from taskguard.celery.deferral import publish_delay, retry_delay
from taskguard.celery.lease_calls import clamp_ttl
from taskguard.celery.message import HEADER, Header, Submission, carry
from taskguard.celery.options import (
    ATTR_PREFIX,
    GuardOptions,
    check_celery_options,
    option_defaults,
    signature_of,
    split_options,
)
from taskguard.celery.running import Run
from taskguard.config import guard_for, setting
from taskguard.exceptions import ConfigurationError
from taskguard.held_lease import active_run
from taskguard.key_derivation import KeyOption
from taskguard.options import Durations, durations
from taskguard.runs import finished_retention

__all__ = ["GuardedTask", "guarded_task"]

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

    def _durations(self) -> Durations:
        """The lease lengths and wait, defaults read from the app's settings once per
        task object (like every setting)."""
        found = self.__dict__.get("_taskguard_durations")
        if found is None:
            app = self._get_app()
            found = durations(self.taskguard_options, lambda name: setting(app, name))
            self.__dict__["_taskguard_durations"] = found
        return found

    def _ttl(self) -> float:
        """The run's lease length."""
        return self._durations().ttl

    def _run_settings(self) -> tuple[GuardOptions, float, float]:
        """What every run reads (the options, the lease's ttl, the finished records'
        retention), read once per task object."""
        cached = self.__dict__.get("_taskguard_run_settings")
        if cached is None:
            cached = (self.taskguard_options, self._ttl(), finished_retention(self._get_app()))
            self.__dict__["_taskguard_run_settings"] = cached
        return cached

    def _queue_ttl(self) -> float:
        return self._durations().queue_ttl

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
        opts = self.taskguard_options
        headers = dict(options.pop("headers", None) or {})
        incoming = headers.get(HEADER)
        if isinstance(incoming, Mapping) and incoming.get("via") == "retry":
            # Published by GuardedTask.retry(): carries its own lease (or none).
            return self._send(args, kwargs, task_id, headers, options)
        key = opts.deriver.derive(args, kwargs)
        if not opts.locks_queue and not opts.pending_runs:  # the common case: the key alone
            headers[HEADER] = Header(key).to_message()
            return self._send(args, kwargs, task_id, headers, options)
        ttl = clamp_ttl(self._queue_ttl() + publish_delay(options))
        guard = guard_for(self._get_app())
        sub = Submission(
            self,
            self._send,
            key,
            task_id or uuid(),
            args,
            kwargs,
            headers,
            options,
            guard,
            ttl,
            opts,
        )
        if opts.debounce is not None:  # publish late, replacing the pending run
            return pending.publish_debounced(sub)
        if opts.mode.pending:  # publish as the pending run, or merge into it
            return pending.publish_coalesced(sub)
        return handover.publish(sub)  # a queue phase: take the lease, publish it

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
        handed: str | None = None
        handing = False
        # throw=False lets the body go on after publishing: no hand-over then; the lease
        # is released at the end and the retried run acquires (waiting for us if need be).
        if throw and mine and run is not None and run.lease is not None and run.lost is None:
            delay = retry_delay(countdown, eta, self.default_retry_delay)
            lease = run.lease
            extended = clamp_ttl(delay + self._ttl())
            try:
                handing = run.guard.renew(lease, extended)
            except Exception as err:  # no hand-over; the retried run acquires afresh
                log.warning("could not extend lock %r for the retry: %s", lease.key, err)
            if handing:
                handed = carry(lease)
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


# -- the decorator -----------------------------------------------------------------------


@overload
def guarded_task(fun: Callable[..., Any], /) -> Any: ...


@overload
def guarded_task(
    fun: None = None,
    /,
    *,
    app: Any = None,
    key: KeyOption = None,
    key_args: Iterable[str] | None = None,
    ttl: Any = None,
    queue_ttl: Any = None,
    lock: str = "run",
    on_conflict: str | None = None,
    retry_countdown: Any = None,
    limit: int = 1,
    min_hold: Any = None,
    wait_timeout: Any = None,
    stop_on_lease_loss: bool = False,
    rate: Any = None,
    coalesce_replace: bool = False,
    debounce: Any = None,
    debounce_max: Any = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], Any]: ...


def guarded_task(
    fun: Callable[..., Any] | None = None, /, *, app: Any = None, **options: Any
) -> Any:
    """Define a Celery task that runs at most once at a time per lock key.

    Used bare (``@guarded_task``) it behaves like ``@shared_task``; with ``app=``
    like ``@app.task``. Every Celery task option (``bind``, ``name``,
    ``autoretry_for``, ``acks_late``, ``max_retries``, ``base`` — which must derive
    from :class:`GuardedTask` — …) is passed through. taskguard's own options:

    ``key``
        ``None`` (task name + digest of all bound arguments), a template over
        argument names such as ``"feed:{feed_url}"``, or a callable taking the
        task's arguments and returning the key.
    ``key_args``
        Digest only these arguments (default key form).
    ``ttl``
        Lease length in seconds (renewed every ttl/3 while the body runs);
        default: ``app.conf.taskguard_default_ttl``.
    ``queue_ttl``
        Lease length while the message is queued (queue phases; default ``ttl``).
    ``lock``
        ``"run"`` (held while the body runs), ``"queue"`` (from ``.delay()`` until a
        worker starts it) or ``"queue_and_run"`` (from ``.delay()`` until it ends).
    ``on_conflict``
        Default ``"skip"`` (with ``rate=``: a start that finds the key held is
        deferred until the key is free, never dropped), or ``"skip"``, ``"raise"``, ``"retry"``, ``"existing"`` (queue phases) or
        ``"wait"`` (``lock="run"``: block the worker until the key is free, then run;
        skipped if it is still held after ``wait_timeout``) or ``"coalesce"``
        (``lock="run"``: at most one running and one pending run per key; a
        submission while one is pending is merged into it, see
        :mod:`taskguard.celery.pending`).
    ``retry_countdown``
        Countdown of ``on_conflict="retry"``; default: until the holder's lease ends.
    ``limit``
        Concurrency limit: at most this many runs per key at once (default 1). Use
        the same limit everywhere the key is taken.
    ``min_hold``
        Throttle window in seconds: the key stays taken until this long after each
        run started, even when it returned earlier or its worker died.
    ``wait_timeout``
        Longest wait of ``on_conflict="wait"``; default:
        ``app.conf.taskguard_wait_timeout`` (300 s).
    ``stop_on_lease_loss``
        ``True``: raise :class:`~taskguard.LeaseLost` inside the body once its lease
        is lost (prefork/solo: at once, also out of a sleep; threads: at the next
        Python bytecode; gevent/eventlet: not at all). Default ``False``: the body
        runs on and :func:`check_lease` raises.
    ``rate``
        ``"N/period"`` (``"3/2s"``, ``"10/m"``): at most N runs *started* per key in
        any sliding window of ``period`` (database clock); a start over the rate is
        deferred until a slot frees, never dropped, and so (unless ``on_conflict`` is
        given) is a start that finds the key held. Does not limit concurrency.
    ``coalesce_replace``
        With ``on_conflict="coalesce"``: a submission while one is pending replaces
        the pending run (newest arguments) instead of merging into it.
    ``debounce``
        Seconds: one run this long after the key's last submission, with the last
        submission's arguments (earlier ones return the ``coalesced`` marker).
    ``debounce_max``
        With ``debounce``: under a steady stream, still run at least once per this
        many seconds.

    The options are the fields of :class:`~taskguard.celery.options.GuardOptions`.

    Options are checked here: a bad value raises :class:`ConfigurationError` naming
    the task and the option when the module is imported, and so does a name that is
    neither taskguard's nor Celery's but one edit or two away from one (``tll=60``:
    "did you mean ttl="). Other names pass, as Celery makes them task attributes.
    """
    base = options.pop("base", None) or GuardedTask
    if not (isinstance(base, type) and issubclass(base, GuardedTask)):
        raise ConfigurationError(
            f"guarded_task(base=...) must derive from GuardedTask, not {base!r}"
        )
    # Every option is set on the task, so a base class's taskguard_* never leaks in.
    ours = {**option_defaults(), **split_options(options)}

    def decorate(func: Callable[..., Any]) -> Any:
        if not callable(func):
            raise ConfigurationError(f"@guarded_task must decorate a function, not {func!r}")
        name = options.get("name") or f"{func.__module__}.{func.__name__}"
        check_celery_options(name, options, base)  # a misspelled option (tll=60)
        GuardOptions.build(name, signature_of(func, bind=bool(options.get("bind"))), **ours)
        attrs = {ATTR_PREFIX + k: v for k, v in ours.items()}
        if app is not None:
            return app.task(base=base, **attrs, **options)(func)
        return shared_task(base=base, **attrs, **options)(func)

    if fun is not None:
        return decorate(fun)
    return decorate
