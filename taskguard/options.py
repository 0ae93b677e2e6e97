"""A guarded task's options, declared once for every framework (issue 42).

:class:`GuardOptions` is the one list of option names and defaults; :meth:`GuardOptions.build`
checks a declaration once: each value (:data:`_CHECKS`), what the framework can
honour (:class:`Framework`), then every rule between options (:data:`RULES`), each
refusal one line naming the task and the option. The lock phases (:class:`Phase`)
and conflict modes (:class:`Conflict`, with what each accepts in :data:`MODES`) are
values: integrations look their own actions up by them and never compare names.
:func:`durations` resolves the defaults from the settings. Imports nothing from an
integration.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from enum import StrEnum
from functools import cached_property
from typing import Any

from taskguard.exceptions import ConfigurationError, InvalidTTL
from taskguard.key_derivation import KeyDeriver, KeyOption
from taskguard.validation import MAX_LIMIT, MAX_TTL, validate_limit, validate_ttl

__all__ = [
    "CELERY",
    "MODES",
    "OPTION_NAMES",
    "RULES",
    "Conflict",
    "Durations",
    "Framework",
    "GuardOptions",
    "Mode",
    "Phase",
    "Rate",
    "durations",
    "option_defaults",
    "parse_rate",
]


class Phase(StrEnum):
    """When the lock is held: while the body runs; from enqueue until a worker starts
    it; or from enqueue until the body finishes."""

    RUN = "run"
    QUEUE = "queue"
    QUEUE_AND_RUN = "queue_and_run"


class Conflict(StrEnum):
    """What a run or an enqueue does when its key is held: the ``on_conflict`` values,
    and ``DEFER`` (chosen by the options, never named: ``rate=`` without
    ``on_conflict``, a busy start waits its turn, re-checked like a pending run)."""

    SKIP = "skip"
    RAISE = "raise"
    RETRY = "retry"
    EXISTING = "existing"
    WAIT = "wait"
    COALESCE = "coalesce"
    DEFER = "defer"


_ANY_PHASE = frozenset(Phase)
_RUN_ONLY = frozenset({Phase.RUN})


@dataclass(frozen=True)
class Mode:
    """What one conflict mode accepts: its lock phases (``needs``: why, when not all),
    the options only it takes; whether its run blocks in one acquire (``waits``) or
    keeps one pending run per key (``pending``)."""

    phases: frozenset[Phase] = _ANY_PHASE
    needs: str = ""
    options: tuple[str, ...] = ()
    waits: bool = False
    pending: bool = False


#: Every conflict mode; the order is the docs' (DEFER last: not an ``on_conflict`` value).
MODES: dict[Conflict, Mode] = {
    Conflict.SKIP: Mode(),
    Conflict.RAISE: Mode(),
    Conflict.RETRY: Mode(options=("retry_countdown",)),
    Conflict.EXISTING: Mode(
        frozenset({Phase.QUEUE, Phase.QUEUE_AND_RUN}),
        "returns the queued holder's result at enqueue, so it needs lock='queue' or "
        "lock='queue_and_run'",
    ),
    Conflict.WAIT: Mode(
        _RUN_ONLY,
        "blocks a worker until the key is free, so it needs lock='run' (publishers never block)",
        ("wait_timeout",),
        waits=True,
    ),
    Conflict.COALESCE: Mode(
        _RUN_ONLY,
        "keeps one run pending while one runs, so it needs lock='run'",
        ("coalesce_replace",),
        pending=True,
    ),
    Conflict.DEFER: Mode(),
}
_NAMED = tuple(c for c in Conflict if c is not Conflict.DEFER)


@dataclass(frozen=True)
class Rate:
    """At most ``starts`` starts per key in any window of ``period`` seconds."""

    starts: int
    period: float

    def __str__(self) -> str:
        return f"{self.starts}/{self.period:g}s"


#: What the error message of a bad ``rate=`` shows as accepted.
RATE_FORMS = (
    "'N/s', 'N/m', 'N/h', 'N/d' or 'N/<number><unit>' such as '3/2s' or '10/15m' "
    f"(N from 1 to {MAX_LIMIT}), or a tuple (N, seconds)"
)
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([smhd])?\s*$")


def parse_rate(task: str, value: object) -> Rate | None:
    """``rate=`` as a :class:`Rate` (``None`` stays ``None``); a one-line
    :class:`ConfigurationError` naming the task and the accepted forms otherwise."""
    if value is None or isinstance(value, Rate):
        return value
    bad = ConfigurationError(f"task {task}: rate={value!r} is not one of {RATE_FORMS}")
    starts: object
    period: object
    if isinstance(value, str):
        match = _RATE.match(value)
        if match is None or (match.group(2) is None and match.group(3) is None):
            raise bad
        starts = int(match.group(1))
        period = float(match.group(2) or 1) * _UNITS[match.group(3) or "s"]
    elif isinstance(value, tuple) and len(value) == 2:
        starts, period = value
        if isinstance(period, timedelta):
            period = period.total_seconds()
    else:
        raise bad
    if (
        isinstance(starts, bool)
        or not isinstance(starts, int)
        or not 1 <= starts <= MAX_LIMIT
        or isinstance(period, bool)
        or not isinstance(period, (int, float))
        or not math.isfinite(period)
        or not 0 < period <= MAX_TTL
    ):
        raise bad
    return Rate(starts, float(period))


# -- each value on its own (task, name, value) -> the checked value ------------------------


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
            f"task {task}: {name} must be a non-negative number of seconds, got {value!r}"
        )
    return float(value)


def _as_is(task: str, name: str, value: object) -> Any:
    return value  # checked with the key (KeyDeriver)


def _limit(task: str, name: str, value: object) -> int:
    try:
        return validate_limit(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"task {task}: {exc}") from None


def _flag(task: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"task {task}: {name} must be True or False, got {value!r}")
    return value


def _one_of(kind: type[StrEnum], values: tuple[StrEnum, ...]) -> Callable[[str, str, Any], Any]:
    def check(task: str, name: str, value: object) -> Any:
        if value is None and kind is Conflict:
            return None  # not given: skip (DEFER with rate=), see GuardOptions.conflict
        if isinstance(value, str) and value in values:
            return kind(value)
        named = ", ".join(f"'{v}'" for v in values)
        raise ConfigurationError(f"task {task}: {name}={value!r} is not one of {named}")

    return check


def _rate(task: str, name: str, value: object) -> Rate | None:
    return parse_rate(task, value)


def _checked_by(check: Callable[[str, str, Any], Any]) -> dict[str, Any]:
    """Field metadata of an option: how its raw value is checked (task, name, value)."""
    return {"check": check}


@dataclass(frozen=True)
class GuardOptions:
    """A guarded task's options: declared here once, validated by :meth:`build`."""

    #: Lock key: ``None`` (task name + digest of all arguments), a template such as
    #: ``"feed:{feed_url}"``, or a callable taking the task's arguments.
    key: KeyOption = field(default=None, metadata=_checked_by(_as_is))
    #: Digest only these arguments (default key form).
    key_args: tuple[str, ...] | None = field(default=None, metadata=_checked_by(_as_is))
    #: Lease length in seconds; ``None``: the ``taskguard_default_ttl`` setting.
    ttl: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: Lease length while the job waits in the queue; ``None``: same as the ttl.
    queue_ttl: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: When the lock is held (a :class:`Phase`).
    lock: Phase = field(default=Phase.RUN, metadata=_checked_by(_one_of(Phase, tuple(Phase))))
    #: What a conflict does (a :class:`Conflict`); ``None``: not given (skip, or with
    #: ``rate=`` a busy start is deferred): see :attr:`conflict`.
    on_conflict: Conflict | None = field(
        default=None, metadata=_checked_by(_one_of(Conflict, _NAMED))
    )
    #: Countdown for ``on_conflict="retry"``; ``None``: the time left on the holder's lease.
    retry_countdown: float | None = field(default=None, metadata=_checked_by(_countdown))
    #: Concurrency limit: at most this many runs per key at once.
    limit: int = field(default=1, metadata=_checked_by(_limit))
    #: Throttle window (seconds): the key stays taken this long after each grant.
    min_hold: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: Longest wait of ``on_conflict="wait"``; ``None``: the ``taskguard_wait_timeout`` setting.
    wait_timeout: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: Raise :class:`~taskguard.LeaseLost` inside the body once its lease is lost
    #: (see taskguard.held_lease.Interrupter for what each pool can do).
    stop_on_lease_loss: bool = field(default=False, metadata=_checked_by(_flag))
    #: [rate] Per-key start rate, ``"N/period"`` such as ``"3/2s"`` or ``"10/m"``.
    rate: str | tuple[int, float] | Rate | None = field(default=None, metadata=_checked_by(_rate))
    #: [coalesce] A later submission replaces the pending run's arguments.
    coalesce_replace: bool = field(default=False, metadata=_checked_by(_flag))
    #: [debounce] Run once, this many seconds after the key's last submission.
    debounce: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: [debounce] Under a steady stream, still run at least once per this many seconds.
    debounce_max: float | None = field(default=None, metadata=_checked_by(_seconds))
    #: Computes the key (built from ``key``/``key_args`` and the task's signature).
    keys: KeyDeriver | None = field(default=None, compare=False)

    @classmethod
    def build(
        cls,
        task_name: str,
        signature: inspect.Signature,
        framework: Framework | None = None,
        **raw: Any,
    ) -> Any:
        """Validate raw option values (names as the fields) for ``framework``
        (default: one that has every capability); a :class:`ConfigurationError`
        naming the task and the option otherwise."""
        unknown = sorted(set(raw) - set(OPTION_NAMES))
        if unknown:
            raise ConfigurationError(f"task {task_name}: unknown taskguard option(s) {unknown}")
        values = {**_DEFAULTS, **raw}
        checked = {
            f.name: f.metadata["check"](task_name, f.name, values[f.name])
            for f in fields(GuardOptions)
            if "check" in f.metadata
        }
        (framework or CELERY).refuse_lacking(task_name, checked)
        for option, refused, why in RULES:
            if refused(checked):
                said = why(checked) if callable(why) else why
                raise ConfigurationError(f"task {task_name}: {option}{said}")
        keys = KeyDeriver(task_name, signature, key=checked["key"], key_args=checked["key_args"])
        return cls(**{**checked, "key_args": keys.key_args}, keys=keys)

    @property
    def deriver(self) -> KeyDeriver:
        """The key deriver (only options made by :meth:`build` have one)."""
        if self.keys is None:
            raise ConfigurationError("GuardOptions made without build() cannot derive keys")
        return self.keys

    @cached_property
    def conflict(self) -> Conflict:
        """The conflict mode: ``on_conflict``, else ``DEFER`` with ``rate=``, else ``SKIP``."""
        if self.on_conflict is not None:
            return self.on_conflict
        return Conflict.DEFER if self.rate is not None else Conflict.SKIP

    @cached_property
    def mode(self) -> Mode:
        return MODES[self.conflict]

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
    def pending_runs(self) -> bool:
        """[coalesce/debounce] Whether a submission may wait as the key's pending run."""
        return self.mode.pending or self.debounce is not None

    @cached_property
    def plain(self) -> bool:
        """The common run: the lock held while the body runs and taken by one acquire
        of one slot; no pending runs, rate, limit, throttle window or wait."""
        no_extras = not self.acquire_options and not self.mode.waits
        return self.locks_run and no_extras and not self.pending_runs and self.rate is None

    @cached_property
    def locks_queue(self) -> bool:
        """Whether an enqueue takes the lock before the job is queued."""
        return self.lock is not Phase.RUN

    @cached_property
    def locks_run(self) -> bool:
        """Whether the lock is held while the body runs."""
        return self.lock is not Phase.QUEUE

    @cached_property
    def adopts_queue_lease(self) -> bool:
        """Whether the run takes over the lease its enqueue took (``queue_and_run``)."""
        return self.locks_queue and self.locks_run


