"""The root ``taskguard`` group and what every command resolves through it: the
``--database-url`` option, the Celery app when run as ``celery -A proj taskguard``,
and the :class:`TaskGuard` those two configure (built by
:func:`taskguard.config.build_guard`, so every ``taskguard_*`` setting applies)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from taskguard.cli.errors import EXIT_USAGE, OneLineGroup, fail, failing_as_one_line
from taskguard.config import ENV_DATABASE_URL, build_guard, database_url
from taskguard.exceptions import ConfigurationError
from taskguard.guard import TaskGuard
from taskguard.startup_check import missing_database

__all__ = [
    "CONTEXT_SETTINGS",
    "celery_app",
    "database_url_option",
    "main_group",
    "open_guard",
    "quiet_library_logs",
    "resolve_url",
]

F = TypeVar("F", bound=Callable[..., Any])

#: ``-h`` as well as ``--help``, for ``taskguard`` and ``celery -A proj taskguard``.
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"]}


@click.group(cls=OneLineGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="taskguard")
def main_group() -> None:
    """taskguard: per-key locks for Celery tasks, kept in your SQL database."""
    quiet_library_logs()


def quiet_library_logs() -> None:
    """Every command prints its own result and errors. The library's log records
    (an operator's force release, at WARNING, for a service's log) would otherwise
    reach the terminal a second time through Python's last-resort handler; where
    logging is configured they still go wherever it says."""
    if not logging.getLogger().handlers:
        library = logging.getLogger("taskguard")
        if not library.handlers:
            library.addHandler(logging.NullHandler())


def database_url_option(fn: F) -> F:
    """``--database-url``; without it, the app's configuration, else
    ``$TASKGUARD_DATABASE_URL`` (:func:`resolve_url`)."""
    return click.option(
        "--database-url",
        "database_url",
        metavar="URL",
        help=(
            "SQLAlchemy URL of the lock database (default: the Celery or Django app's, "
            f"else ${ENV_DATABASE_URL})."
        ),
    )(fn)


def celery_app(ctx: click.Context) -> Any:
    """The Celery app when running as ``celery -A proj taskguard …``, else ``None``."""
    return getattr(ctx.find_root().obj, "app", None)


def resolve_url(ctx: click.Context, option: str | None, *, existing: bool = False) -> str:
    """The database the command acts on, read as the workers read it
    (:func:`taskguard.config.database_url`): ``--database-url``, else the app's
    configuration under ``celery -A proj taskguard`` or ``manage.py taskguard``, else
    ``$TASKGUARD_DATABASE_URL``. One line and exit 2 when there is none, or when
    ``existing`` and connecting would create the database (a SQLite path that does
    not exist: commands that read or end locks create nothing)."""
    app = celery_app(ctx)
    try:
        url = database_url(app, explicit=option)
    except ConfigurationError as exc:
        if app is None:
            fail(f"no database URL: pass --database-url or set {ENV_DATABASE_URL}", EXIT_USAGE)
        fail(exc)
    missing = missing_database(url) if existing else None
    if missing:
        fail(missing, EXIT_USAGE)
    return url


@contextmanager
def open_guard(ctx: click.Context, option: str | None) -> Iterator[TaskGuard]:
    """A guard for the command's database and settings, disposed after the block;
    taskguard errors inside the block leave through the one error path. A database
    that does not exist is refused, never created (``taskguard db upgrade`` creates it)."""
    url = resolve_url(ctx, option, existing=True)
    with failing_as_one_line(url):
        guard = build_guard(celery_app(ctx), url=url)
        try:
            yield guard
        finally:
            guard.dispose()
