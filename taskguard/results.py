"""A run's return value when taskguard decided it instead of the task: a plain
dict (so every result backend stores it) under the key :data:`MARKER`; a skipped
run's is :func:`skipped_result`, a merged one is the integration's."""

from __future__ import annotations

from typing import Any

from taskguard.lease import LockInfo

__all__ = ["MARKER", "SKIPPED", "is_marker", "is_skipped", "skipped_result"]


#: The dict key that marks taskguard's own result values.
MARKER = "__taskguard__"

#: ``value[MARKER]`` of a skipped run.
SKIPPED = "skipped"


def skipped_result(
    *, task: str, task_id: str | None, key: str, phase: str, holder: LockInfo | None
) -> dict[str, Any]:
    """The return value of a run skipped because its key was held (a plain dict, so
    every result backend stores it): what was skipped, where, and who held the key."""
    return {
        MARKER: SKIPPED,
        "task": task,
        "task_id": task_id,
        "key": key,
        "phase": phase,
        "holder": holder.to_dict() if holder is not None else None,
    }


def is_marker(value: object) -> bool:
    """Whether ``value`` is one of taskguard's result markers (skipped, coalesced)."""
    return isinstance(value, dict) and isinstance(value.get(MARKER), str)


def is_skipped(value: object) -> bool:
    """Whether a run's return value is the result of a run skipped because its key
    was held (:func:`skipped_result`)."""
    return isinstance(value, dict) and value.get(MARKER) == SKIPPED
