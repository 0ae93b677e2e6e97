"""The test services (their URLs from the environment, with local defaults), admin
connections to them, and throwaway databases: for the suite (tests/conftest.py),
the docs' blocks (tests/docs) and the journeys (tests/journey).

Redis databases are fixed per user of them so that no two workers consuming
Celery's default queue ``celery`` can meet. The numbers below are offsets from the
database of ``TASKGUARD_TEST_REDIS_URL`` (0 by default): set it to ``…/16`` and
the suite uses databases 16 to 31 instead (the server needs that many). Those
marked so are not emptied; the others are, when a test or page starts:

     0  the shared suite (a queue per test), scripts/bench.py's test runs (not emptied)
     1  tests/journey/test_journey_migrations.py (a queue per case)
     2  tests/integration/django_tasks/test_celery_bridge.py (a queue per test; not emptied)
     3  scripts/bench.py's storm section under tests/integration/test_bench_quick.py
        (lock keys under a run's prefix; not emptied)
     4  tests/integration/dramatiq (Dramatiq's Redis broker, a queue per test)
     5  tests/integration/taskiq (a queue per test; broker and results)
     6  docs/getting-started.md, 7 docs/behaviour.md (no worker)
     8  tests/journey/test_journey_djangofeeds.py
     9  tests/journey/test_journey_alembic.py
    10  tests/journey/test_journey_install.py
    12  docs/options.md (broker and results; its coalesce example starts a worker)
    13  the demo's broker (tests/integration/test_demo.py; not emptied)
    14  the docs' pages (broker), 15 (results)

Outside the suite: 11 is the benchmarks' (``TASKGUARD_BENCH_REDIS_URL``);
scripts/peer_suites.py empties 9 (``PEER_SUITES_REDIS_URL``).

``PG_URL`` and ``MARIADB_URL`` name a database (``test``) that is created when
missing, the first time an admin connection is made.
"""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

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


_REDIS = urlsplit(REDIS_URL)
#: The database of TASKGUARD_TEST_REDIS_URL: every number in the table above is added to it.
REDIS_BASE = int(_REDIS.path.strip("/") or 0)


def redis_url(number: int) -> str:
    """The URL of the suite's Redis database ``number`` (an offset from REDIS_BASE)."""
    return urlunsplit(_REDIS._replace(path=f"/{REDIS_BASE + number}"))


def redis_db(number: int) -> str:
    """The suite's Redis database ``number`` (see redis_url), emptied."""
    import redis

    url = redis_url(number)
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
    """An autocommit connection to the test PostgreSQL server (PG_URL's database,
    created when missing)."""
    create_pg_database()
    return psycopg.connect(libpq(PG_URL), autocommit=True, connect_timeout=10)


@functools.cache
def create_pg_database() -> None:
    name = make_url(PG_URL).database
    with psycopg.connect(libpq(PG_URL, "postgres"), autocommit=True, connect_timeout=10) as admin:
        if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            return
        with contextlib.suppress(psycopg.errors.DuplicateDatabase):  # another process's
            admin.execute(f'CREATE DATABASE "{name}"')


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


@contextlib.contextmanager
def pg_database_and_private_redis(template: str) -> Iterator[tuple[str, str]]:
    """A new PostgreSQL database (a clone of ``template``) and a Redis server of its
    own, for a module's long-lived workers (no other test empties its queues); the
    URLs of both, gone after."""
    from tests.harness.servers import PrivateRedis

    db_url = new_pg_database("tg", template)
    try:
        with PrivateRedis() as redis:
            yield db_url, redis.url(0)
    finally:
        drop_pg_database(db_url)


def maria_admin(database: str | None = None) -> Any:
    """An autocommit connection (mysqlclient) to the test MariaDB server, on
    ``database`` if given (MARIADB_URL's database is created when missing)."""
    create_maria_database()
    conn = _maria_connect()
    if database is not None:
        conn.select_db(database)
    return conn


def _maria_connect() -> Any:
    import MySQLdb

    u = make_url(MARIADB_URL)
    return MySQLdb.connect(
        host=u.host or "127.0.0.1",
        port=u.port or 3306,
        user=u.username or "root",
        password=u.password or "",
        charset="utf8mb4",
        autocommit=True,
        connect_timeout=10,
    )


@functools.cache
def create_maria_database() -> None:
    conn = _maria_connect()
    try:
        conn.cursor().execute(f"CREATE DATABASE IF NOT EXISTS `{make_url(MARIADB_URL).database}`")
    finally:
        conn.close()


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
