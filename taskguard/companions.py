"""Companion keys: the extra lock rows the Celery glue keeps next to tasks' keys,
how to tell them from the locks themselves, and how to describe them.

They are ordinary rows of ``task_locks`` (so every store holds them with the
same statements and the reaper removes them); ``TaskGuard.held()``,
``taskguard locks`` and the Django admin list them only on request:

* ``<key>#pending:<task name>``: the task's pending run on the key; its task id is
  the pending task's. One per task, so two tasks sharing a key (an importer that
  coalesces, a debounced reindexer) each keep their own pending run.
* ``<key>#rate``: one slot row per start counted in the rate's window; each is
  taken until its start plus the period. Shared by every task on the key.
* ``<key>#debounce:<task name>``: the task's current debounce batch, taken at its
  first submission.
* ``taskguard:finished:<task id>``: a finished run's record, so that a copy of
  its message delivered again is dropped (``taskguard_finished_retention``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import count

from taskguard.lease import LockInfo
from taskguard.validation import normalize_key

__all__ = [
    "ENDING",
    "FINISHED_PREFIX",
    "KINDS",
    "companion_key",
    "companion_rows",
    "describe_companions",
    "kind",
    "without_companions",
]

#: Suffix of each kind of companion row.
ROLES = ("pending", "rate", "debounce")
#: Key prefix of finished runs' records (no task's own key should start with it).
FINISHED_PREFIX = "taskguard:finished:"
#: How a companion key ends: ``#rate``, or ``#pending``/``#debounce`` and a task name
#: (a regular expression PostgreSQL, MariaDB, SQLite and Python read alike).
ENDING = r"#(rate|(pending|debounce)(:[^#]*)?)$"
_ENDING = re.compile(ENDING)
#: What each kind of companion row is, for people (``taskguard locks --all``, ``show``).
KINDS = {
    "finished": "finished run's record",
    "pending": "pending run",
    "rate": "rate slot",
    "debounce": "debounce batch",
}


def kind(key: str) -> str | None:
    """The kind of companion row ``key`` is (a key of :data:`KINDS`), or ``None``
    for a lock's own row."""
    if key.startswith(FINISHED_PREFIX):
        return "finished"
    ending = _ENDING.search(key)
    return None if ending is None else ending[2] or ending[1]


def is_companion(key: str) -> bool:
    """Whether ``key`` is a companion row's, not a lock's."""
    return kind(key) is not None


def without_companions(read: Callable[[int], list[LockInfo]], limit: int) -> list[LockInfo]:
    """The first ``limit`` rows that are not companions, of what ``read(n)`` returns
    (its first ``n`` rows, in key order), reading more while companions crowd them."""
    for n in (limit * 4**i for i in count()):
        rows = read(n)
        kept = [r for r in rows if not is_companion(r.key)]
        if len(kept) >= limit or len(rows) < n:
            return kept[:limit]
    raise AssertionError("unreachable")  # pragma: no cover


def companion_key(key: str, role: str, task: str | None = None) -> str:
    """The companion key of ``key`` for ``role`` (one of :data:`ROLES`); ``task``
    names the task whose own row it is (pending, debounce)."""
    if role not in ROLES:
        raise ValueError(f"unknown companion role {role!r}; one of {ROLES}")
    return normalize_key(f"{key}#{role}" if task is None else f"{key}#{role}:{task}")


def companion_rows(key: str, held: Callable[[str], Sequence[LockInfo]]) -> list[LockInfo]:
    """The live companion rows of ``key`` (``held(prefix)``: the held rows, companions
    included, whose keys start with ``prefix``). (A key too long for its companions'
    names to be stored as given has them shortened to a digest: they are not found.)"""
    return [r for r in held(f"{key}#") if r.held and _ENDING.match(r.key, len(key))]


def describe_companions(key: str, held: Callable[[str], Sequence[LockInfo]]) -> list[str]:
    """One line per live companion row of ``key`` (``held`` as for
    :func:`companion_rows`), for ``taskguard show`` and ``explain``; empty when
    there is none."""
    rows = companion_rows(key, held)

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
