"""The start-up check: is the lock database usable by this process?

Run at Celery worker start (``taskguard_startup_check``), by ``taskguard check`` and
by ``celery -A app taskguard check``. It checks, in order, and stops at the first
step that cannot go on:

1. the URL parses and names a driver taskguard can load (``postgres://`` and
   ``postgresql://`` mean psycopg 3);
2. the database answers (within ``timeout`` seconds);
3. taskguard's schema is at the head revision of this version of taskguard;
4. the role has the privileges the lock statements need (PostgreSQL).

Each problem is one line naming the fix. Nothing is created or changed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sqlalchemy import URL, Engine, create_engine, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import NullPool

from taskguard import schema
from taskguard.dialects import dialect_for
from taskguard.exceptions import ConfigurationError, TaskGuardError
from taskguard.urls import mask_url, parse_url

__all__ = ["CheckResult", "check_database"]

log = logging.getLogger("taskguard")

#: (object, kind, privileges) the lock statements need; see docs/reliability.md,
#: "Least privilege". The history table and its sequence are opt-in: not checked.
_PG_PRIVILEGES = (
    ("task_locks", "table", "SELECT, INSERT, UPDATE, DELETE"),
    ("task_locks_token_seq", "sequence", "USAGE"),
)


@dataclass
class CheckResult:
    """What :func:`check_database` found. ``problems`` is empty when all is well;
    ``unreachable`` says the only problem is that the database did not answer."""

    url: str
    problems: list[str] = field(default_factory=list)
    unreachable: bool = False
    schema_revision: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        """One line for a log or a terminal."""
        if self.ok:
            return f"taskguard: {self.url}: ok (schema at {self.schema_revision})"
        return f"taskguard: {self.url}: " + "; ".join(self.problems)


def check_database(url_or_engine: str | URL | Engine, *, timeout: float = 5.0) -> CheckResult:
    """Check URL, connectivity, schema revision and privileges; never raises for a
    problem with the database (it is reported in the result)."""
    if isinstance(url_or_engine, Engine):
        engine, owned = url_or_engine, False
        result = CheckResult(mask_url(engine.url))
    else:
        result = CheckResult(mask_url(url_or_engine))
        try:
            parsed = parse_url(url_or_engine)
            connect_args = dialect_for(parsed.get_backend_name()).connect_args(parsed)
            if "connect_timeout" in connect_args:
                connect_args["connect_timeout"] = max(1, round(timeout))
            engine = create_engine(parsed, connect_args=connect_args, poolclass=NullPool)
        except ConfigurationError as exc:  # unparseable, or not a database taskguard knows
            result.problems.append(str(exc))
            return result
        except (sa_exc.ArgumentError, ImportError) as exc:
            result.problems.append(
                f"cannot use this database URL: {exc} (for PostgreSQL use postgresql+psycopg://)"
            )
            return result
        owned = True
        result.url = mask_url(parsed)
    try:
        _check(engine, result)
    finally:
        if owned:
            engine.dispose()
    return result


def _check(engine: Engine, result: CheckResult) -> None:
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except sa_exc.DBAPIError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        result.problems.append(f"database unreachable: {first} (check the URL, network, server)")
        result.unreachable = True
        return
    try:
        state = schema.installed(engine)
    except TaskGuardError as exc:  # already one line naming the fix (e.g. a privilege)
        result.problems.append(str(exc))
        return
    except sa_exc.DBAPIError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        result.problems.append(f"cannot read taskguard's schema version: {first}")
        return
    head = schema.head()
    result.schema_revision = ", ".join(state.revisions) or "base"
    if state.revisions != [head]:
        where = f" in {state.where}" if state.revisions else ""
        status = "not installed" if not state.revisions else f"at {result.schema_revision}{where}"
        result.problems.append(
            f"taskguard's schema is {status}, this taskguard needs {head}: run "
            f"{state.upgrade_command()}"
        )
        return
    if engine.dialect.name == "postgresql":
        _check_pg_privileges(engine, result)


def _check_pg_privileges(engine: Engine, result: CheckResult) -> None:
    missing: list[str] = []
    with engine.connect() as conn:
        for name, kind, privileges in _PG_PRIVILEGES:
            fn = "has_table_privilege" if kind == "table" else "has_sequence_privilege"
            for privilege in privileges.split(", "):
                allowed = conn.execute(
                    text(f"SELECT {fn}(CAST(:name AS text), CAST(:priv AS text))"),
                    {"name": name, "priv": privilege},
                ).scalar()
                if not allowed:
                    missing.append(f"{privilege} on {kind} {name}")
    if missing:
        result.problems.append(
            f"the role lacks {', '.join(missing)}: GRANT them (docs/reliability.md, "
            "'Least privilege')"
        )
