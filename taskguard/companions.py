"""Companion keys: the extra lock rows the Celery glue keeps next to tasks' keys,
how to tell them from the locks themselves, and how to describe them.

They are ordinary rows of ``task_locks`` (so every store holds them with the
same statements and the reaper removes them); ``TaskGuard.held()``,
``taskguard locks`` and the Django admin list them only on request:

* ``<key>#pending``: the key's pending run (``on_conflict="coalesce"``,
  ``debounce=``); its task id is the pending task's.
* ``<key>#rate``: one slot row per start counted in the rate's window
  (``rate=``); each is taken until its start plus the period.
* ``<key>#debounce``: the current debounce batch, taken at its first submission.
* ``taskguard:finished:<task id>``: a finished run's record, so that a copy of
  its message delivered again is dropped (``taskguard_finished_retention``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import count

from taskguard.keys import normalize_key
from taskguard.lease import LockInfo

__all__ = [
    "FINISHED_PREFIX",
    "ROLES",
    "SUFFIXES",
    "companion_key",
    "describe_companions",
    "is_companion",
    "without_companions",
]

#: Suffix of each kind of companion row.
ROLES = ("pending", "rate", "debounce")
#: The key endings of those rows.
SUFFIXES = tuple(f"#{role}" for role in ROLES)
#: Key prefix of finished runs' records (no task's own key should start with it).
FINISHED_PREFIX = "taskguard:finished:"


def is_companion(key: str) -> bool:
    """Whether ``key`` is a companion row's, not a lock's."""
    return key.startswith(FINISHED_PREFIX) or key.endswith(SUFFIXES)


def without_companions(read: Callable[[int], list[LockInfo]], limit: int) -> list[LockInfo]:
    """The first ``limit`` rows that are not companions, of what ``read(n)`` returns
    (its first ``n`` rows, in key order), reading more while companions crowd them."""
    for n in (limit * 4**i for i in count()):
        rows = read(n)
        kept = [r for r in rows if not is_companion(r.key)]
        if len(kept) >= limit or len(rows) < n:
            return kept[:limit]
    raise AssertionError("unreachable")  # pragma: no cover


def companion_key(key: str, role: str) -> str:
    """The companion key of ``key`` for ``role`` (one of :data:`ROLES`)."""
    if role not in ROLES:
        raise ValueError(f"unknown companion role {role!r}; one of {ROLES}")
    return normalize_key(f"{key}#{role}")


def describe_companions(key: str, read: Callable[[str], Sequence[LockInfo]]) -> list[str]:
    """One line per live companion row of ``key`` (``read(key)`` returns a key's
    rows), for ``taskguard show`` and ``explain``; empty when there is none."""
    lines: list[str] = []
    pending = [r for r in read(companion_key(key, "pending")) if r.held]
    for row in pending:
        lines.append(
            f"pending run: task {row.holder.task_id or '-'} ({row.holder.task_name or '-'}), "
            f"waiting {row.held_for.total_seconds():.1f}s; starts when {key!r} is free"
        )
    starts = [r for r in read(companion_key(key, "rate")) if r.held]
    if starts:
        frees = min(r.expires_in.total_seconds() for r in starts)
        lines.append(
            f"rate: {len(starts)} start(s) in the current window; the next slot frees in "
            f"{frees:.1f}s"
        )
    for row in (r for r in read(companion_key(key, "debounce")) if r.held):
        lines.append(f"debounce batch: first submission {row.held_for.total_seconds():.1f}s ago")
    return lines
