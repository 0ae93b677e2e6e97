"""Companion keys: the extra lock rows a Celery task's ``on_conflict="coalesce"``,
``debounce=`` and ``rate=`` keep next to its key, and how to describe them.

They are ordinary rows of ``task_locks`` (so every store holds them with the
same statements, ``taskguard locks`` lists them and the reaper removes them):

* ``<key>#pending``: the key's pending run; its task id is the pending task's.
* ``<key>#rate``: one slot row per start counted in the rate's window; each is
  taken until its start plus the period.
* ``<key>#debounce``: the current debounce batch, taken at its first submission.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from taskguard.keys import normalize_key
from taskguard.lease import LockInfo

__all__ = ["ROLES", "companion_key", "describe_companions"]

#: Suffix of each kind of companion row.
ROLES = ("pending", "rate", "debounce")


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