#: The option names, in declaration order.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(GuardOptions) if "check" in f.metadata)
_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(GuardOptions) if f.name in OPTION_NAMES
}


def option_defaults() -> dict[str, Any]:
    """``{name: default}`` of every option."""
    return dict(_DEFAULTS)


def _given(values: Mapping[str, Any], name: str) -> bool:
    return bool(values[name] != _DEFAULTS[name])


def _owned_elsewhere(option: str, owner: Conflict) -> Callable[[Mapping[str, Any]], bool]:
    return lambda v: _given(v, option) and (v["on_conflict"] or Conflict.SKIP) is not owner


def _phase_refused(v: Mapping[str, Any]) -> bool:
    return bool(v["lock"] not in MODES[v["on_conflict"] or Conflict.SKIP].phases)


#: Every rule between options: (the option named, refused(checked values), what
#: follows the option in the message), in the order they are checked.
RULES: tuple[tuple[str, Callable[[Mapping[str, Any]], bool], Any], ...] = (
    (
        "on_conflict",
        _phase_refused,
        lambda v: f"='{v['on_conflict']}' {MODES[v['on_conflict']].needs}",
    ),
    (
        "queue_ttl",
        lambda v: _given(v, "queue_ttl") and v["lock"] is Phase.RUN,
        " applies to lock='queue'/'queue_and_run' only",
    ),
    *(
        (option, _owned_elsewhere(option, owner), f" applies to on_conflict='{owner}' only")
        for owner, mode in MODES.items()
        for option in mode.options
    ),
    (
        "debounce",
        lambda v: (
            _given(v, "debounce")
            and (v["lock"] is not Phase.RUN or v["on_conflict"] not in (None, Conflict.SKIP))
        ),
        "= decides what a busy key does (the run waits as the key's pending run), so it "
        "needs lock='run' and no on_conflict",
    ),
    (
        "debounce_max",
        lambda v: _given(v, "debounce_max") and not _given(v, "debounce"),
        " applies with debounce= only",
    ),
    (
        "debounce_max",
        lambda v: _given(v, "debounce_max") and v["debounce_max"] < v["debounce"],
        lambda v: f" ({v['debounce_max']:g}s) must be at least debounce ({v['debounce']:g}s)",
    ),
    (
        "rate",
        lambda v: _given(v, "rate") and v["lock"] is Phase.QUEUE,
        "= counts starts under the run's lock, so it needs lock='run' or lock='queue_and_run'",
    ),
)


