"""``celery -A proj taskguard …``: the taskguard commands, configured by the Celery app.

Celery loads :data:`taskguard_command` through the ``celery.commands`` entry point
and runs it with its own root context, whose ``obj`` (Celery's ``CLIContext``)
carries the app. The subcommands are the very same click commands as the
``taskguard`` script; only the default database URL and settings differ: they are
the app's, read as its workers read them (``taskguard_database_url`` or the compat
backend's URL, ``taskguard_durable``, ``taskguard_reaper_*``, ...; see
:func:`taskguard.cli.root.resolve_url`): an explicit ``--database-url`` wins, and
``$TASKGUARD_DATABASE_URL`` only counts when the app names no database.
"""

from __future__ import annotations

import click

from taskguard.cli import cli
from taskguard.cli.errors import EXIT_USAGE, OneLineGroup, fail
from taskguard.cli.root import CONTEXT_SETTINGS, celery_app, quiet_library_logs

__all__: list[str] = []


class _SameCommands(OneLineGroup):
    """Serves whatever commands the ``taskguard`` root group has, looked up lazily so
    command groups registered later appear here too."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return cli.list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return cli.get_command(ctx, cmd_name)


@click.group("taskguard", cls=_SameCommands, context_settings=CONTEXT_SETTINGS)
@click.pass_context
def taskguard_command(ctx: click.Context) -> None:
    """taskguard lock tools, using this Celery app's taskguard settings."""
    if celery_app(ctx) is None:
        fail("no Celery app: run as `celery -A proj taskguard ...`", EXIT_USAGE)
    quiet_library_logs()
