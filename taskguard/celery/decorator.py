"""``@guarded_task``: a drop-in for ``@shared_task`` / ``@app.task``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

from celery import shared_task

from taskguard.celery.keys import KeyOption
from taskguard.celery.options import (
    ATTR_PREFIX,
    GuardOptions,
    check_celery_options,
    option_defaults,
    signature_of,
    split_options,
)
from taskguard.celery.task import GuardedTask
from taskguard.exceptions import ConfigurationError

__all__ = ["guarded_task"]


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
