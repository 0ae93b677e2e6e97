"""``taskguard db …``: apply taskguard's migrations with its own version table."""

from __future__ import annotations

import click

from taskguard import schema
from taskguard.cli.errors import EXIT_USAGE, OneLineGroup, fail, failing_as_one_line
from taskguard.cli.root import database_url_option, resolve_url
from taskguard.urls import mask_url


@click.group(cls=OneLineGroup)
def db() -> None:
    """Create or update taskguard's tables (version table: taskguard_alembic_version;
    your application's alembic_version is never touched)."""


def _own_heads(url: str) -> list[str]:
    """The revisions in taskguard's version table; one line and exit 2 when the
    application's own Alembic manages taskguard's schema instead (``taskguard db``
    would then try to create tables that exist)."""
    with failing_as_one_line(url):
        state = schema.installed(url)
    if state.by_application:
        fail(
            f"taskguard's schema is managed by your application's Alembic (its alembic_version "
            f"holds {', '.join(state.revisions)}): run `alembic upgrade heads` there instead of "
            "`taskguard db` (docs/alembic.md, way 2)",
            EXIT_USAGE,
        )
    return state.revisions


@db.command()
@database_url_option
@click.argument("revision", default="heads")
@click.pass_context
def upgrade(ctx: click.Context, database_url: str | None, revision: str) -> None:
    """Apply migrations up to REVISION (default: the newest). Safe to re-run."""
    url = resolve_url(ctx, database_url)
    before = _own_heads(url)
    with failing_as_one_line(url):
        schema.upgrade(url, revision)
        heads = schema.current(url)
    _report(url, before, heads)


@db.command()
@database_url_option
@click.argument("revision", default="base")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def downgrade(ctx: click.Context, database_url: str | None, revision: str, yes: bool) -> None:
    """Revert migrations down to REVISION (default: base, which drops task_locks)."""
    url = resolve_url(ctx, database_url, existing=True)
    before = _own_heads(url)
    if revision == "base" and not yes:
        click.confirm(f"Drop taskguard's tables from {mask_url(url)}?", abort=True)
    with failing_as_one_line(url):
        schema.downgrade(url, revision)
        heads = schema.current(url)
    _report(url, before, heads)


def _report(url: str, before: list[str], after: list[str]) -> None:
    """One line: what changed, or that nothing needed to."""
    was, now = ", ".join(before) or "base", ", ".join(after) or "base"
    if before == after:
        click.echo(f"{mask_url(url)}: taskguard schema already at {now}; nothing to do")
    else:
        click.echo(f"{mask_url(url)}: taskguard schema {was} -> {now}")


@db.command()
@database_url_option
@click.pass_context
def current(ctx: click.Context, database_url: str | None) -> None:
    """Print the applied revision (or 'base') and the newest available."""
    url = resolve_url(ctx, database_url, existing=True)
    with failing_as_one_line(url):
        state = schema.installed(url)
    newest = schema.head()
    status = "up to date" if state.revisions == [newest] else f"newest is {newest}"
    if state.by_application:
        status += "; managed by your application's Alembic: alembic upgrade heads"
    if state.stale:
        status += f", in {state.where}, the table taskguard reads; {state.stale_note()}"
    click.echo(f"{', '.join(state.revisions) or 'base'} ({status})")


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
    with failing_as_one_line(url):
        text = schema.sql(url, revision, from_revision=from_revision)
    click.echo(text, nl=False)
