"""``taskguard explain KEY``: the recent story of a key from the lock history.

Needs history recorded by the workers (``TaskGuard(..., history=True)`` or the
``taskguard_history`` setting); without it only the current state is shown.
"""

from __future__ import annotations

import json

import click

from taskguard.cli._common import (
    EXIT_NOT_FOUND,
    database_url_option,
    fail,
    main_group,
    resolve_url,
    run_or_exit,
)
from taskguard.guard import TaskGuard
from taskguard.history import LockEvent
from taskguard.history import explain as render
from taskguard.keys import normalize_key
from taskguard.lease import LockInfo

__all__ = ["explain"]


def _read(url: str, key: str, limit: int) -> tuple[list[LockEvent], list[LockInfo]]:
    guard = TaskGuard(url)
    try:
        return guard.events(key, limit=limit), guard.get_all(key)
    finally:
        guard.dispose()


@main_group.command()
@database_url_option
@click.argument("key")
@click.option(
    "--limit",
    "-n",
    default=50,
    show_default=True,
    type=click.IntRange(1, 10_000),
    help="How many of the most recent events to show.",
)
@click.option("--json", "as_json", is_flag=True, help="Events and current rows as JSON.")
@click.pass_context
def explain(
    ctx: click.Context, database_url: str | None, key: str, limit: int, as_json: bool
) -> None:
    """The recent story of KEY: who held it, for how long, who was turned away,
    leases lost or taken over, and who holds it now.

    Exit code 1 when KEY has neither history nor a row."""
    url = resolve_url(ctx, database_url)
    stored = run_or_exit(lambda: normalize_key(key), url)
    events, rows = run_or_exit(lambda: _read(url, stored, limit), url)
    if not events and not rows:
        fail(f"nothing recorded for {stored!r} (no history and no lock row)", EXIT_NOT_FOUND)
    if as_json:
        payload = {
            "key": stored,
            "events": [e.to_dict() for e in events],
            "rows": [r.to_dict() for r in rows],
        }
        click.echo(json.dumps(payload, indent=2))
    else:
        click.echo(render(stored, events, rows))
