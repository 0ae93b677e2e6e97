"""taskguard's own task options, declared once (:class:`GuardOptions`).

The dataclass's option fields are the single list of names and defaults: the
decorator splits its keyword arguments by them, :class:`GuardedTask` gets one
``taskguard_<name>`` attribute per field, and :meth:`GuardOptions.build` checks
them once when the task is defined. (The decorator's typed overload repeats the
names for type checkers; a unit test keeps it equal to the fields.)
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from functools import cached_property
from typing import Any

from taskguard.celery.conflicts import SKIP, STRATEGIES, Strategy, check_options, strategy_named
from taskguard.celery.pending import check_debounce
from taskguard.celery.rate import BUSY, Rate, check_rate, parse_rate
from taskguard.exceptions import ConfigurationError, InvalidTTL
from taskguard.keys import KeyDeriver, KeyOption, validate_limit, validate_ttl

__all__ = [
    "ATTR_PREFIX",
    "CELERY_OPTIONS",
    "CONFLICT_STRATEGIES",
    "LOCK_PHASES",
    "OPTION_NAMES",
    "GuardOptions",
    "check_celery_options",
    "option_defaults",
    "signature_of",
    "split_options",
]

#: When the lock is held: while the body runs; from enqueue until a worker starts
#: it; or from enqueue until the body finishes.
LOCK_PHASES = ("run", "queue", "queue_and_run")
#: What a submission does when the key is held (taskguard.celery.conflicts).
CONFLICT_STRATEGIES = tuple(STRATEGIES)
#: Task attribute of option ``name``: ``taskguard_<name>``.
ATTR_PREFIX = "taskguard_"


def _seconds(task: str, name: str, value: object) -> float | None:
    if value is None:
        return None
    try:
        return validate_ttl(value, name=name)
    except InvalidTTL as exc:
        raise ConfigurationError(f"task {task}: {exc}") from None


def _countdown(task: str, name: str, value: object) -> float | None:
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


def _as_is(task: str, name: str, value: object) -> Any:
    return value  # checked with the other options (see _check_combinations, KeyDeriver)


def _limit(task: str, name: str, value: object) -> int:
    try:
        return validate_limit(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"task {task}: {exc}") from None


def _flag(task: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"task {task}: {name} must be True or False, got {value!r}")
    return value


def _rate(task: str, name: str, value: object) -> Rate | None:
    return parse_rate(task, value)


def _checked_by(check: Callable[[str, str, Any], Any]) -> dict[str, Any]:
    """Field metadata of an option: how its raw value is checked (task, name, value)."""
    return {"check": check}


@dataclass(frozen=True)
class GuardOptions:
    """taskguard's options of one task: declared here once, validated by :meth:`build`."""

    #: Lock key: ``None`` (task name + digest of all arguments), a template such as
    #: ``"feed:{feed_url}"``, or a callable taking the task's arguments.
    key: KeyOption = field(default=None, metadata=_checked_by(_as_is))
    #: Digest only these arguments (default key form).
    key_args: tuple[str, ...] | None = field(default=None, metadata=_checked_by(_as_is))
    #: Lease length in seconds; ``None``: the app's ``taskguard_default_ttl``.
    ttl: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: Lease length while the message waits in the queue; ``None``: same as the ttl.
    queue_ttl: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: ``"run"``, ``"queue"`` or ``"queue_and_run"``.
    lock: str = field(default="run", metadata=_checked_by(_as_is))
    #: ``"skip"``, ``"raise"``, ``"retry"``, ``"existing"``, ``"wait"`` or ``"coalesce"``;
    #: not given (``None``): ``"skip"``, and with ``rate=`` a busy start is deferred
    #: (``defer_busy``). ``build`` stores the strategy, never ``None``.
    on_conflict: str | None = field(default=None, metadata=_checked_by(_as_is))
    #: Countdown for ``on_conflict="retry"``; ``None``: the time left on the holder's lease.
    retry_countdown: float | None = field(default=None, metadata=_checked_by(_countdown))
    #: Concurrency limit: at most this many runs per key at once.
    limit: int = field(default=1, metadata=_checked_by(_limit))
    #: Throttle window (seconds): the key stays taken this long after each grant.
    min_hold: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: Longest wait of ``on_conflict="wait"``; ``None``: ``taskguard_wait_timeout``.
    wait_timeout: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: Raise :class:`~taskguard.LeaseLost` inside the body once its lease is lost
    #: (see taskguard.holding.Interrupter for what each pool can do).
    stop_on_lease_loss: bool = field(default=False, metadata=_checked_by(_flag))
    #: [coalesce/rate] Per-key start rate, ``"N/period"`` such as ``"3/2s"`` or
    #: ``"10/m"`` (see taskguard.celery.rate); ``build`` turns it into a :class:`Rate`.
    rate: str | tuple[int, float] | Rate | None = field(default=None, metadata=_checked_by(_rate))
    #: [coalesce/rate] ``on_conflict="coalesce"``: a later submission replaces the
    #: pending run's arguments (it becomes the pending run) instead of merging into it.
    coalesce_replace: bool = field(default=False, metadata=_checked_by(_flag))
    #: [debounce] Run once, this many seconds after the key's last submission, with
    #: its arguments (see taskguard.celery.pending).
    debounce: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: [debounce] Under a steady stream, still run at least once per this many seconds.
    debounce_max: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: Computes the key (built from ``key``/``key_args`` and the task's signature).
    keys: KeyDeriver | None = field(default=None, compare=False)
    #: [rate] A start that finds the run's lock held is deferred (published again with
    #: a countdown) instead of skipped: ``rate=`` without ``on_conflict`` (set by ``build``).
    defer_busy: bool = False

    @classmethod
    def build(cls, task_name: str, signature: inspect.Signature, **raw: Any) -> GuardOptions:
        """Validate raw option values (names as the fields); a :class:`ConfigurationError`
        naming the task and the option otherwise."""
        unknown = sorted(set(raw) - set(OPTION_NAMES))
        if unknown:
            raise ConfigurationError(f"task {task_name}: unknown taskguard option(s) {unknown}")
        values = {**_DEFAULTS, **raw}
        _check_combinations(task_name, values)
        checked = {
            f.name: f.metadata["check"](task_name, f.name, values[f.name])
            for f in fields(cls)
            if "check" in f.metadata
        }
        keys = KeyDeriver(task_name, signature, key=checked["key"], key_args=checked["key_args"])
        given = checked["on_conflict"] is not None
        return cls(
            **{
                **checked,
                "key_args": keys.key_args,
                "on_conflict": checked["on_conflict"] or "skip",
            },
            keys=keys,
            defer_busy=not given and checked["rate"] is not None,
        )

    @classmethod
    def from_attributes(cls, task: Any) -> GuardOptions:
        """Validated options from a task's ``taskguard_<name>`` attributes."""
        raw = {name: getattr(task, ATTR_PREFIX + name) for name in OPTION_NAMES}
        return cls.build(task.name, inspect.signature(task.run), **raw)

    @property
    def deriver(self) -> KeyDeriver:
        """The key deriver (only options made by :meth:`build` have one)."""
        if self.keys is None:
            raise ConfigurationError("GuardOptions made without build() cannot derive keys")
        return self.keys

    @cached_property
    def acquire_options(self) -> Mapping[str, Any]:
        """Extra keyword arguments for :meth:`TaskGuard.acquire` (limit, min_hold)."""
        # Read on every run and publish: derived once (the options are frozen), and
        # typed read-only since every caller shares it.
        extra: dict[str, Any] = {}
        if self.limit != 1:
            extra["limit"] = self.limit
        if self.min_hold is not None:
            extra["min_hold"] = self.min_hold
        return extra

    @cached_property
    def strategy(self) -> Strategy:
        """What a conflict does (the unit of ``on_conflict``; with ``rate=`` and no
        ``on_conflict``, a busy start waits its turn)."""
        if self.defer_busy:
            return BUSY
        return STRATEGIES[self.on_conflict] if self.on_conflict else SKIP

    @cached_property
    def pending_runs(self) -> bool:
        """[coalesce/debounce] Whether a submission may wait as the key's pending run."""
        return self.strategy.pending or self.debounce is not None

    @cached_property
    def plain(self) -> bool:
        """The common run: the lock held while the body runs and taken by one acquire
        of one slot; no pending runs, rate, limit, throttle window or wait."""
        no_extras = not self.acquire_options and not self.strategy.waits
        return self.locks_run and no_extras and not self.pending_runs and self.rate is None

    @cached_property
    def locks_queue(self) -> bool:
        """Whether ``.delay()``/``.apply_async()`` take the lock before publishing."""
        return self.lock in ("queue", "queue_and_run")

    @cached_property
    def locks_run(self) -> bool:
        """Whether the lock is held while the body runs."""
        return self.lock in ("run", "queue_and_run")


#: The option names, in declaration order.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(GuardOptions) if "check" in f.metadata)
_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(GuardOptions) if f.name in OPTION_NAMES
}


