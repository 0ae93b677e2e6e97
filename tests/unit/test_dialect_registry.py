"""The dialect registry is the one place that knows database names (issue 27, item 2):
every backend name and driver a URL can use reaches its dialect, or is refused in
one line naming what is supported; nothing outside ``taskguard/dialects`` compares
backend names."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from taskguard.dialects import dialect_for, dialect_for_url
from taskguard.dialects.mariadb_server import refuse_server, server_info
from taskguard.exceptions import ConfigurationError
from taskguard.models import UTCDateTime
from taskguard.urls import parse_url

PACKAGE = Path(__file__).resolve().parents[2] / "taskguard"


@pytest.mark.parametrize(
    ("url", "label"),
    [
        ("mysql://app@db/app", "MariaDB"),
        ("mariadb://app@db/app", "MariaDB"),
        ("mysql+pymysql://app@db/app", "MariaDB"),
        ("mariadb+pymysql://app@db/app", "MariaDB"),
        ("postgres://app@db/app", "PostgreSQL"),
        ("postgresql://app@db/app", "PostgreSQL"),
        ("postgresql+psycopg://app@db/app", "PostgreSQL"),
        ("sqlite:////tmp/locks.sqlite", "SQLite"),
    ],
)
def test_every_documented_url_form_reaches_its_dialect(url: str, label: str) -> None:
    assert dialect_for_url(parse_url(url)).label == label


def test_mysql_and_mariadb_are_one_dialect() -> None:
    assert dialect_for("mysql") is dialect_for("mariadb")
    assert {"mysql", "mariadb", "sqlite"} <= set(UTCDateTime.naive_utc)
    assert "postgresql" not in UTCDateTime.naive_utc


@pytest.mark.parametrize(
    ("url", "named", "supported"),
    [
        ("mysql+mysqlconnector://app@db/app", "mysqlconnector", "mysql:// (mysqlclient"),
        ("mariadb+mariadbconnector://app@db/app", "mariadbconnector", "mysql+pymysql://"),
        ("postgresql+psycopg2://app@db/app", "psycopg2", "postgresql+psycopg://"),
        ("postgresql+asyncpg://app@db/app", "asyncpg", "postgresql+psycopg://"),
    ],
)
def test_an_unsupported_driver_is_refused_naming_the_supported_ones(
    url: str, named: str, supported: str
) -> None:
    with pytest.raises(ConfigurationError) as err:
        dialect_for_url(make_url(url))
    text = str(err.value)
    assert f"does not support the {named} driver" in text and supported in text, text
    assert "\n" not in text


@pytest.mark.parametrize("scheme", ["mysql", "mariadb"])
def test_a_missing_driver_offers_only_the_other_driver(
    scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41, defect 8e: without mysqlclient, "mysql:// URLs need mysqlclient ...; or
    use mysql:// (mysqlclient ...) or mysql+pymysql://": the scheme it had just refused."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "MySQLdb" else real(name, *a)
    )
    with pytest.raises(ConfigurationError) as err:
        dialect_for_url(parse_url(f"{scheme}://app@db/app"))
    text = str(err.value)
    assert text.startswith(f"{scheme}:// URLs need mysqlclient"), text
    assert text.endswith("; or use mysql+pymysql:// (PyMySQL: pip install PyMySQL)"), text


def test_an_unknown_database_lists_the_supported_ones() -> None:
    with pytest.raises(ConfigurationError, match="PostgreSQL, SQLite, MariaDB; not 'oracle'"):
        dialect_for_url(make_url("oracle://app@db/app"))


@pytest.mark.parametrize(
    ("info", "refused"),
    [
        ("10.11.19-MariaDB-0+deb12u1", None),
        ("5.5.5-10.11.19-MariaDB-0+deb12u1", None),  # PyMySQL's replication prefix
        ("11.4.2-MariaDB-log", None),
        ("10.5.23-MariaDB", "this server is MariaDB 10.5.23"),
        ("8.0.36", "this server is MySQL 8.0.36"),
        ("8.4.0-commercial", "this server is MySQL 8.4.0"),
    ],
)
def test_a_mysql_server_is_refused_in_one_line(info: str, refused: str | None) -> None:
    """What the MariaDB dialect checks on every new connection and in ``taskguard
    check``/migrations (no MySQL server to connect to here: the server's own
    version string is the input)."""
    if refused is None:
        refuse_server(*server_info(info))
        return
    with pytest.raises(ConfigurationError) as err:
        refuse_server(*server_info(info))
    text = str(err.value)
    assert refused in text and "needs MariaDB 10.6 or newer" in text and "\n" not in text


_NAMES = {"mysql", "mariadb", "postgresql", "postgres", "sqlite"}


def _compares_backend_names(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            consts = [n for n in ast.walk(node) if isinstance(n, ast.Constant)]
            if any(c.value in _NAMES for c in consts):
                lines.append(node.lineno)
    return lines


def test_nothing_outside_the_dialects_compares_backend_names() -> None:
    """models, startup_check and schema used to; contrib/django maps Django's ENGINE
    names, which are Django's, not backend names."""
    offenders = {
        str(path.relative_to(PACKAGE)): found
        for path in PACKAGE.rglob("*.py")
        if "dialects" not in path.parts and (found := _compares_backend_names(path))
    }
    assert offenders == {}


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ('connection failed: FATAL:  database "nope" does not exist', "NO_DATABASE"),
        # A role whose name contains "database" is a login problem, not a missing database.
        ('connection failed: FATAL:  role "database_app" does not exist', "LOGIN"),
        ('connection failed: FATAL:  password authentication failed for user "a"', "LOGIN"),
    ],
)
def test_postgresql_connect_refusals_are_told_apart(text: str, kind: str) -> None:
    from taskguard.dialects.base import ErrorKind

    assert dialect_for("postgresql").classify(Exception(text), text) is ErrorKind[kind]
