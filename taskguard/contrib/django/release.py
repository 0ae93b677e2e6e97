"""Force-releasing keys on behalf of a named person (the admin's action), recorded
in the lock history with that person's name.

The release is :meth:`taskguard.TaskGuard.force_release` with ``by=`` naming the
person: each live lease it ended gets one ``force_released`` history row with that
name, whatever ``TASKGUARD_HISTORY`` says: an operator override is always audited.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from taskguard.contrib.django import conf
from taskguard.guard import TaskGuard

__all__ = ["force_release_as"]

log = logging.getLogger("taskguard.django")


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """Keys that had a live lease (now ended) and keys that had none."""

    released: list[str]
    not_held: list[str]


def lock_guard() -> TaskGuard:
    """A short-lived guard on the project's lock database (caller disposes it);
    operator actions name their operator, so they are recorded even with history off."""
    from django.conf import settings

    options = dict(getattr(settings, "TASKGUARD_ENGINE_OPTIONS", None) or {})
    return TaskGuard(conf.database_url(), history=False, **options)


def force_release_as(
    keys: Iterable[str], actor: str, *, via: str = "Django admin"
) -> ReleaseResult:
    """End every live lease on each of ``keys``; record who did it."""
    released: list[str] = []
    not_held: list[str] = []
    guard = lock_guard()
    try:
        for key in keys:
            if guard.force_release(key, by=f"{via} user {actor!r}"):
                released.append(key)
            else:
                not_held.append(key)
    finally:
        guard.dispose()
    return ReleaseResult(released, not_held)
