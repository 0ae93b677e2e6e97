"""The Tasks framework this process has: Django's own ``django.tasks`` (6.0+) or the
``django-tasks`` backport (Django 4.2-5.x); the same API under two names."""

from __future__ import annotations

from importlib.util import find_spec

if find_spec("django.tasks") is not None:  # pragma: no branch
    from django.tasks import TaskResult, TaskResultStatus, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.signals import task_finished, task_started
else:  # the backport
    from django_tasks import (  # type: ignore[no-redef,unused-ignore]
        TaskResult,
        TaskResultStatus,
        task_backends,
    )
    from django_tasks.backends.base import BaseTaskBackend  # type: ignore[no-redef,unused-ignore]
    from django_tasks.signals import task_finished, task_started  # type: ignore[no-redef,unused-ignore]

__all__ = [
    "BaseTaskBackend",
    "TaskResult",
    "TaskResultStatus",
    "task_backends",
    "task_finished",
    "task_started",
]
