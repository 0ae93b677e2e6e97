"""The project's Celery app, configured from Django's settings (CELERY_*)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "feedsite.settings")

app = Celery("feedsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
