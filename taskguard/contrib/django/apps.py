"""The Django app: ``INSTALLED_APPS = [..., "taskguard.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig

__all__: list[str] = []


class TaskGuardConfig(AppConfig):
    """Registers the system checks and hands Django's settings to Celery apps."""

    name = "taskguard.contrib.django"
    label = "taskguard"
    verbose_name = "taskguard locks"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        from taskguard import unlocked
        from taskguard.contrib.django import checks, wiring

        checks.register()
        wiring.install()
        # TASKGUARD_LOCKING=off (tests only): see taskguard.unlocked.
        unlocked.apply_environment()
