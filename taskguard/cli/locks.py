"""``taskguard locks|show|release|reap``: who holds what, and the operator's levers.

Each command is a thin layer over one or two :class:`taskguard.TaskGuard` calls.
Under ``celery -A proj taskguard …`` the database URL and settings come from the
Celery app (see :mod:`taskguard.cli.celery`).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Sequence

import click

from taskguard.cli.errors import EXIT_NOT_FOUND, EXIT_USAGE, fail
from taskguard.cli.root import celery_app, database_url_option, main_group, open_guard
from taskguard.companions import companion_rows, describe_companions
from taskguard.config import setting
from taskguard.display import lock_details, locks_table, printable, slots_in_use
from taskguard.guard import TaskGuard
from taskguard.history import endings
from taskguard.lease import Lease, LockInfo

__all__ = ["locks", "reap", "release", "show"]


def _json(infos: Sequence[LockInfo]) -> str:
    in_use = slots_in_use(infos)
    return json.dumps([info.to_dict(in_use[info.key]) for info in infos], indent=2)


# -- commands --------------------------------------------------------------------------


@main_group.command()
@database_url_option
@click.option("--prefix", "-p", default=None, metavar="P", help="Only keys starting with P.")
@click.option(
    "--all",
    "-a",
    "show_all",
    is_flag=True,
    help="Every row: also expired rows not yet reaped, and the Celery glue's companion rows "
    "(finished runs' records taskguard:finished:<id>, <key>#pending/#rate/#debounce).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array (one object per row).")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="At most this many rows.",
)
@click.pass_context
def locks(
    ctx: click.Context,
    database_url: str | None,
    prefix: str | None,
    show_all: bool,
    as_json: bool,
    limit: int,
) -> None:
    """List held locks (with --all, every row: expired ones the reaper has not removed
    yet, and companion rows such as finished runs' records)."""
    with open_guard(ctx, database_url) as guard:
        infos = guard.held(prefix, include_expired=show_all, companions=show_all, limit=limit)
    if as_json:
        click.echo(_json(infos))
    elif not infos:
        scope = f" with prefix {prefix!r}" if prefix else ""
        click.echo(f"no {'lock rows' if show_all else 'locks held'}{scope}")
    else:
        click.echo("\n".join(locks_table(infos, with_state=show_all)))
    if len(infos) >= limit:
        click.echo(f"taskguard: showing the first {limit} rows; raise --limit for more", err=True)


@main_group.command()
@database_url_option
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array (one object per slot).")
@click.option(
    "--all",
    "-a",
    "show_all",
    is_flag=True,
    help="Also KEY's companion rows (pending runs, rate slots, debounce batches).",
)
@click.pass_context
def show(
    ctx: click.Context, database_url: str | None, key: str, as_json: bool, show_all: bool
) -> None:
    """Who holds KEY: owner, token, task, host, pid, since when, until when; then
    one line per companion row of KEY (its pending run, rate window, debounce batch).

    Exit code 1 when KEY has no row at all, nor a companion row (with --json, a JSON
    error object too)."""
    with open_guard(ctx, database_url) as guard:
        infos = guard.get_all(key)
        rows = companion_rows(key, functools.partial(guard.held, companions=True))
        # How an ended lease ended, as `explain` tells it (one read of the history).
        ends = endings(guard.events(key)) if any(not i.held for i in infos) else {}
    if not infos and not rows:
        fail(
            f"no lock row for {key!r} (never locked, or reaped after it expired)",
            EXIT_NOT_FOUND,
            extra={"key": key},
        )
    shown = infos + rows if show_all else infos
    if as_json:
        click.echo(_json(shown))
        return
    lines = describe_companions(key, lambda _prefix: rows)  # [coalesce/rate/debounce]
    in_use = slots_in_use(shown)
    blocks = [lock_details(info, ends.get((info.slot, info.owner)), in_use) for info in shown]
    if lines:
        blocks.append("\n".join(printable(line, backslashes=False) for line in lines))
    if not infos:
        header = printable(
            f"no lock row for {key!r} (free); its companion rows:", backslashes=False
        )
        blocks[0] = f"{header}\n{blocks[0]}"
    click.echo("\n\n".join(blocks))


@main_group.command()
@database_url_option
@click.argument("key")
@click.option("--owner", "-o", default=None, metavar="O", help="Release only if owner O holds it.")
@click.option("--force", is_flag=True, help="Release whoever holds it (asks first).")
@click.option("--yes", "-y", is_flag=True, help="With --force: do not ask for confirmation.")
@click.pass_context
def release(
    ctx: click.Context,
    database_url: str | None,
    key: str,
    owner: str | None,
    force: bool,
    yes: bool,
) -> None:
    """End the lease on KEY.

    With --owner O: only the lease of owner O (as shown by `taskguard show`); exit 1
    if O does not hold it. With --force: any live lease; the holder keeps running
    but its next renew or release fails, so only use it on a holder you know is dead.
    """
    if force == (owner is not None):
        fail("release needs exactly one of --owner O or --force", EXIT_USAGE)
    with open_guard(ctx, database_url) as guard:
        if owner is not None:
            _release_owned(guard, key, owner)
        else:
            _release_forced(guard, key, yes)


def _release_owned(guard: TaskGuard, key: str, owner: str) -> None:
    infos = guard.get_all(key)
    mine = [i for i in infos if i.owner == owner and i.held]
    if not mine:
        live = [i for i in infos if i.held]
        holder = f"; held by {live[0].describe()}" if live else "; not held by anyone"
        fail(f"{key!r} is not held by owner {owner}{holder}", EXIT_NOT_FOUND)
    info = mine[0]
    lease = Lease(
        key=info.key,
        owner=info.owner,
        token=info.token,
        acquired_at=info.acquired_at,
        expires_at=info.expires_at,
        ttl=max(info.expires_in.total_seconds(), 0.001),
        slot=info.slot,
    )
    if not guard.release(lease):
        fail(f"{key!r} is no longer held by owner {owner} (expired or taken over)", EXIT_NOT_FOUND)
    click.echo(f"released {info.key!r} (owner {printable(owner)}, token {info.token})")


def _release_forced(guard: TaskGuard, key: str, yes: bool) -> None:
    live = [i for i in guard.get_all(key) if i.held]
    if not live:
        fail(f"{key!r} is not held", EXIT_NOT_FOUND)
    if not yes:
        holders = printable("; ".join(i.describe() for i in live), backslashes=False)
        try:
            confirmed = click.confirm(
                f"Force-release {key!r}, held by {holders}?", default=False, err=True
            )
        except click.Abort:
            confirmed = None
        if not sys.stdin.isatty():
            click.echo("", err=True)  # a piped answer is not echoed: end the prompt's line
        if confirmed is None:
            fail(
                f"{key!r} not released: confirmation needed (pass --yes when not interactive)",
                EXIT_USAGE,
            )
        if not confirmed:
            fail(f"{key!r} not released (declined)", EXIT_NOT_FOUND)
    if not guard.force_release(key):
        fail(f"{key!r} is not held (released or expired meanwhile)", EXIT_NOT_FOUND)
    click.echo(f"force-released {live[0].key!r} ({len(live)} live lease(s))")


def _progress_printer() -> tuple[Callable[[int], None], Callable[[], None]]:
    """Per-batch progress on stderr, once a reap turns out to need several batches."""
    tty = sys.stderr.isatty()
    interval = 0.2 if tty else 1.0
    state = {"batches": 0, "last": 0.0, "shown": False}

    def progress(removed: int) -> None:
        state["batches"] += 1
        now = time.monotonic()
        if state["batches"] < 2 or (state["shown"] and now - state["last"] < interval):
            return
        state["last"], state["shown"] = now, True
        line = f"reap: {removed} row(s) removed so far ({state['batches']} batches)"
        click.echo(f"\r{line}" if tty else line, nl=not tty, err=True)

    def done() -> None:
        if tty and state["shown"]:
            click.echo("", err=True)

    return progress, done


@main_group.command()
@database_url_option
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=None,
    metavar="S",
    help="Only rows expired more than S seconds ago (default: taskguard_reaper_grace, 300).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Rows per transaction (default: taskguard_reaper_batch_size, 5000).",
)
@click.option(
    "--max-batches", type=click.IntRange(min=1), default=None, metavar="N", help="Stop after N."
)
@click.pass_context
def reap(
    ctx: click.Context,
    database_url: str | None,
    grace: float | None,
    batch_size: int | None,
    max_batches: int | None,
) -> None:
    """Delete rows whose lease ended more than --grace seconds ago (what the scheduled
    reaper task does). Live leases are never touched; safe next to a running reaper."""
    app = celery_app(ctx)
    grace_s = float(setting(app, "taskguard_reaper_grace") if grace is None else grace)
    size = int(setting(app, "taskguard_reaper_batch_size") if batch_size is None else batch_size)
    progress, done = _progress_printer()
    with open_guard(ctx, database_url) as guard:
        started = time.monotonic()
        try:
            result = guard.reap(
                grace=grace_s, batch_size=size, max_batches=max_batches, progress=progress
            )
        finally:
            done()
        elapsed = time.monotonic() - started
    click.echo(
        f"removed {int(result)} expired lock row(s) from {guard.url} in {result.batches} "
        f"batch(es), {elapsed:.2f}s (grace {grace_s:g}s)"
    )
