"""PgBouncer fixtures: a private pgbouncer process in front of the shared server.

Import the fixtures into a test module (``from pgbouncer_fixtures import ...``).
Each pgbouncer runs the Debian package's binary (``scripts/services.sh`` installs it;
CI calls that script) with its own config, auth file, pid file and socket dir in a
temp dir, on a free port; it is stopped at the end of the session. A missing binary
FAILS the test (the project rule: tests that need a server never skip in CI).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import PG_URL
from sqlalchemy.engine import make_url

from tests.harness.pgbouncer import PgBouncer

__all__ = ["pgb_session_url", "pgb_tx_url", "pgbouncer_session", "pgbouncer_tx"]

#: Small on purpose: more clients than server connections, as in production.
POOL_SIZE = 5


def _start(pool_mode: str, pool_size: int) -> PgBouncer:
    u = make_url(PG_URL)
    try:
        bouncer = PgBouncer(
            u.port or 5432,
            server_host=u.host or "127.0.0.1",
            pool_mode=pool_mode,
            default_pool_size=pool_size,
        )
        bouncer.start()
    except RuntimeError as exc:
        pytest.fail(f"cannot start a private pgbouncer: {exc}", pytrace=False)
    return bouncer


@pytest.fixture(scope="session")
def pgbouncer_tx() -> Iterator[PgBouncer]:
    """A private PgBouncer with ``pool_mode = transaction``, ``default_pool_size = 5``."""
    bouncer = _start("transaction", POOL_SIZE)
    yield bouncer
    bouncer.destroy()


@pytest.fixture(scope="session")
def pgbouncer_session() -> Iterator[PgBouncer]:
    """A private PgBouncer with ``pool_mode = session`` (LISTEN works through it)."""
    bouncer = _start("session", 20)
    yield bouncer
    bouncer.destroy()


@pytest.fixture
def pgb_tx_url(pg_url: str, pgbouncer_tx: PgBouncer) -> str:
    """A migrated test database (``pg_url``), reached through transaction pooling."""
    return pgbouncer_tx.via(pg_url)


@pytest.fixture
def pgb_session_url(pg_url: str, pgbouncer_session: PgBouncer) -> str:
    """A migrated test database (``pg_url``), reached through session pooling."""
    return pgbouncer_session.via(pg_url)
