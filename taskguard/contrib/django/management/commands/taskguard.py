"""``manage.py taskguard ...``: the ``taskguard`` command line with Django's settings.

The lock database is the one ``TASKGUARD_DATABASE_ALIAS`` (or
``TASKGUARD_DATABASE_URL``) names; ``TASKGUARD_*`` settings apply as in the
workers. Everything after ``taskguard`` goes to the command line unchanged, e.g.
``manage.py taskguard locks --json`` or ``manage.py taskguard db current``.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace
from typing import Any

from django.core.management.base import BaseCommand

from taskguard.contrib.django import conf
from taskguard.exceptions import ConfigurationError

__all__ = ["Command"]


def _root_object(url: str | None) -> SimpleNamespace:
    """What the ``taskguard`` click group finds as ``ctx.obj``: the settings, shaped
    like the Celery app that ``celery -A proj taskguard`` would hand it."""
    settings = dict(conf.celery_settings())
    if url is not None:
        settings["taskguard_database_url"] = url
    return SimpleNamespace(app=SimpleNamespace(conf=settings), taskguard_database_url=url)


def run(argv: list[str], prog_name: str = "manage.py taskguard") -> int:
    """Run the command line with ``argv``; returns its exit code."""
    from taskguard.cli import cli

    try:
        url: str | None = conf.database_url()
    except ConfigurationError as exc:
        url = None
        # An explicit --database-url (or only asking for help) needs no settings.
        if not any(a.startswith("--database-url") or a in ("-h", "--help") for a in argv):
            sys.stderr.write(f"taskguard: {exc}\n")
            return 2
    try:
        cli.main(args=argv, prog_name=prog_name, obj=_root_object(url), standalone_mode=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


class Command(BaseCommand):
    help = "taskguard's command line (locks, show, explain, release, reap, db) on this project."

    # click parses the arguments; Django's own options would shadow taskguard's.
    def run_from_argv(self, argv: list[str]) -> None:
        raise SystemExit(run(argv[2:], prog_name=f"{argv[0]} {argv[1]}"))

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("argv", nargs=argparse.REMAINDER)

    def handle(self, *args: Any, **options: Any) -> None:
        code = run([*args, *options.get("argv", [])])
        if code:
            raise SystemExit(code)
