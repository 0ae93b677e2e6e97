"""``manage.py check`` for taskguard's settings (tag ``taskguard``).

IDs: ``taskguard.E001`` bad alias, ``E002`` engine taskguard cannot use, ``E003``
database URL cannot be built, ``E004`` bad ``TASKGUARD_DATABASE_URL``, ``E005``
bad value of another setting; ``W001`` unknown ``TASKGUARD_*`` name (a typo is
otherwise silently ignored), ``W002`` SQLite test database in memory.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from django.core import checks
from sqlalchemy.engine import URL, make_url

from taskguard.config import DEFAULTS
from taskguard.contrib.django import conf
from taskguard.dialects import SUPPORTED_DIALECTS, dialect_for_url
from taskguard.exceptions import ConfigurationError

__all__ = ["register"]

TAG = "taskguard"

_DURATIONS = (
    "taskguard_default_ttl",
    "taskguard_reaper_grace",
    "taskguard_history_retention",
    "taskguard_wait_timeout",
    "taskguard_reaper_interval",
)
_FLAGS = ("taskguard_history", "taskguard_durable")


def _known_names() -> set[str]:
    return {conf.django_name(n) for n in DEFAULTS} | {conf.ALIAS_SETTING, conf.URL_SETTING}


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Every problem with the project's taskguard settings, each with a hint."""
    from django.conf import settings

    errors: list[checks.CheckMessage] = []
    errors += _check_database(settings)
    errors += _check_values(settings)
    errors += _check_unknown(settings)
    return errors


def _check_database(settings: Any) -> list[checks.CheckMessage]:
    explicit = getattr(settings, conf.URL_SETTING, None)
    if explicit:
        try:
            url = make_url(str(explicit))
        except Exception as exc:
            return [
                checks.Error(
                    f"{conf.URL_SETTING} is not a valid SQLAlchemy URL: {exc}",
                    hint="e.g. postgresql+psycopg://user:password@host:5432/dbname",
                    id="taskguard.E004",
                )
            ]
        return _check_dialect(url, conf.URL_SETTING)
    alias = getattr(settings, conf.ALIAS_SETTING, "default")
    databases: Mapping[str, Any] = getattr(settings, "DATABASES", {}) or {}
    if not isinstance(alias, str) or alias not in databases:
        known = ", ".join(repr(a) for a in sorted(databases)) or "none"
        return [
            checks.Error(
                f"{conf.ALIAS_SETTING} = {alias!r} is not a DATABASES alias",
                hint=f"set {conf.ALIAS_SETTING} to one of: {known} "
                f"(or set {conf.URL_SETTING} to a SQLAlchemy URL)",
                id="taskguard.E001",
            )
        ]
    entry = databases[alias]
    engine = str(entry.get("ENGINE") or "")
    if engine not in conf.ENGINES:
        return [
            checks.Error(
                f"DATABASES[{alias!r}] uses ENGINE {engine!r}, which taskguard cannot use",
                hint=f"use {', '.join(SUPPORTED_DIALECTS)} for the alias in "
                f"{conf.ALIAS_SETTING}, or set {conf.URL_SETTING} to a SQLAlchemy URL of one",
                id="taskguard.E002",
            )
        ]
    try:
        url = conf.url_from_settings_dict(entry, alias)
    except ConfigurationError as exc:
        return [
            checks.Error(
                str(exc),
                hint=f"point {conf.ALIAS_SETTING} at a database file or server",
                id="taskguard.E003",
            )
        ]
    problems = _check_dialect(url, f"DATABASES[{alias!r}]")
    test_name = (entry.get("TEST") or {}).get("NAME")
    if engine in conf.FILE_ENGINES and not test_name:  # Django tests it in memory
        problems.append(
            checks.Warning(
                f"under `manage.py test` Django puts DATABASES[{alias!r}] in memory, "
                "where taskguard's own connections cannot reach it",
                hint=f"set DATABASES[{alias!r}]['TEST'] = {{'NAME': '<a file path>'}}",
                id="taskguard.W002",
            )
        )
    return problems


def _check_dialect(url: URL, where: str) -> list[checks.CheckMessage]:
    """The registry's verdict on ``url``: a database taskguard keeps locks in,
    through a driver it supports there, installed."""
    try:
        dialect_for_url(url)
    except ConfigurationError as exc:
        return [
            checks.Error(
                f"{where}: {exc}",
                hint=f"keep the locks in a supported database ({conf.ALIAS_SETTING} or "
                f"{conf.URL_SETTING})",
                id="taskguard.E002",
            )
        ]
    return []


def _bad(name: str, value: Any, expected: str) -> checks.Error:
    return checks.Error(
        f"{conf.django_name(name)} = {value!r} is not {expected}",
        hint=f"set {conf.django_name(name)} to {expected}, or remove it for the default "
        f"({DEFAULTS[name]!r})",
        id="taskguard.E005",
    )


def _check_values(settings: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for name in _DURATIONS:
        value = getattr(settings, conf.django_name(name), None)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            errors.append(_bad(name, value, "a positive number of seconds"))
    for name in _FLAGS:
        value = getattr(settings, conf.django_name(name), None)
        if value is not None and not isinstance(value, bool):
            errors.append(_bad(name, value, "True or False"))
    size = getattr(settings, "TASKGUARD_REAPER_BATCH_SIZE", None)
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        errors.append(_bad("taskguard_reaper_batch_size", size, "a positive integer"))
    options = getattr(settings, "TASKGUARD_ENGINE_OPTIONS", None)
    if options is not None and not isinstance(options, Mapping):
        errors.append(_bad("taskguard_engine_options", options, "a dict"))
    return errors


def _check_unknown(settings: Any) -> list[checks.CheckMessage]:
    known = _known_names()
    warnings: list[checks.CheckMessage] = []
    for name in dir(settings):
        if not name.startswith("TASKGUARD_") or name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"
        warnings.append(
            checks.Warning(
                f"unknown taskguard setting {name} (ignored)", hint=hint, id="taskguard.W001"
            )
        )
    return warnings


def register() -> None:
    """Register :func:`check_settings` (idempotent)."""
    checks.register(check_settings, TAG)
