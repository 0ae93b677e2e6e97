"""``taskguard explain KEY``: the recent story of a key from the lock history.

Needs history recorded by the workers (``TaskGuard(..., history=True)`` or the
``taskguard_history`` setting); without it only the current state is shown.
"""

from __future__ import annotations

import json

import click

from taskguard.cli.errors import EXIT_NOT_FOUND, fail, failing_as_one_line
from taskguard.cli.root import database_url_option, main_group, open_guard
from taskguard.companions import describe_companions
from taskguard.display import printable, printable_event, printable_info
from taskguard.history import explain as render
from taskguard.validation import normalize_key

__all__ = ["explain"]


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

    Exit code 1 when KEY has no history, no row and no companion row."""
    with failing_as_one_line():
        stored = normalize_key(key)
    with open_guard(ctx, database_url) as guard:
        events, rows = guard.events(stored, limit=limit), guard.get_all(stored)
        companions = describe_companions(
            stored, lambda prefix: guard.held(prefix, companions=True)
        )  # [coalesce/rate/debounce]
    if not events and not rows and not companions:
        fail(
            f"nothing recorded for {stored!r} (no history and no lock row)",
            EXIT_NOT_FOUND,
            extra={"key": stored},
        )
    if as_json:
        payload = {
            "key": stored,
            "events": [e.to_dict() for e in events],
            "rows": [r.to_dict() for r in rows],
            "companions": companions,
        }
        click.echo(json.dumps(payload, indent=2))
    else:
        # The story quotes the key with repr(); holder details are escaped here.
        click.echo(
            render(stored, [printable_event(e) for e in events], [printable_info(r) for r in rows])
        )
        for line in companions:
            click.echo(printable(line, backslashes=False))
