"""Alembic environment for taskguard's own migrations.

Run through ``taskguard db …`` (or ``alembic`` with the repo's alembic.ini). It
records versions in ``taskguard_alembic_version`` so an application's own
``alembic_version`` table is never read or written. Migrations only touch
taskguard's objects.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from taskguard.models import VERSION_TABLE, metadata
from taskguard.schema import check_supported, include_taskguard_object

config = context.config


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        include_object=include_taskguard_object,
        render_as_batch=True,
        **kwargs,  # type: ignore[arg-type]
    )


def _url() -> str | None:
    # Precedence: programmatic (taskguard db ...), then `alembic -x url=...`, then alembic.ini.
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    return url or config.get_main_option("sqlalchemy.url")


def run_offline() -> None:
    url = _url()
    _configure(url=url, literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        # Before Alembic creates its version table: a refusal leaves nothing behind.
        check_supported(connection)
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = _url()
    if url is None:
        raise RuntimeError("no database URL: pass -x url=... or set sqlalchemy.url")
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            check_supported(conn)
            _configure(connection=conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
