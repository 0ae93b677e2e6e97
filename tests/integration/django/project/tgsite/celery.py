"""Celery's "First steps with Django" layout: settings come from Django's, CELERY_*."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tgsite.settings")

app = Celery("tgsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
