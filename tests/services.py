"""The test services (their URLs from the environment, with local defaults), admin
connections to them, and throwaway databases: for the suite (tests/conftest.py),
the docs' blocks (tests/docs) and the journeys (tests/journey).

Redis databases are fixed per user of them so that no two workers consuming
Celery's default queue ``celery`` can meet:

     1  tests/journey/test_journey_migrations.py (a queue per case)
     8  tests/journey/test_journey_djangofeeds.py
     9  tests/journey/test_journey_alembic.py
    10  tests/journey/test_journey_install.py
    12  docs/options.md (broker and results; its coalesce example starts a worker)
     6  docs/getting-started.md, 7 docs/behaviour.md (no worker)
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
AMQP_URL = os.environ.get("TASKGUARD_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


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


def libpq(url: str, database: str | None = None) -> str:
    """``url`` (optionally on another ``database``) as a libpq connection string."""
    u = make_url(url)
    if database is not None:
        u = u.set(database=database)
    return u.set(drivername="postgresql").render_as_string(hide_password=False)


def pg_admin() -> psycopg.Connection[Any]:
    """An autocommit connection to the test PostgreSQL server."""
    return psycopg.connect(libpq(PG_URL), autocommit=True, connect_timeout=10)


def new_pg_database(prefix: str = "tgdoc", template: str | None = None) -> str:
    """A new PostgreSQL database (empty, or a clone of ``template``); its URL
    (``postgresql+psycopg://``)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with pg_admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return make_url(PG_URL).set(database=name).render_as_string(hide_password=False)


def drop_pg_database(url: str) -> None:
    with pg_admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)')


def maria_admin() -> Any:
    """An autocommit connection to the test MariaDB server (mysqlclient)."""
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
    admin = maria_admin()
    try:
        admin.cursor().execute(f"CREATE DATABASE `{name}`")
    finally:
        admin.close()
    return make_url(MARIADB_URL).set(database=name).render_as_string(hide_password=False)


def drop_maria_database(url: str) -> None:
    admin = maria_admin()
    try:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS `{make_url(url).database}`")
    finally:
        admin.close()
