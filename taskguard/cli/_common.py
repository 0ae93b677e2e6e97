"""Shared CLI plumbing: the root group, URL option, exit codes, error output."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from taskguard._db import mask_url
from taskguard.exceptions import ConfigurationError, TaskGuardError

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2

URL_ENV = "TASKGUARD_DATABASE_URL"

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int) -> NoReturn:
    """Print one line on stderr and exit with ``code``."""
    click.echo(f"taskguard: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="taskguard")
def main_group() -> None:
    """taskguard: per-key locks for Celery tasks, kept in your SQL database."""


def database_url_option(fn: F) -> F:
    """``--database-url`` falling back to ``$TASKGUARD_DATABASE_URL``."""
    return click.option(
        "--database-url",
        "database_url",
        envvar=URL_ENV,
        metavar="URL",
        help=f"SQLAlchemy URL of the lock database (default: ${URL_ENV}).",
    )(fn)


def resolve_url(ctx: click.Context, database_url: str | None) -> str:
    """The URL from the option/env, or from the Celery app when run under ``celery``."""
    if database_url:
        return database_url
    obj = ctx.find_root().obj
    url = getattr(obj, "taskguard_database_url", None) if obj is not None else None
    if url:
        return str(url)
    fail(f"no database URL: pass --database-url or set {URL_ENV}", EXIT_USAGE)


def run_or_exit(fn: Callable[[], Any], url: str | None = None) -> Any:
    """Run ``fn``; turn taskguard errors into one-line messages and exit code 2."""
    try:
        return fn()
    except ConfigurationError as exc:
        fail(_masked(str(exc), url), EXIT_USAGE)
    except TaskGuardError as exc:
        fail(_masked(str(exc), url), EXIT_USAGE)


def _masked(message: str, url: str | None) -> str:
    if url:
        message = message.replace(url, mask_url(url))
    return message


def masked(url: str) -> str:
    return mask_url(url)


__all__ = [
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "URL_ENV",
    "database_url_option",
    "fail",
    "main_group",
    "masked",
    "resolve_url",
    "run_or_exit",
]
