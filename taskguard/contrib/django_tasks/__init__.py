"""taskguard for Django's Tasks framework (``django.tasks``, or the ``django-tasks``
backport): ``@guarded`` locks a task's runs on any backend, :class:`GuardedBackend`
also refuses (or answers) duplicate enqueues. Users: docs/django-tasks.md."""

from taskguard.contrib.django_tasks.backend import GuardedBackend
from taskguard.contrib.django_tasks.run import guarded, project_guard
from taskguard.held_lease import check_lease, current_lease
from taskguard.results import is_skipped

__all__ = [
    "GuardedBackend",
    "check_lease",
    "current_lease",
    "guarded",
    "is_skipped",
    "project_guard",
]
