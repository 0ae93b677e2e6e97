"""``taskguard web``: serve the operators' page (:mod:`taskguard.web`) with uvicorn.

Starlette, Jinja2 and uvicorn are imported only when the command runs (the ``web``
extra), so the other commands never need them."""

from __future__ import annotations

import os

import click

from taskguard.cli.errors import EXIT_USAGE, fail, failing_as_one_line
from taskguard.cli.root import celery_app, database_url_option, main_group, resolve_url
from taskguard.config import build_guard

__all__ = ["web"]

#: HTTP basic credentials the operators act with (``--allow-actions``).
ENV_USER = "TASKGUARD_WEB_USER"
ENV_PASSWORD = "TASKGUARD_WEB_PASSWORD"


@main_group.command()
@database_url_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--allow-actions",
    is_flag=True,
    help=f"Offer force-release and reap, behind HTTP basic auth (${ENV_USER}, ${ENV_PASSWORD}).",
)
@click.pass_context
def web(
    ctx: click.Context, database_url: str | None, host: str, port: int, allow_actions: bool
) -> None:
    """Serve a page of the locks: overview, locks, each key's story; read-only unless
    --allow-actions."""
    try:
        import uvicorn

        from taskguard.web import basic_auth, create_app
    except ModuleNotFoundError as exc:
        fail(f"taskguard web needs {exc.name}: pip install 'taskguard-sql[web]'", EXIT_USAGE)
    authorize = None
    if allow_actions:
        user, password = os.environ.get(ENV_USER), os.environ.get(ENV_PASSWORD)
        if not user or not password:
            fail(
                f"--allow-actions needs ${ENV_USER} and ${ENV_PASSWORD} set (the operators' "
                "HTTP basic credentials)",
                EXIT_USAGE,
            )
        authorize = basic_auth(user, password)
    url = resolve_url(ctx, database_url, existing=True)
    with failing_as_one_line(url):
        guard = build_guard(celery_app(ctx), url=url)
        app = create_app(guard, allow_actions=allow_actions, authorize=authorize)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        guard.dispose()
