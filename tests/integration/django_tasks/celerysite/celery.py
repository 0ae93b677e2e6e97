"""The Celery app of celerysite: Django's settings (CELERY_*), the feeds app's tasks."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "celerysite.settings")

app = Celery("celerysite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
