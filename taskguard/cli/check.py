"""``taskguard check``: the start-up check (URL, connectivity, schema, privileges).

The same check a Celery worker runs at start (``taskguard_startup_check``). Exit 0
when the database is ready for this version of taskguard, 1 when it is not (one
line per problem on stderr, naming the fix, e.g. ``taskguard db upgrade``).
"""

from __future__ import annotations

import sys

import click

from taskguard.cli.errors import EXIT_NOT_FOUND
from taskguard.cli.root import database_url_option, main_group, resolve_url
from taskguard.startup_check import check_database

__all__ = ["check"]


@main_group.command()
@database_url_option
@click.option(
    "--timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds to wait for the database to answer.",
)
@click.pass_context
def check(ctx: click.Context, database_url: str | None, timeout: float) -> None:
    """Check the lock database: URL, connectivity, schema at head, privileges."""
    result = check_database(resolve_url(ctx, database_url), timeout=timeout)
    if result.ok:
        click.echo(result.line())
        return
    click.echo(result.line(), err=True)
    sys.exit(EXIT_NOT_FOUND)
