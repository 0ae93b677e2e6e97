"""Schema management: taskguard's Alembic migrations, applied to an existing database.

``taskguard db upgrade`` (and :func:`upgrade`) keep their own version table,
``taskguard_alembic_version``; they never write an application's
``alembic_version``. Alternatively an application can add :func:`versions_dir` to
its own ``version_locations`` (the revisions carry the branch label
``taskguard``). :func:`installed` reads which revision is applied, wherever it is
recorded.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import URL, Connection, Engine, create_engine

from taskguard.dialects import dialect_for, dialect_for_url
from taskguard.exceptions import ConfigurationError
from taskguard.models import (
    HELD_VIEW,
    LOCKS_TABLE,
    SQLITE_TOKEN_TABLE,
    TOKEN_SEQUENCE,
    VERSION_TABLE,
)
from taskguard.store.errors import translate_error
from taskguard.urls import mask_url, parse_url

if TYPE_CHECKING:
    from alembic.config import Config

# Alembic is imported by the functions that use it: importing it costs about as
# much as the rest of the package, and the lock API, the worker's hot path and
# commands such as `taskguard locks` never need it.

__all__ = [
    "alembic_config",
    "check_supported",
    "current",
    "downgrade",
    "exclude_taskguard_objects",
    "head",
    "include_taskguard_object",
    "installed",
    "sql",
    "upgrade",
    "versions_dir",
]

BRANCH_LABEL = "taskguard"
#: Every database object taskguard's migrations create.
TASKGUARD_OBJECTS = frozenset(
    {LOCKS_TABLE, HELD_VIEW, TOKEN_SEQUENCE, SQLITE_TOKEN_TABLE, VERSION_TABLE, "task_lock_events"}
)


def migrations_dir() -> Path:
    """Directory of taskguard's Alembic environment (inside the installed package)."""
    try:
        path = Path(str(resources.files("taskguard.migrations")))
    except ModuleNotFoundError:
        path = Path(__file__).resolve().parent.parent / "migrations"
    if not (path / "env.py").is_file():
        raise ConfigurationError(f"taskguard's migrations are missing (looked in {path})")
    return path


def versions_dir() -> Path:
    """Directory of taskguard's revision files, for an application's ``version_locations``."""
    return migrations_dir() / "versions"


def include_taskguard_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic ``include_object`` hook that sees only taskguard's objects.

    SQLite's token counter lives outside the ORM metadata (it has no PostgreSQL
    counterpart), so it is not compared.
    """
    if type_ == "table":
        return name in TASKGUARD_OBJECTS and name not in (SQLITE_TOKEN_TABLE, VERSION_TABLE)
    table = getattr(obj, "table", None)
    return table is None or table.name in TASKGUARD_OBJECTS


def exclude_taskguard_objects(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Alembic ``include_object`` hook for an *application's* env.py: hides
    taskguard's tables so autogenerate never proposes dropping them."""
    if type_ == "table":
        return name not in TASKGUARD_OBJECTS
    table = getattr(obj, "table", None)
    return table is None or table.name not in TASKGUARD_OBJECTS


def check_supported(conn: Connection) -> None:
    """Raise :class:`ConfigurationError` unless taskguard supports this database
    (the registry's dialect for it accepts the server it reached). Called before
    Alembic creates its version table, so a refusal leaves nothing behind."""
    dialect_for(conn.dialect.name).check_server(conn.dialect)


def alembic_config(url: str | URL | None = None, *, stdout: Any = None) -> Config:
    """An Alembic :class:`~alembic.config.Config` for taskguard's migrations.

    The URL is passed as an attribute, not through the ini parser, so passwords
    with ``%`` survive.
    """
    from alembic.config import Config

    cfg = Config(stdout=stdout) if stdout is not None else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        cfg.attributes["url"] = url if isinstance(url, str) else url.render_as_string(False)
    return cfg


def _engine(url_or_engine: str | URL | Engine) -> tuple[Engine, bool]:
    if isinstance(url_or_engine, Engine):
        return url_or_engine, False
    parsed = parse_url(url_or_engine)
    try:
        # Unknown databases and unsupported or missing drivers: one line naming the fix.
        connect_args = dialect_for_url(parsed).connect_args(parsed)
    except ConfigurationError as exc:
        raise ConfigurationError(f"cannot use database URL {mask_url(parsed)!r}: {exc}") from None
    try:
        return create_engine(parsed, connect_args=connect_args), True
    except Exception as exc:
        raise ConfigurationError(
            f"invalid database URL {mask_url(url_or_engine)!r}: {exc}"
        ) from None


