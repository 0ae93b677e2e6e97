"""taskguard's settings read from Django's ``settings``, and the lock database URL
built from ``DATABASES``.

Every taskguard setting (:data:`taskguard.config.DEFAULTS`) has a Django name: the
same name upper-cased (``taskguard_history`` -> ``TASKGUARD_HISTORY``). Two more
are Django-only:

``TASKGUARD_DATABASE_ALIAS``
    The ``DATABASES`` entry holding the locks (default ``"default"``). taskguard
    opens its own connections to it, with the same name, user, password, host,
    port and connection ``OPTIONS`` (``sslmode`` ...), so under Django's test
    runner (and pytest-django) the locks follow the test database.
``TASKGUARD_DATABASE_URL``
    A SQLAlchemy URL used instead of the alias (the locks live elsewhere; the
    admin pages and ``migrate`` then do not see them).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL, make_url

from taskguard.config import DEFAULTS
from taskguard.exceptions import ConfigurationError

__all__ = [
    "ALIAS_SETTING",
    "ENGINES",
    "FILE_ENGINES",
    "URL_SETTING",
    "alias",
    "celery_settings",
    "database_url",
    "django_name",
    "url_from_settings_dict",
]

ALIAS_SETTING = "TASKGUARD_DATABASE_ALIAS"
URL_SETTING = "TASKGUARD_DATABASE_URL"

#: Django database engines taskguard can follow, and the SQLAlchemy driver it uses:
#: the one Django's backend uses too (psycopg 3; mysqlclient, for MariaDB).
ENGINES: dict[str, str] = {
    "django.db.backends.postgresql": "postgresql+psycopg",
    "django.contrib.gis.db.backends.postgis": "postgresql+psycopg",
    "django.db.backends.sqlite3": "sqlite",
    "django.contrib.gis.db.backends.spatialite": "sqlite",
    "django.db.backends.mysql": "mysql+mysqldb",
    "django.contrib.gis.db.backends.mysql": "mysql+mysqldb",
}
#: Engines whose NAME is a file (the rest name a database on a server).
FILE_ENGINES = frozenset(
    {"django.db.backends.sqlite3", "django.contrib.gis.db.backends.spatialite"}
)
_PG_ENGINES = frozenset({"django.db.backends.postgresql", "django.contrib.gis.db.backends.postgis"})

# Django-only keys of a PostgreSQL alias's OPTIONS: not libpq connection parameters.
_PG_DJANGO_OPTIONS = frozenset(
    {"isolation_level", "server_side_binding", "assume_role", "pool", "cursor_factory"}
)
# mysqlclient OPTIONS (Django passes them to MySQLdb.connect) a URL can carry; the
# rest (isolation_level, ...) are Django's own.
_MYSQL_OPTIONS = frozenset(
    {"charset", "connect_timeout", "init_command", "read_default_file", "read_default_group"}
)


def django_name(name: str) -> str:
    """The Django setting for taskguard setting ``name`` (``taskguard_x`` -> ``TASKGUARD_X``)."""
    return name.upper()


def _settings() -> Any:
    from django.conf import settings

    return settings


def alias() -> str:
    """The ``DATABASES`` alias the locks live in (``TASKGUARD_DATABASE_ALIAS``)."""
    value = getattr(_settings(), ALIAS_SETTING, "default")
    if not isinstance(value, str) or not value:
        raise ConfigurationError(
            f"{ALIAS_SETTING} must be the name of a DATABASES entry, not {value!r}"
        )
    return value


def database_url() -> str:
    """The lock database URL: ``TASKGUARD_DATABASE_URL`` if set, else built from the
    alias's *current* connection settings (which are the test database's while
    Django's test runner runs)."""
    explicit = getattr(_settings(), URL_SETTING, None)
    if explicit:
        return str(explicit)
    from django.db import connections

    name = alias()
    if name not in connections.settings:
        known = ", ".join(sorted(connections.settings)) or "none"
        raise ConfigurationError(
            f"{ALIAS_SETTING} = {name!r} is not in DATABASES (aliases: {known}); "
            f"set {ALIAS_SETTING} to one of them or set {URL_SETTING}"
        )
    _check_installed(name)
    url = url_from_settings_dict(connections[name].settings_dict, name)
    return url.render_as_string(hide_password=False)


