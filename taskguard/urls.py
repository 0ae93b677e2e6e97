"""Database URLs: parsing user input into a SQLAlchemy URL, and masking secrets
for logs and errors. Imports nothing from the package but the exceptions."""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import URL, make_url
from sqlalchemy import exc as sa_exc

from taskguard.exceptions import ConfigurationError

__all__ = ["mask_text", "mask_url", "parse_url", "url_source"]

#: Query parameters that carry a secret (libpq and psycopg accept the password there too).
_SECRET_PARAMS = frozenset({"password", "passwd", "pass", "sslpassword", "sslkey_password"})


# In free text: scheme://user:SECRET@ and ?password=SECRET / &passwd=SECRET.
_USERINFO_SECRET = re.compile(
    r"(?P<head>[A-Za-z][\w+.-]*://[^\s/:@'\"]*:)(?P<secret>[^\s@'\"]+)(?=@)"
)
_QUERY_SECRET = re.compile(
    rf"(?P<head>://[^\s'\"]*[?&](?:{'|'.join(sorted(_SECRET_PARAMS))})=)(?P<secret>[^\s&#'\"]+)",
    re.IGNORECASE,
)

#: Driver-less PostgreSQL schemes; taskguard's PostgreSQL driver is psycopg 3.
_PG_SCHEMES = frozenset({"postgres", "postgresql"})


def mask_url(url: str | URL) -> str:
    """The URL with its password (in the userinfo or as a query parameter) replaced
    by ``***``: safe for logs and errors."""
    try:
        parsed = make_url(url)
        secret = {k: "***" for k in parsed.query if k.lower() in _SECRET_PARAMS}
        if secret:
            parsed = parsed.update_query_dict(secret)
        # The renderer percent-encodes query values; show the mask as in the userinfo.
        return parsed.render_as_string(hide_password=True).replace("=%2A%2A%2A", "=***")
    except Exception:
        return "<unparseable database URL>"


def mask_text(text: str, url: str | URL | None = None) -> str:
    """``text`` (a message, a driver's error) with the password of every URL in it
    masked as :func:`mask_url` does: the userinfo's password field and secret query
    parameters, nothing else. ``url`` (the URL the text is about) is replaced as a
    whole first, so a password the patterns cannot delimit (a raw ``@`` or space in
    it) is masked too. A secret masked already (kombu writes ``**``) stays as it is."""
    if url is not None and str(url) in text:
        text = text.replace(str(url), mask_url(url))

    def masked(m: re.Match[str]) -> str:
        return m[0] if set(m["secret"]) == {"*"} else f"{m['head']}***"

    return _USERINFO_SECRET.sub(masked, _QUERY_SECRET.sub(masked, text))


def parse_url(url: str | URL) -> URL:
    """``url`` as a SQLAlchemy :class:`~sqlalchemy.URL` (``postgres://`` and
    ``postgresql://`` mean ``postgresql+psycopg://``); a :class:`ConfigurationError`
    naming the masked URL if it cannot be parsed."""
    try:
        parsed = make_url(url)
    except (sa_exc.ArgumentError, ValueError) as exc:
        raise ConfigurationError(_unparseable(str(url), exc)) from None
    if parsed.drivername in _PG_SCHEMES:
        # As DATABASE_URL and Django settings write it. SQLAlchemy would look for a
        # `postgres` plugin, or default to psycopg2, which taskguard does not use.
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


#: What a database URL looks like, for the message refusing one.
EXPECTED_FORM = (
    "expected SCHEME://USER@HOST[:PORT]/DATABASE (USER:PASSWORD@ with a password), "
    "e.g. postgresql://app@db.example.com:5432/app or sqlite:///path/to/locks.db"
)
_SCHEME = re.compile(r"[A-Za-z][\w+.-]*")


def _unparseable(text: str, exc: Exception) -> str:
    """Why ``text`` is no URL: its scheme (the rest may hold a password, so it is not
    echoed) and the form expected."""
    scheme = _SCHEME.match(text)
    if scheme is None:
        seen = "no SCHEME:// at its start"
    elif not text[scheme.end() :].startswith("://"):
        seen = f"{scheme[0]!r} not followed by '://'"
    else:
        port = isinstance(exc, ValueError) and not isinstance(exc, sa_exc.ArgumentError)
        seen = f"scheme {scheme[0]!r}, {'a port that is no number' if port else 'the rest'}"
    return f"invalid database URL ({seen}): {EXPECTED_FORM}"


def url_source(value: Any) -> Any:
    """What ``TaskGuard(...)`` is given, as its engine needs it: a str, URL or Engine
    as it is; an object that renders itself as a URL, such as the Django app's
    ``DjangoDatabaseURL`` in ``app.conf.taskguard_database_url``, as its ``str()``
    (read once, now). Anything else is left for the engine to refuse."""
    renders: Any = type(value).__str__
    if isinstance(value, str | URL) or renders is object.__str__:
        return value
    return str(value)
