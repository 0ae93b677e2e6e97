"""How Django's settings reach taskguard at run time.

taskguard's Celery glue reads ``app.conf.taskguard_*`` (see :mod:`taskguard.config`).
When the Django app is ready, every Celery app that exists then (Celery's Django
layout creates it while the settings load), and any app finalized later, gets the project's ``TASKGUARD_*`` settings for each name it does not set
itself (a ``CELERY_TASKGUARD_*`` setting read through Celery's namespace still
wins), and a database URL that is recomputed from the alias on each read.

Django's test runner and pytest-django point the alias at the test database by
changing its connection settings in place. taskguard caches one engine per app, so
when a new Django connection is made to a different database than before the
cached guards are dropped, and the next lock goes to the test database. They are
also dropped when Django opens its no-database connection (to create or drop the
test database), so pooled lock connections never keep a test database alive.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from taskguard.config import reset_guards
from taskguard.contrib.django import conf
from taskguard.exceptions import ConfigurationError

__all__ = ["configure_celery_app", "install"]

log = logging.getLogger("taskguard.django")

_state: dict[str, str | None] = {"url": None}
_state_lock = threading.Lock()
_installed: list[bool] = []
# django.db.backends.base.base.NO_DB_ALIAS: the connection Django uses to create
# and drop test databases.
_NO_DB_ALIAS = "__no_db__"


class DjangoDatabaseURL:
    """Stands in for ``taskguard_database_url``: ``str()`` of it is the lock database
    URL as Django's settings say *now* (see :func:`conf.database_url`)."""

    def __str__(self) -> str:
        return conf.database_url()

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<taskguard URL from DATABASES[{conf.alias()!r}]>"


def configure_celery_app(app: Any) -> None:
    """Give ``app`` the Django project's taskguard settings it does not set itself."""
    try:
        current = app.conf
        changed = False
        for name, value in conf.celery_settings().items():
            if current.get(name) is None:
                current[name] = value
                changed = True
        if current.get("taskguard_database_url") is None:
            current["taskguard_database_url"] = DjangoDatabaseURL()
            changed = True
        if changed and current.get("taskguard_reaper_interval") is not None:
            # The reaper's own finalize hook may have run before this one.
            from taskguard.celery.reaper import schedule_reaper

            schedule_reaper(app)
    except ConfigurationError:
        # Reported by `manage.py check`; a task run raises it with the same words.
        log.debug("taskguard settings not applied to %r", app, exc_info=True)


def _on_connection_created(sender: Any = None, connection: Any = None, **_: Any) -> None:
    if connection is None:
        return
    if connection.alias == _NO_DB_ALIAS:
        # Django is about to create or drop a (test) database: taskguard's pooled
        # connections to it would make DROP DATABASE fail on PostgreSQL.
        reset_guards()
        return
    if connection.alias != _alias_or_none():
        return
    try:
        url = conf.database_url()
    except ConfigurationError:
        return
    with _state_lock:
        previous, _state["url"] = _state["url"], url
    if previous is not None and previous != url:
        # The test runner switched the alias to (or back from) the test database.
        reset_guards()


def _alias_or_none() -> str | None:
    try:
        return conf.alias()
    except ConfigurationError:
        return None


def install() -> None:
    """Called once from the app's ``ready()``."""
    if _installed:
        return
    _installed.append(True)
    from django.db.backends.signals import connection_created

    connection_created.connect(_on_connection_created, dispatch_uid="taskguard.follow_alias")
    with _state_lock:
        try:
            _state["url"] = conf.database_url()
        except ConfigurationError:
            _state["url"] = None
    try:
        from celery._state import _get_active_apps, connect_on_app_finalize
    except ImportError:  # pragma: no cover - celery is a dependency
        return
    connect_on_app_finalize(configure_celery_app)
    # Celery's Django layout creates the app while settings load (proj/__init__.py
    # imports it), so it exists, unfinalized, by now; apps made later are handled
    # when they finalize.
    for app in list(_get_active_apps()):
        configure_celery_app(app)
