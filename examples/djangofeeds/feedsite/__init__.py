# Celery's "First steps with Django" layout: the Celery app loads with Django.
from feedsite.celery import app as celery_app

__all__ = ["celery_app"]
