"""``taskguard demo``: see taskguard work, with nothing to set up."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from taskguard.cli.errors import EXIT_USAGE, fail
from taskguard.cli.root import main_group
from taskguard.exceptions import TaskGuardError

__all__ = ["demo"]


@main_group.command()
@click.option(
    "--database-url",
    metavar="URL",
    default=None,
    help="Lock database (default: a SQLite file in the work directory). "
    "$TASKGUARD_DATABASE_URL is deliberately not read: the demo writes lock rows.",
)
@click.option(
    "--broker",
    metavar="URL",
    default=None,
    help="Celery broker, e.g. amqp://guest:guest@127.0.0.1:5672// or redis://127.0.0.1:6379/0 "
    "(default: kombu's SQLAlchemy transport over a SQLite file).",
)
@click.option(
    "--result-backend",
    metavar="URL",
    default=None,
    help="Celery result backend (default: db+sqlite in the work directory).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the demo's files (SQLite databases, demo.log) here instead of a temp dir.",
)
@click.option("--feeds", type=click.IntRange(1, 8), default=5, show_default=True)
@click.option(
    "--duplicates",
    type=click.IntRange(1, 100),
    default=6,
    show_default=True,
    help="Submissions per feed per wave.",
)
@click.option("--waves", type=click.IntRange(1, 20), default=4, show_default=True)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 64),
    default=8,
    show_default=True,
    help="Worker threads.",
)
@click.option(
    "--unguarded",
    is_flag=True,
    help="Run the same task without taskguard, to see feeds imported several times at once.",
)
@click.option("--verbose", "-v", is_flag=True, help="Also print taskguard's and Celery's logs.")
def demo(
    database_url: str | None,
    broker: str | None,
    result_backend: str | None,
    workdir: Path | None,
    feeds: int,
    duplicates: int,
    waves: int,
    concurrency: int,
    unguarded: bool,
    verbose: bool,
) -> None:
    """Run Celery's "only one at a time" feed importer end to end: a real worker in
    this process, many duplicate submissions per feed, and a table of what ran.

    Exits 0 only if no feed was ever imported twice at once and every submission
    ran or was skipped; 1 otherwise; 2 if the database or broker is unusable.
    """
    from taskguard.demo import DemoOptions, run_demo

    options = DemoOptions(
        database_url=database_url,
        broker=broker,
        result_backend=result_backend,
        workdir=workdir,
        feeds=feeds,
        duplicates=duplicates,
        waves=waves,
        concurrency=concurrency,
        guarded=not unguarded,
        verbose=verbose,
    )
    try:
        outcome = run_demo(options, echo=click.echo)
    except TaskGuardError as exc:
        fail(exc, EXIT_USAGE, url=database_url)
    except Exception as exc:
        if verbose:
            raise
        fail(
            f"demo failed: {type(exc).__name__}: {exc} (--verbose shows where)",
            EXIT_USAGE,
            url=database_url,
        )
    sys.exit(outcome.exit_code)
