"""A minimal Django project for tests/integration/django_tasks/test_guarded.py: the
locks in a SQLite file (TINYSITE_DB), tasks run in-process by ImmediateBackend behind
GuardedBackend (and django-tasks-db behind it, for deferred jobs)."""

import importlib.util
import os

SECRET_KEY = "tinysite"
USE_TZ = True
INSTALLED_APPS = ["taskguard.contrib.django", "django_tasks_db", "tinytasks"]
if importlib.util.find_spec("django.tasks") is None:
    INSTALLED_APPS.append("django_tasks")
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["TINYSITE_DB"]}}
_IMMEDIATE = (
    "django.tasks.backends.immediate.ImmediateBackend"
    if importlib.util.find_spec("django.tasks")
    else "django_tasks.backends.immediate.ImmediateBackend"
)
TASKS = {
    "default": {
        "BACKEND": "taskguard.contrib.django_tasks.GuardedBackend",
        # The real backend's own OPTIONS reach it (not GuardedBackend's).
        "OPTIONS": {"BACKEND": _IMMEDIATE, "OPTIONS": {"seen_by": "the real backend"}},
    },
    # No GuardedBackend: lock="queue" tasks must fail here, not run unlocked.
    "plain": {"BACKEND": _IMMEDIATE},
    # A backend that can defer jobs (on_conflict="retry"); run by `db_worker --batch`.
    "queue": {
        "BACKEND": "taskguard.contrib.django_tasks.GuardedBackend",
        "OPTIONS": {"BACKEND": "django_tasks_db.DatabaseBackend"},
    },
}
TASKGUARD_HISTORY = True
if os.environ.get("TINYSITE_LOCKS_URL"):  # the locks elsewhere (e.g. behind a test proxy)
    TASKGUARD_DATABASE_URL = os.environ["TINYSITE_LOCKS_URL"]
LOGGING = {
    "version": 1,
    "handlers": {"out": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout"}},
    "loggers": {"taskguard": {"handlers": ["out"], "level": "WARNING"}},
}