#: Celery's task decorator options that are not attributes of its Task class (those
#: are read from the class itself: see :func:`check_celery_options`), and the message
#: options ``apply_async`` reads from task attributes.
CELERY_OPTIONS = frozenset(
    {
        "shared",
        "filter",
        "lazy",
        "base",
        "bind",
        "pydantic",
        "pydantic_strict",
        "pydantic_context",
        "pydantic_dump_kwargs",
        "autoretry_for",
        "dont_autoretry_for",
        "retry_kwargs",
        "retry_backoff",
        "retry_backoff_max",
        "retry_jitter",
        "queue",
        "routing_key",
        "exchange",
        "delivery_mode",
        "compression",
        "immediate",
        "mandatory",
    }
)


def _distance(a: str, b: str) -> int:
    """Edits (insert, delete, replace, swap two neighbours) from ``a`` to ``b``."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, prev2[j - 2] + 1)
            row.append(cost)
        prev2, prev = prev, row
    return prev[-1]


def _is_method(value: object) -> bool:
    return callable(value) or isinstance(value, (classmethod, staticmethod, property))


def check_celery_options(task_name: str, options: Mapping[str, Any], task_class: type) -> None:
    """Refuse a keyword argument of ``@guarded_task`` that is neither taskguard's
    nor Celery's but looks like a misspelling of one (``tll=60``), naming the nearest.
    Names unlike any option pass: Celery makes them task attributes, and users
    rely on that for attributes of their own."""
    ours = set(OPTION_NAMES)
    attributes = {n for n in dir(task_class) if not n.startswith("_")}
    # What a misspelling may be of: options, not methods (``s``, ``map``, ``retry``).
    # Read statically: Celery's class properties (``app``) bind the class to the
    # current app when read, which would fix its settings (``acks_late``) for good.
    settable = {n for n in attributes if not _is_method(inspect.getattr_static(task_class, n))}
    for name in options:
        if name in ours or name in CELERY_OPTIONS or name in attributes or len(name) < 3:
            continue
        candidates = ours | settable | CELERY_OPTIONS
        score, nearest = min((_distance(name, known), known) for known in candidates)
        alike = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.8)
        # One edit for short names, two for longer ones (``on_confict``, ``acks_lat``),
        # or most of the letters in order (``max_retry``).
        if score <= (1 if len(nearest) <= 5 else 2) or alike:
            nearest = nearest if score <= 2 else alike[0]
            whose = "a taskguard option" if nearest in ours else "a Celery task option"
            raise ConfigurationError(
                f"task {task_name}: unknown option {name}={options[name]!r}: did you mean "
                f"{nearest}= ({whose})?"
            )


def option_defaults() -> dict[str, Any]:
    """``{name: default}`` of every option."""
    return dict(_DEFAULTS)


def split_options(options: dict[str, Any]) -> dict[str, Any]:
    """Remove taskguard's options from ``options`` (a decorator's keyword arguments)
    and return them; what is left is Celery's."""
    return {name: options.pop(name) for name in OPTION_NAMES if name in options}


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


def _check_combinations(task: str, values: Mapping[str, Any]) -> None:
    lock, on_conflict = values["lock"], values["on_conflict"] or "skip"
    if lock not in LOCK_PHASES:
        raise ConfigurationError(
            f"task {task}: lock={lock!r} is not one of {', '.join(map(repr, LOCK_PHASES))}"
        )
    strategy = strategy_named(task, on_conflict)
    strategy.check(task, values)
    if values["queue_ttl"] is not None and lock == "run":
        raise ConfigurationError(
            f"task {task}: queue_ttl applies to lock='queue'/'queue_and_run' only"
        )
    check_options(task, strategy, values)
    check_debounce(task, values, strategy)
    check_rate(task, values)
