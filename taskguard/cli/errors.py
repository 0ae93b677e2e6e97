"""The command line's one error path: every failure, whether a taskguard error, a
usage error or a "not found", leaves through :func:`fail`, which masks database
URLs and passwords, escapes control characters, keeps the message to one line on
stderr and exits with the code its kind maps to. Under ``--json`` a JSON error
object is printed on stdout as well, so a script reading stdout sees the error.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

from taskguard.display import printable
from taskguard.exceptions import TaskGuardError
from taskguard.urls import mask_url, parse_url

__all__ = [
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "OneLineUsage",
    "fail",
    "failing_as_one_line",
]

EXIT_OK = 0
#: Not found, not the owner, declined.
EXIT_NOT_FOUND = 1
#: Usage, configuration or connection error.
EXIT_USAGE = 2

# scheme://user:secret@  ->  scheme://user:***@ , for URLs quoted in any message.
_USERINFO = re.compile(r"(?P<head>[A-Za-z][\w+.-]*://[^\s/:@'\"]*:)(?P<secret>[^\s@'\"]+)@")


def _mask(message: str, url: str | None) -> str:
    if url:
        message = message.replace(url, mask_url(url))
        try:
            password = parse_url(url).password
        except TaskGuardError:
            password = None
        if password:
            message = message.replace(str(password), "***")
    # A secret someone masked already (kombu writes "**") stays as it is.
    return _USERINFO.sub(
        lambda m: m.group(0) if set(m["secret"]) == {"*"} else f"{m['head']}***@", message
    )


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
    message = " ".join(_mask(str(error), url).split()) or "error"
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
            fail(f"{info_name or self.name}: {exc.format_message()}", EXIT_USAGE)