#: The app whose migration creates the lock tables in a ``DATABASES`` entry.
APP = "taskguard.contrib.django"


def _check_installed(name: str) -> None:
    """Locks in a ``DATABASES`` entry get their tables from the app's migration: without
    the app in ``INSTALLED_APPS`` the fix is adding it, not ``taskguard db upgrade``."""
    from django.apps import apps

    if apps.apps_ready and not apps.is_installed(APP):
        raise ConfigurationError(
            f"the locks are kept in DATABASES[{name!r}], whose lock tables `manage.py migrate` "
            f'creates with the app "{APP}", which is not in INSTALLED_APPS: add it to '
            f"INSTALLED_APPS and run `manage.py migrate` (or set {URL_SETTING} to a lock "
            "database of its own)"
        )


def url_from_settings_dict(settings_dict: Mapping[str, Any], name: str = "default") -> URL:
    """A SQLAlchemy URL for the database one ``DATABASES`` entry describes."""
    engine = str(settings_dict.get("ENGINE") or "")
    driver = ENGINES.get(engine)
    if driver is None:
        raise ConfigurationError(
            f"DATABASES[{name!r}] uses ENGINE {engine!r}, which taskguard cannot follow "
            f"(supported: {', '.join(sorted(ENGINES))}); set {URL_SETTING} to a "
            "SQLAlchemy URL instead"
        )
    options = dict(settings_dict.get("OPTIONS") or {})
    if engine in FILE_ENGINES:
        return _sqlite_url(settings_dict.get("NAME"), name)
    query: dict[str, str] = {}
    host = str(settings_dict.get("HOST") or "") or None
    if engine in _PG_ENGINES:
        query = {
            k: _scalar(v)
            for k, v in options.items()
            if k not in _PG_DJANGO_OPTIONS and isinstance(v, str | int | float | bool)
        }
        if host and host.startswith("/"):  # a Unix-socket directory
            query["host"] = host
            host = None
    else:
        query = {k: _scalar(v) for k, v in options.items() if k in _MYSQL_OPTIONS}
        if isinstance(options.get("ssl"), Mapping):
            query.update({f"ssl_{k}": _scalar(v) for k, v in options["ssl"].items()})
        if host and host.startswith("/"):  # Django: a HOST starting with / is a socket
            query["unix_socket"] = host
            host = None
    port = settings_dict.get("PORT")
    return URL.create(
        driver,
        username=str(settings_dict.get("USER") or "") or None,
        password=str(settings_dict.get("PASSWORD") or "") or None,
        host=host,
        port=int(port) if port not in (None, "") else None,
        database=str(settings_dict.get("NAME") or "") or None,
        query=query,
    )


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _sqlite_url(db_name: Any, name: str) -> URL:
    text = str(db_name or "")
    if not text or text == ":memory:" or "mode=memory" in text:
        raise ConfigurationError(
            f"DATABASES[{name!r}] is an in-memory SQLite database, which taskguard's own "
            "connections cannot share; use a file (for tests: set "
            f"DATABASES[{name!r}]['TEST']['NAME'] to a file path)"
        )
    if text.startswith("file:"):
        raise ConfigurationError(
            f"DATABASES[{name!r}]['NAME'] is a SQLite URI ({text!r}); give taskguard a "
            f"plain file path or set {URL_SETTING}"
        )
    return make_url("sqlite:///" + str(Path(text).resolve()))


def celery_settings() -> dict[str, Any]:
    """The ``taskguard_*`` settings the Django project sets (upper-case names),
    keyed by their Celery names."""
    settings = _settings()
    found: dict[str, Any] = {}
    for name in DEFAULTS:
        if name == "taskguard_database_url":
            continue
        value = getattr(settings, django_name(name), None)
        if value is not None:
            found[name] = value
    return found
