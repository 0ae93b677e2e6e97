"""``taskguard locks|show|release|reap``: who holds what, and the operator's levers.

Each command is a thin layer over one or two :class:`taskguard.TaskGuard` calls.
Under ``celery -A proj taskguard …`` the database URL and settings come from the
Celery app (see :mod:`taskguard.cli.celery`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, NoReturn

import click
from sqlalchemy.engine import make_url

from taskguard.cli._common import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    database_url_option,
    fail,
    main_group,
    masked,
    resolve_url,
)
from taskguard.config import setting
from taskguard.exceptions import TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.lease import Lease, LockInfo

__all__ = ["format_duration", "locks", "reap", "release", "show"]

#: ``ctx.meta`` key where ``celery … taskguard`` leaves the app's configuration error.
CONFIG_ERROR_META = "taskguard.config_error"


# -- plumbing --------------------------------------------------------------------------


def _celery_app(ctx: click.Context) -> Any:
    """The Celery app when running as ``celery -A proj taskguard …``, else ``None``."""
    return getattr(ctx.find_root().obj, "app", None)


def _url(ctx: click.Context, database_url: str | None) -> str:
    if not database_url and not getattr(ctx.find_root().obj, "taskguard_database_url", None):
        error = ctx.meta.get(CONFIG_ERROR_META)
        if error:
            fail(str(error), EXIT_USAGE)
    return resolve_url(ctx, database_url)


def _scrub(message: str, url: str) -> str:
    """``message`` with the URL (in any rendering) and its password masked."""
    message = message.replace(url, masked(url))
    try:
        password = make_url(url).password
    except Exception:
        password = None
    if password:
        message = message.replace(str(password), "***")
    return " ".join(message.split()) or "error"


def _die(exc: BaseException, url: str) -> NoReturn:
    fail(_scrub(str(exc), url), EXIT_USAGE)


@contextmanager
def _guard(ctx: click.Context, database_url: str | None) -> Iterator[TaskGuard]:
    """A guard for the command's database; taskguard errors become one line + exit 2."""
    url = _url(ctx, database_url)
    app = _celery_app(ctx)
    options = dict(setting(app, "taskguard_engine_options") or {})
    try:
        guard = TaskGuard(
            url,
            history=bool(setting(app, "taskguard_history")),
            history_retention=float(setting(app, "taskguard_history_retention")),
            **options,
        )
    except (TaskGuardError, ValueError) as exc:
        _die(exc, url)
    try:
        yield guard
    except (TaskGuardError, ValueError) as exc:
        _die(exc, url)
    finally:
        guard.dispose()


class _OneLineUsage(click.Command):
    """Usage errors (bad option values, missing arguments) as one ``taskguard: ...``
    line with exit code 2, like every other error of these commands."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            fail(f"{info_name or self.name}: {exc.format_message()}", EXIT_USAGE)


# -- formatting ------------------------------------------------------------------------


def format_duration(value: timedelta) -> str:
    """``950ms``, ``12.3s``, ``4m05s``, ``2h03m``, ``3d04h``; negative with a leading ``-``."""
    seconds = value.total_seconds()
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    if seconds < 1:
        text = f"{seconds * 1000:.0f}ms"
    elif seconds < 60:
        text = f"{seconds:.1f}s"
    elif seconds < 3600:
        text = f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    elif seconds < 86400:
        text = f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    else:
        text = f"{int(seconds // 86400)}d{int(seconds % 86400 // 3600):02d}h"
    return sign + text


def _when(value: datetime) -> str:
    return value.isoformat(sep=" ", timespec="milliseconds")


def _dash(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _state(info: LockInfo) -> str:
    if info.held:
        return "held"
    return f"expired {format_duration(-info.expires_in)} ago (row not yet reaped)"


def _details(info: LockInfo) -> str:
    h = info.holder
    fields = [
        ("key", info.key),
        ("slot", str(info.slot)),
        ("state", _state(info)),
        ("owner", info.owner),
        ("token", str(info.token)),
        ("task", _dash(h.task_name)),
        ("task id", _dash(h.task_id)),
        ("host", _dash(h.hostname)),
        ("pid", _dash(h.pid)),
        ("acquired", _when(info.acquired_at)),
        ("expires", _when(info.expires_at)),
        ("held for", format_duration(info.held_for)),
        ("expires in", format_duration(info.expires_in)),
    ]
    return "\n".join(f"{name + ':':<12}{value}" for name, value in fields)


def _json(infos: Sequence[LockInfo]) -> str:
    return json.dumps([info.to_dict() for info in infos], indent=2)


# -- commands --------------------------------------------------------------------------


@main_group.command(cls=_OneLineUsage)
@database_url_option
@click.option("--prefix", "-p", default=None, metavar="P", help="Only keys starting with P.")
@click.option(
    "--all", "-a", "include_expired", is_flag=True, help="Also expired rows not yet reaped."
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
    include_expired: bool,
    as_json: bool,
    limit: int,
) -> None:
    """List live leases (with --all, also expired rows the reaper has not removed yet)."""
    with _guard(ctx, database_url) as guard:
        infos = guard.held(prefix, include_expired=include_expired, limit=limit)
    if as_json:
        click.echo(_json(infos))
    elif not infos:
        scope = f" with prefix {prefix!r}" if prefix else ""
        click.echo(f"no {'lock rows' if include_expired else 'locks held'}{scope}")
    else:
        headers = ["KEY", "SLOT", "TOKEN", "TASK", "HOST", "PID", "HELD FOR", "EXPIRES IN"]
        if include_expired:
            headers.append("STATE")
        rows = []
        for info in infos:
            h = info.holder
            row = [
                info.key,
                str(info.slot),
                str(info.token),
                _dash(h.task_name),
                _dash(h.hostname),
                _dash(h.pid),
                format_duration(info.held_for),
                format_duration(info.expires_in),
            ]
            if include_expired:
                row.append("held" if info.held else "expired")
            rows.append(row)
        click.echo(_table(headers, rows))
    if len(infos) >= limit:
        click.echo(f"taskguard: showing the first {limit} rows; raise --limit for more", err=True)


@main_group.command(cls=_OneLineUsage)
@database_url_option
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array (one object per slot).")
@click.pass_context
def show(ctx: click.Context, database_url: str | None, key: str, as_json: bool) -> None:
    """Who holds KEY: owner, token, task, host, pid, since when, until when.

    Exit code 1 when KEY has no row at all."""
    with _guard(ctx, database_url) as guard:
        infos = guard.get_all(key)
    if not infos:
        fail(f"no lock row for {key!r} (never locked, or reaped after it expired)", EXIT_NOT_FOUND)
    if as_json:
        click.echo(_json(infos))
    else:
        click.echo("\n\n".join(_details(info) for info in infos))


@main_group.command(cls=_OneLineUsage)
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
    with _guard(ctx, database_url) as guard:
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
    click.echo(f"released {info.key!r} (owner {owner}, token {info.token})")


def _release_forced(guard: TaskGuard, key: str, yes: bool) -> None:
    live = [i for i in guard.get_all(key) if i.held]
    if not live:
        fail(f"{key!r} is not held", EXIT_NOT_FOUND)
    if not yes:
        holders = "; ".join(i.describe() for i in live)
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


@main_group.command(cls=_OneLineUsage)
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
    app = _celery_app(ctx)
    grace_s = float(setting(app, "taskguard_reaper_grace") if grace is None else grace)
    size = int(setting(app, "taskguard_reaper_batch_size") if batch_size is None else batch_size)
    progress, done = _progress_printer()
    with _guard(ctx, database_url) as guard:
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
