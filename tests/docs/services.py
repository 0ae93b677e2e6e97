"""The test services the docs and journey tests use, and throwaway databases on them.

The URLs are the ones tests/conftest.py reads (same environment variables, same
defaults); Redis databases are fixed per user of them so that no two workers
consuming Celery's default queue ``celery`` can meet:

     8  tests/journey/test_journey_djangofeeds.py
     9  tests/journey/test_journey_alembic.py
    10  tests/journey/test_journey_install.py
    12  docs/guide.md (broker and results; its coalesce example starts a worker)
    14  the docs' pages (broker), 15 (results)

(0 is the shared suite's, with a queue per test; 11 the benchmarks'; 13 the demo's.)
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

PG_URL = os.environ.get(
    "TASKGUARD_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MARIADB_URL = os.environ.get(
    "TASKGUARD_TEST_MARIADB_URL", "mysql+mysqldb://root@127.0.0.1:3306/test?charset=utf8mb4"
)
REDIS_URL = os.environ.get("TASKGUARD_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_db(number: int) -> str:
    """The test Redis server's database ``number``, emptied."""
    import redis

    url = REDIS_URL.rsplit("/", 1)[0] + f"/{number}"
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


def _pg_admin() -> psycopg.Connection[Any]:
    libpq = make_url(PG_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    return psycopg.connect(libpq, autocommit=True, connect_timeout=10)


def new_pg_database(prefix: str = "tgdoc") -> str:
    """An empty PostgreSQL database; its URL (``postgresql+psycopg://``)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with _pg_admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return make_url(PG_URL).set(database=name).render_as_string(hide_password=False)


def drop_pg_database(url: str) -> None:
    with _pg_admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')


def _maria_admin() -> Any:
    import MySQLdb

    u = make_url(MARIADB_URL)
    return MySQLdb.connect(
        host=u.host or "127.0.0.1",
        port=u.port or 3306,
        user=u.username or "root",
        password=u.password or "",
        autocommit=True,
        connect_timeout=10,
    )


def new_maria_database(prefix: str = "tgdoc") -> str:
    """An empty MariaDB database; its URL (``mysql+mysqldb://``)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = _maria_admin()
    try:
        admin.cursor().execute(f"CREATE DATABASE `{name}`")
    finally:
        admin.close()
    return make_url(MARIADB_URL).set(database=name).render_as_string(hide_password=False)


def drop_maria_database(url: str) -> None:
    admin = _maria_admin()
    try:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS `{make_url(url).database}`")
    finally:
        admin.close()
