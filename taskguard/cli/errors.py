"""The command line's one error path: every failure, whether a taskguard error, a
usage error or a "not found", leaves through :func:`fail`, which masks database
URLs and passwords, escapes control characters, keeps the message to one line on
stderr and exits with the code its kind maps to. Under ``--json`` a JSON error
object is printed on stdout as well, so a script reading stdout sees the error.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

from taskguard.display import printable
from taskguard.exceptions import TaskGuardError
from taskguard.urls import mask_text

__all__ = ["EXIT_NOT_FOUND", "EXIT_USAGE", "OneLineGroup", "fail", "failing_as_one_line"]

EXIT_OK = 0
#: Not found, not the owner, declined.
EXIT_NOT_FOUND = 1
#: Usage, configuration or connection error.
EXIT_USAGE = 2


def fail(
    error: BaseException | str,
    code: int = EXIT_USAGE,
    *,
    url: str | None = None,
    extra: dict[str, Any] | None = None,
) -> NoReturn:
    """Print ``taskguard: <message>`` as one masked, escaped line on stderr and exit
    with ``code`` (default 2: usage, configuration or connection). Under ``--json`` also
    print ``{"error": ..., "exit_code": ...}`` (plus ``extra``) on stdout."""
    message = " ".join(mask_text(str(error), url).split()) or "error"
    # Messages quote values with repr() already; only controls still need escaping.
    message = printable(message, backslashes=False)
    ctx = click.get_current_context(silent=True)
    if ctx is not None and _wants_json(ctx):
        payload: dict[str, Any] = {"error": message, "exit_code": code, **(extra or {})}
        click.echo(json.dumps(payload))
    click.echo(f"taskguard: {message}", err=True)
    sys.exit(code)


def _wants_json(ctx: click.Context) -> bool:
    # Every command's --json flag is the parameter ``as_json``.
    return bool(ctx.params.get("as_json"))


@contextmanager
def failing_as_one_line(url: str | None = None) -> Iterator[None]:
    """Run a block; a taskguard (or value) error inside it goes to :func:`fail`."""
    try:
        yield
    except (TaskGuardError, ValueError) as exc:
        fail(exc, url=url)


def _usage(exc: click.UsageError, name: str | None) -> NoReturn:
    if isinstance(exc, getattr(click.exceptions, "NoArgsIsHelpError", ())):
        raise exc  # a group run bare prints its help (click >= 8.2)
    path = exc.ctx.command_path if exc.ctx is not None else name
    fail(f"{exc.format_message()} (`{path} --help` for usage)", EXIT_USAGE)


class OneLineUsage(click.Command):
    """Usage errors (bad option values, missing arguments) through :func:`fail`
    too, rather than click's multi-line usage text."""

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
            _usage(exc, info_name or self.name)


class OneLineGroup(OneLineUsage, click.Group):
    """A command group whose usage errors, an unknown command's too, are one line
    (naming the command meant, if one is close); its commands and groups are
    :class:`OneLineUsage` and :class:`OneLineGroup` unless they say otherwise."""

    command_class = OneLineUsage
    group_class = type  # the same class as this group

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            name = args[0]
            if name.startswith("-"):
                _usage(exc, self.name)
        names = self.list_commands(ctx)
        close = difflib.get_close_matches(name, names, n=1)
        fix = (
            f"did you mean `{ctx.command_path} {close[0]}`?"
            if close
            else f"the commands are {', '.join(names)}"
        )
        fail(f"no command {name!r}; {fix}", EXIT_USAGE)