@dataclass(frozen=True)
class Framework:
    """An integration and what it cannot honour: option names, and conflict modes
    (as ``on_conflict`` values). Such an option given is refused, naming it."""

    name: str
    lacks: frozenset[str] = frozenset()

    def refuse_lacking(self, task: str, values: Mapping[str, Any]) -> None:
        for option in OPTION_NAMES:
            if option in self.lacks and _given(values, option):
                self._refuse(task, f"{option}=")
        if values["on_conflict"] in self.lacks:
            self._refuse(task, f"on_conflict='{values['on_conflict']}'")

    def _refuse(self, task: str, what: str) -> None:
        raise ConfigurationError(f"task {task}: {what} is not supported by {self.name}")


#: Celery has every capability.
CELERY = Framework("Celery")


@dataclass(frozen=True)
class Durations:
    """A task's lease lengths and wait, its options' defaults read from the settings."""

    #: The run's lease.
    ttl: float
    #: The lease an enqueue takes (``queue_ttl``, else ``ttl``).
    queue_ttl: float
    #: How long ``on_conflict="wait"`` blocks (``None`` for other modes).
    wait_timeout: float | None


def durations(opts: GuardOptions, setting: Callable[[str], object]) -> Durations:
    """``opts``' durations; ``setting(name)`` reads a ``taskguard_<name>`` setting
    (``taskguard_default_ttl``, ``taskguard_wait_timeout``) where an option is not given."""

    def given_or(value: float | None, name: str) -> float:
        return value if value is not None else validate_ttl(setting(name), name=name)

    ttl = given_or(opts.ttl, "taskguard_default_ttl")
    wait = given_or(opts.wait_timeout, "taskguard_wait_timeout") if opts.mode.waits else None
    return Durations(ttl, opts.queue_ttl if opts.queue_ttl is not None else ttl, wait)