def _run_online(url_or_engine: str | URL | Engine, fn: Any, revision: str) -> None:
    engine, owned = _engine(url_or_engine)
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            fn(cfg, revision)
    except ConfigurationError:
        raise
    except Exception as exc:
        if type(exc).__module__.startswith(("sqlalchemy", "psycopg", "sqlite3")):
            raise translate_error(exc, mask_url(engine.url)) from exc
        raise
    finally:
        if owned:
            engine.dispose()


def upgrade(url_or_engine: str | URL | Engine, revision: str = "heads") -> None:
    """Apply taskguard's migrations up to ``revision`` (idempotent)."""
    from alembic import command

    _run_online(url_or_engine, command.upgrade, revision)


def downgrade(url_or_engine: str | URL | Engine, revision: str = "base") -> None:
    """Revert taskguard's migrations down to ``revision`` (``base`` removes everything)."""
    from alembic import command

    _run_online(url_or_engine, command.downgrade, revision)


def current(url_or_engine: str | URL | Engine) -> list[str]:
    """Revisions applied to the database (empty if none), wherever they are kept:
    :func:`installed` ``.revisions``."""
    return installed(url_or_engine).revisions


@dataclass(frozen=True)
class Installed:
    """Where taskguard's schema revision is recorded, and which it is: the one
    reading ``taskguard check``, a worker's start-up check, ``taskguard db`` and
    ``manage.py migrate`` share (docs/alembic.md's two ways, and the switch)."""

    #: taskguard's revisions applied (empty: not installed).
    revisions: list[str]
    #: ``True``: recorded in the application's own ``alembic_version`` (way 2);
    #: ``False``: in taskguard's ``taskguard_alembic_version`` (way 1), or nowhere.
    by_application: bool = False
    #: taskguard's revisions in the application's ``alembic_version`` too, ignored
    #: while taskguard's own table exists (a switch to way 2 left half done).
    stale: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        """The version table, for messages."""
        return "your application's alembic_version" if self.by_application else VERSION_TABLE

    def stale_note(self) -> str:
        """Which version table is stale when both record taskguard (:attr:`stale`), and
        the fix either way."""
        ids = ", ".join(repr(r) for r in self.stale)
        return (
            f"your application's alembic_version also records {', '.join(self.stale)}, "
            f"ignored while {VERSION_TABLE} exists (stale). Keep one: for your Alembic "
            f"(docs/alembic.md, way 2) DROP TABLE {VERSION_TABLE}; for `taskguard db "
            f"upgrade` (way 1) DELETE FROM alembic_version WHERE version_num IN ({ids})"
        )

    def upgrade_command(self) -> str:
        """What brings this schema to the head revision, for a one-line message."""
        if self.by_application:
            return "`alembic upgrade heads` (your application's Alembic manages it)"
        return "`taskguard db upgrade --database-url ...` (as the schema owner)"


@contextlib.contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic's INFO lines (its plugins set up, the context's implementation) kept
    out of the caller's log while a revision is read: a worker's start-up check logs
    one line of its own."""
    logger = logging.getLogger("alembic")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


@_quiet_alembic()
def installed(url_or_engine: str | URL | Engine) -> Installed:
    """taskguard's applied revisions: from its own version table (way 1 of
    docs/alembic.md), else from the application's ``alembic_version`` when
    taskguard's revisions are part of the application's history (way 2)."""
    from alembic.runtime.migration import MigrationContext

    engine, owned = _engine(url_or_engine)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            own = sorted(ctx.get_current_heads())
            # The default version table: alembic_version.
            theirs = set(MigrationContext.configure(conn).get_current_heads())
            mine = sorted(theirs & _revisions()) if theirs else []
            if own:
                return Installed(own, stale=tuple(mine))
            return Installed(mine, by_application=bool(mine))
    except Exception as exc:
        raise translate_error(exc, mask_url(engine.url)) from exc
    finally:
        if owned:
            engine.dispose()


def _revisions() -> set[str]:
    """Every revision id shipped with this version of taskguard."""
    from alembic.script import ScriptDirectory

    return {rev.revision for rev in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def head() -> str:
    """The newest revision shipped with this version of taskguard."""
    from alembic.script import ScriptDirectory

    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    return heads[0]


def sql(url: str | URL, revision: str = "heads", *, from_revision: str | None = None) -> str:
    """The DDL ``upgrade`` would run, for a DBA to review (Alembic offline mode).
    No connection is made; only the URL's dialect matters."""
    from alembic import command

    buf = io.StringIO()
    cfg = alembic_config(url, stdout=buf)
    cfg.output_buffer = buf
    target = f"{from_revision}:{revision}" if from_revision else revision
    command.upgrade(cfg, target, sql=True)
    return buf.getvalue()
