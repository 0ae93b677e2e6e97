"""Celery's side of a task's options: the ``taskguard_<name>`` task attributes, the
decorator's split of its keyword arguments, the misspelling check against Celery's
own option names, and :class:`GuardOptions` over the core's declaration
(:mod:`taskguard.options`: names, defaults, every rule), with the Celery actions of
its conflict mode (``strategy``).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any

from taskguard import options as core
from taskguard.celery.conflicts import ACTIONS, Strategy
from taskguard.exceptions import ConfigurationError
from taskguard.options import OPTION_NAMES, Conflict, Phase, option_defaults

__all__ = [
    "ATTR_PREFIX",
    "GuardOptions",
    "check_celery_options",
    "option_defaults",
    "signature_of",
    "split_options",
]

#: When the lock is held (taskguard.options.Phase).
LOCK_PHASES = tuple(str(p) for p in Phase)
#: What a submission does when the key is held (the ``on_conflict`` values).
CONFLICT_STRATEGIES = tuple(str(c) for c in Conflict if c is not Conflict.DEFER)
#: Task attribute of option ``name``: ``taskguard_<name>``.
ATTR_PREFIX = "taskguard_"


class GuardOptions(core.GuardOptions):
    """The core's options of one Celery task, with its conflict mode's Celery actions."""

    @classmethod
    def from_attributes(cls, task: Any) -> GuardOptions:
        """Validated options from a task's ``taskguard_<name>`` attributes."""
        raw = {name: getattr(task, ATTR_PREFIX + name) for name in OPTION_NAMES}
        built: GuardOptions = cls.build(task.name, inspect.signature(task.run), **raw)
        return built

    @cached_property
    def strategy(self) -> Strategy:
        """What a conflict does in Celery (the actions of :attr:`conflict`)."""
        return ACTIONS[self.conflict]


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
