"""examples/djangotasksfeeds on Celery: its feed tasks enqueued by django-tasks-celery's
CeleryBackend (GuardedBackend in front) and run by a prefork ``celery worker``, for
tests/integration/django_tasks/test_celery_bridge.py. The broker (and result backend)
is CELERYSITE_BROKER, the queue CELERYSITE_QUEUE (a test's own)."""

import os

from feedsite.settings import *  # noqa: F403

TASKS = {
    "default": {
        "BACKEND": "taskguard.contrib.django_tasks.GuardedBackend",
        "OPTIONS": {
            "BACKEND": "django_tasks_celery.CeleryBackend",
            "OPTIONS": {"CELERY_APP": "celerysite.celery.app"},
        },
    }
}
CELERY_BROKER_URL = os.environ["CELERYSITE_BROKER"]
CELERY_RESULT_BACKEND = os.environ["CELERYSITE_BROKER"]
CELERY_RESULT_EXTENDED = True  # CeleryBackend.get_result finds the task by its name
CELERY_RESULT_EXPIRES = 600
CELERY_TASK_DEFAULT_QUEUE = os.environ["CELERYSITE_QUEUE"]
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
