"""taskguard's own task options, checked once when the task is defined."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from taskguard.celery.keys import KeyDeriver, KeyOption
from taskguard.exceptions import ConfigurationError, InvalidTTL
from taskguard.guard import MAX_LIMIT
from taskguard.keys import validate_ttl

__all__ = ["CONFLICT_STRATEGIES", "LOCK_PHASES", "GuardOptions", "build_options", "signature_of"]

#: When the lock is held: while the body runs; from enqueue until a worker starts
#: it; or from enqueue until the body finishes.
LOCK_PHASES = ("run", "queue", "queue_and_run")
#: What a submission does when the key is held.
CONFLICT_STRATEGIES = ("skip", "raise", "retry", "existing", "wait")


@dataclass(frozen=True)
class GuardOptions:
    """The validated taskguard options of one task."""

    lock: str
    on_conflict: str
    #: Lease length in seconds; ``None``: the app's ``taskguard_default_ttl``.
    ttl: float | None
    #: Lease length while the message waits in the queue; ``None``: same as the ttl.
    queue_ttl: float | None
    #: Countdown for ``on_conflict="retry"``; ``None``: the time left on the holder's lease.
    retry_countdown: float | None
    keys: KeyDeriver
    #: Concurrency limit: at most this many runs per key at once.
    limit: int = 1
    #: Throttle window (seconds): the key stays taken this long after each grant.
    min_hold: float | None = None
    #: Longest wait of ``on_conflict="wait"``; ``None``: ``taskguard_wait_timeout``.
    wait_timeout: float | None = None

    @property
    def acquire_options(self) -> dict[str, Any]:
        """Extra keyword arguments for :meth:`TaskGuard.acquire` (limit, min_hold)."""
        extra: dict[str, Any] = {}
        if self.limit != 1:
            extra["limit"] = self.limit
        if self.min_hold is not None:
            extra["min_hold"] = self.min_hold
        return extra

    @property
    def locks_queue(self) -> bool:
        """Whether ``.delay()``/``.apply_async()`` take the lock before publishing."""
        return self.lock in ("queue", "queue_and_run")

    @property
    def locks_run(self) -> bool:
        """Whether the lock is held while the body runs."""
        return self.lock in ("run", "queue_and_run")


def signature_of(fun: Callable[..., Any], *, bind: bool = False) -> inspect.Signature:
    """The signature callers use for a task function (``self`` dropped when bound)."""
    try:
        sig = inspect.signature(fun)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"cannot read the signature of {fun!r}: {exc}") from None
    if bind:
        params = list(sig.parameters.values())
        if not params or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            raise ConfigurationError(f"bind=True task {fun!r} must take the task as first argument")
        sig = sig.replace(parameters=params[1:])
    return sig


def _seconds(task: str, name: str, value: object) -> float | None:
    if value is None:
        return None
    try:
        return validate_ttl(value, name=name)
    except InvalidTTL as exc:
        raise ConfigurationError(f"task {task}: {exc}") from None


def _countdown(task: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigurationError(
            f"task {task}: retry_countdown must be a non-negative number of seconds, got {value!r}"
        )
    return float(value)


def build_options(
    task_name: str,
    signature: inspect.Signature,
    *,
    key: KeyOption = None,
    key_args: Iterable[str] | None = None,
    ttl: object = None,
    queue_ttl: object = None,
    lock: object = "run",
    on_conflict: object = "skip",
    retry_countdown: object = None,
    limit: object = 1,
    min_hold: object = None,
    wait_timeout: object = None,
) -> GuardOptions:
    """Validate taskguard's options for a task; a :class:`ConfigurationError`
    naming the task and the option otherwise."""
    if lock not in LOCK_PHASES:
        raise ConfigurationError(
            f"task {task_name}: lock={lock!r} is not one of {', '.join(map(repr, LOCK_PHASES))}"
        )
    if on_conflict not in CONFLICT_STRATEGIES:
        raise ConfigurationError(
            f"task {task_name}: on_conflict={on_conflict!r} is not one of "
            f"{', '.join(map(repr, CONFLICT_STRATEGIES))}"
        )
    if on_conflict == "existing" and lock == "run":
        raise ConfigurationError(
            f"task {task_name}: on_conflict='existing' returns the queued holder's result at "
            "enqueue, so it needs lock='queue' or lock='queue_and_run'"
        )
    if queue_ttl is not None and lock == "run":
        raise ConfigurationError(
            f"task {task_name}: queue_ttl applies to lock='queue'/'queue_and_run' only"
        )
    if retry_countdown is not None and on_conflict != "retry":
        raise ConfigurationError(
            f"task {task_name}: retry_countdown applies to on_conflict='retry' only"
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(
            f"task {task_name}: limit must be an int from 1 to {MAX_LIMIT}, got {limit!r}"
        )
    if on_conflict == "wait" and lock != "run":
        raise ConfigurationError(
            f"task {task_name}: on_conflict='wait' blocks a worker until the key is free, "
            "so it needs lock='run' (publishers never block)"
        )
    if wait_timeout is not None and on_conflict != "wait":
        raise ConfigurationError(
            f"task {task_name}: wait_timeout applies to on_conflict='wait' only"
        )
    return GuardOptions(
        lock=str(lock),
        on_conflict=str(on_conflict),
        ttl=_seconds(task_name, "ttl", ttl),
        queue_ttl=_seconds(task_name, "queue_ttl", queue_ttl),
        retry_countdown=_countdown(task_name, retry_countdown),
        keys=KeyDeriver(task_name, signature, key=key, key_args=key_args),
        limit=limit,
        min_hold=_seconds(task_name, "min_hold", min_hold),
        wait_timeout=_seconds(task_name, "wait_timeout", wait_timeout),
    )
