# Celery's "First steps with Django" layout: the app is loaded with Django.
from tgsite.celery import app as celery_app

__all__ = ["celery_app"]
