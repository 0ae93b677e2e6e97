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
from taskguard.dialects import dialect_for, dialect_for_url
from taskguard.dialects.base import ErrorKind
from taskguard.exceptions import ConfigurationError, TaskGuardError
from taskguard.store.errors import translate_error
from taskguard.urls import mask_url, parse_url

__all__ = ["CheckResult", "check_database", "missing_database"]

log = logging.getLogger("taskguard")


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


def missing_database(url: str | URL) -> str | None:
    """The problem, if ``url``'s database cannot exist yet and connecting would create
    it (a SQLite path that does not exist: a typo then looks like a database with no
    locks); ``None`` otherwise, a bad URL included (reported where it is used)."""
    try:
        parsed = parse_url(url)
        return dialect_for(parsed.get_backend_name()).missing_database(parsed)
    except ConfigurationError:
        return None


def check_database(url_or_engine: str | URL | Engine, *, timeout: float = 5.0) -> CheckResult:
    """Check URL, connectivity, schema revision and privileges; never raises for a
    problem with the database (it is reported in the result)."""
    if isinstance(url_or_engine, Engine):
        engine, owned = url_or_engine, False
        result = CheckResult(mask_url(engine.url))
    else:
        result = CheckResult(mask_url(url_or_engine))
        missing = missing_database(url_or_engine)
        if missing:
            result.problems.append(missing)
            return result
        try:
            parsed = parse_url(url_or_engine)
            # Not a database taskguard knows, or a driver it does not support here.
            connect_args = dialect_for_url(parsed).connect_args(parsed)
            if "connect_timeout" in connect_args:
                connect_args["connect_timeout"] = max(1, round(timeout))
            engine = create_engine(parsed, connect_args=connect_args, poolclass=NullPool)
        except ConfigurationError as exc:
            result.problems.append(str(exc))
            return result
        except (sa_exc.ArgumentError, ImportError) as exc:
            result.problems.append(f"cannot use this database URL: {exc}")
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
        dialect = dialect_for(engine.dialect.name)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        dialect.check_server(engine.dialect)  # e.g. a MySQL server where MariaDB is needed
    except ConfigurationError as exc:
        result.problems.append(str(exc))
        return
    except sa_exc.DBAPIError as exc:
        kind = dialect.classify(exc, str(exc.orig))
        if kind in (ErrorKind.LOGIN, ErrorKind.NO_DATABASE):  # a server refused us: the URL
            result.problems.append(str(translate_error(exc, result.url, dialect, sent=False)))
            return
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
    with engine.connect() as conn:
        missing = dialect.missing_privileges(conn)
    if missing:
        result.problems.append(
            f"the role lacks {', '.join(missing)}: GRANT them (docs/reliability.md, "
            "'Least privilege')"
        )
