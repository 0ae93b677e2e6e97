"""Companion keys: the extra lock rows a Celery task's ``on_conflict="coalesce"``,
``debounce=`` and ``rate=`` keep next to its key, and how to describe them.

They are ordinary rows of ``task_locks`` (so every store holds them with the
same statements, ``taskguard locks`` lists them and the reaper removes them):

* ``<key>#pending:<task name>``: the task's pending run on the key; its task id is
  the pending task's. One per task, so two tasks sharing a key (an importer that
  coalesces, a debounced reindexer) each keep their own pending run.
* ``<key>#rate``: one slot row per start counted in the rate's window; each is
  taken until its start plus the period. Shared by every task on the key.
* ``<key>#debounce:<task name>``: the task's current debounce batch, taken at its
  first submission.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from taskguard.keys import normalize_key
from taskguard.lease import LockInfo

__all__ = ["ROLES", "companion_key", "describe_companions"]

#: Suffix of each kind of companion row.
ROLES = ("pending", "rate", "debounce")


def companion_key(key: str, role: str, task: str | None = None) -> str:
    """The companion key of ``key`` for ``role`` (one of :data:`ROLES`); ``task``
    names the task whose own row it is (pending, debounce)."""
    if role not in ROLES:
        raise ValueError(f"unknown companion role {role!r}; one of {ROLES}")
    return normalize_key(f"{key}#{role}" if task is None else f"{key}#{role}:{task}")


def describe_companions(key: str, held: Callable[[str], Sequence[LockInfo]]) -> list[str]:
    """One line per live companion row of ``key`` (``held(prefix)`` returns the held
    rows whose keys start with ``prefix``), for ``taskguard show`` and ``explain``;
    empty when there is none. (A key too long for its companions' names to be
    stored as given has them shortened to a digest: they are not found here.)"""
    rows = [r for r in held(f"{key}#") if r.held]

    def of(role: str) -> list[LockInfo]:
        own = f"{key}#{role}"
        return [r for r in rows if r.key == own or r.key.startswith(own + ":")]

    lines = [
        f"pending run: task {row.holder.task_id or '-'} ({row.holder.task_name or '-'}), "
        f"waiting {row.held_for.total_seconds():.1f}s; starts when {key!r} is free"
        for row in of("pending")
    ]
    starts = of("rate")
    if starts:
        frees = min(r.expires_in.total_seconds() for r in starts)
        lines.append(
            f"rate: {len(starts)} start(s) in the current window; the next slot frees in "
            f"{frees:.1f}s"
        )
    for row in of("debounce"):
        lines.append(f"debounce batch: first submission {row.held_for.total_seconds():.1f}s ago")
    return lines
