"""``taskguard db …``: apply taskguard's migrations with its own version table."""

from __future__ import annotations

import click

from taskguard import schema
from taskguard.cli._common import database_url_option, masked, resolve_url, run_or_exit


@click.group()
def db() -> None:
    """Create or update taskguard's tables (version table: taskguard_alembic_version;
    your application's alembic_version is never touched)."""


@db.command()
@database_url_option
@click.argument("revision", default="heads")
@click.pass_context
def upgrade(ctx: click.Context, database_url: str | None, revision: str) -> None:
    """Apply migrations up to REVISION (default: the newest). Safe to re-run."""
    url = resolve_url(ctx, database_url)
    run_or_exit(lambda: schema.upgrade(url, revision), url)
    heads = run_or_exit(lambda: schema.current(url), url)
    click.echo(f"{masked(url)}: taskguard schema at {', '.join(heads) or 'base'}")


@db.command()
@database_url_option
@click.argument("revision", default="base")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def downgrade(ctx: click.Context, database_url: str | None, revision: str, yes: bool) -> None:
    """Revert migrations down to REVISION (default: base, which drops task_locks)."""
    url = resolve_url(ctx, database_url)
    if revision == "base" and not yes:
        click.confirm(f"Drop taskguard's tables from {masked(url)}?", abort=True)
    run_or_exit(lambda: schema.downgrade(url, revision), url)
    heads = run_or_exit(lambda: schema.current(url), url)
    click.echo(f"{masked(url)}: taskguard schema at {', '.join(heads) or 'base'}")


@db.command()
@database_url_option
@click.pass_context
def current(ctx: click.Context, database_url: str | None) -> None:
    """Print the applied revision (or 'base') and the newest available."""
    url = resolve_url(ctx, database_url)
    heads = run_or_exit(lambda: schema.current(url), url)
    newest = schema.head()
    state = "up to date" if heads == [newest] else f"newest is {newest}"
    click.echo(f"{', '.join(heads) or 'base'} ({state})")


@db.command("sql")
@database_url_option
@click.argument("revision", default="heads")
@click.option("--from", "from_revision", default=None, help="Start from this revision.")
@click.pass_context
def sql_(
    ctx: click.Context, database_url: str | None, revision: str, from_revision: str | None
) -> None:
    """Print the DDL an upgrade would run, for review (no connection is made)."""
    url = resolve_url(ctx, database_url)
    click.echo(
        run_or_exit(lambda: schema.sql(url, revision, from_revision=from_revision), url), nl=False
    )
