"""The one place driver errors become taskguard's exceptions. What a driver error
means is the dialect's call (:meth:`~taskguard.dialects.base.Dialect.classify`);
this module turns the verdict into an exception with an actionable message."""

from __future__ import annotations

from taskguard.dialects import Dialect, registered
from taskguard.dialects.base import ErrorKind
from taskguard.exceptions import (
    DatabaseError,
    DatabaseUnavailable,
    PermissionDenied,
    SchemaMissing,
    TaskGuardError,
)

__all__ = ["translate_error"]


def _classify(exc: BaseException, text: str, dialect: Dialect | None) -> ErrorKind | None:
    if dialect is not None:
        return dialect.classify(exc, text)
    # No engine yet (e.g. migrations on an unknown URL): the first dialect that
    # recognises the error decides.
    for candidate in registered():
        kind = candidate.classify(exc, text)
        if kind is not None:
            return kind
    return None


def translate_error(
    exc: BaseException, url: str, dialect: Dialect | None = None, *, sent: bool = True
) -> TaskGuardError:
    """Map a driver/SQLAlchemy exception to taskguard's hierarchy.

    ``url`` is already masked. ``sent=False`` says no statement reached the server
    (the connection could not be opened), so the caller knows the operation did
    not happen.
    """
    if isinstance(exc, TaskGuardError):
        return exc
    orig = getattr(exc, "orig", None) or exc
    text = str(orig)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    kind = _classify(exc, text, dialect)
    if kind is ErrorKind.SCHEMA_OLD:
        return SchemaMissing(
            f"taskguard's schema in {url} is older than this version of taskguard: run "
            f"`taskguard db upgrade --database-url ...` ({first})"
        )
    if kind is ErrorKind.SCHEMA_MISSING:
        return SchemaMissing(
            f"taskguard's tables are missing in {url}: run `taskguard db upgrade "
            f"--database-url ...` first ({first})"
        )
    if kind is ErrorKind.LOGIN:
        return PermissionDenied(
            f"lock database {url} refused the login ({first}): check the user name and "
            "password in the URL",
            url,
        )
    if kind is ErrorKind.NO_DATABASE:
        return DatabaseUnavailable(
            f"lock database {url} does not exist on its server ({first}): create it "
            "(CREATE DATABASE <name>), then run `taskguard db upgrade --database-url ...`",
            url,
            False,
        )
    if kind is ErrorKind.PERMISSION:
        return PermissionDenied(
            f"the database role lacks a privilege on taskguard's objects in {url}: {first} "
            "(see docs/reliability.md, 'Least privilege')",
            url,
        )
    if kind is ErrorKind.LOCKED:
        return DatabaseUnavailable(
            f"lock database {url} stayed locked by another write transaction ({first}), "
            "most often one still open on this same thread on the same database file (ORM "
            "writes or a fence not yet committed): commit or roll back that transaction "
            "before calling taskguard; nothing was changed",
            url,
            False,
        )
    if kind is None:
        refused = dialect.statement_errors if dialect is not None else ()
        kind = ErrorKind.STATEMENT if isinstance(orig, refused) else ErrorKind.OUTAGE
    if kind is ErrorKind.OUTAGE or not sent:
        return DatabaseUnavailable(f"lock database {url} unavailable: {first}", url, sent)
    return DatabaseError(f"lock statement refused by {url}: {first}", url)
