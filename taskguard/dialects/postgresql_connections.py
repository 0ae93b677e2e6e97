"""PostgreSQL connections, direct or behind a pooler, as the dialect
(:mod:`taskguard.dialects.postgresql`) sets them up: whether a connection talks to
its server backend directly (only then are statements prepared under a name), the
release listener's own connection, waiting cooperatively in a green process, and
the one-time warnings about poolers. The statements are the dialect's."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import psycopg
import psycopg.waiting
from sqlalchemy import URL, Engine

from taskguard.deadline import watchdog
from taskguard.green import green_library
from taskguard.models import RELEASE_CHANNEL

__all__ = [
    "ReleaseListener",
    "backend_pid_is_real",
    "prepare_when_direct",
    "wait_cooperatively",
    "warn_once",
    "warn_pooled_once",
]

log = logging.getLogger("taskguard")

#: Longest sleep of a waiter whose listener broke (seconds), as when polling.
POLL = 0.5


def wait_cooperatively() -> None:
    """In a green process, make psycopg wait through the patched ``selectors``, as
    psycopg does by itself only under gevent (and only if it was imported after
    the patching): its C wait would stop every greenlet (renewals, the watchdog, the
    pool's other tasks) for each statement, and a waiter's LISTEN for its whole nap.
    Process-wide: any psycopg wait in C is wrong there. ``PSYCOPG_WAIT_FUNC`` wins."""
    library = green_library()
    c_wait = getattr(psycopg.waiting, "wait_c", None)
    if library and psycopg.waiting.wait is c_wait and "PSYCOPG_WAIT_FUNC" not in os.environ:
        psycopg.waiting.wait = psycopg.waiting.wait_selector
        log.info("%s: psycopg now waits through the event loop (wait_selector)", library)


class ReleaseListener:
    """A dedicated connection LISTENing for releases, taken out of the pool."""

    def __init__(self, engine: Engine) -> None:
        raw = engine.raw_connection()
        try:
            conn: Any = raw.driver_connection
            raw.detach()  # its LISTEN must never leak back into the pool
            conn.autocommit = True
            conn.execute(f"LISTEN {RELEASE_CHANNEL}")
            direct = backend_pid_is_real(conn)
        except BaseException:
            raw.close()
            raise
        self.pooled = not direct
        self._raw = raw
        self._conn = conn
        self._broken = False

    def wait(self, key: str, timeout: float) -> bool:
        """Whether ``key`` may have been released within ``timeout`` seconds: its
        release was heard, or (the connection broke) nothing can be heard, so the
        waiter tries again after a short sleep, as when polling."""
        end = time.monotonic() + timeout
        try:
            while not self._broken and (left := end - time.monotonic()) > 0:
                for note in self._conn.notifies(timeout=left, stop_after=1):
                    if note.payload == key:
                        return True
        except psycopg.Error as exc:
            # The waiter's next attempt reports the outage; until the wait ends it polls.
            log.warning("the release listener's connection broke (%s); polling instead", exc)
            self._broken = True
        if self._broken:
            time.sleep(min(max(end - time.monotonic(), 0.0), POLL))
        return self._broken

    def close(self) -> None:
        try:
            self._raw.close()
        except Exception:  # pragma: no cover - closing a broken connection
            log.debug("closing the release listener failed", exc_info=True)


#: psycopg's own default: prepare a statement on the server after 5 runs.
PREPARE_THRESHOLD = 5


def backend_pid_is_real(conn: Any) -> bool:
    """Whether ``conn`` talks to its server backend directly. A pooler that shares
    server connections between clients (PgBouncer in any mode, and any transaction
    pooler by construction: a client's server backend changes between transactions)
    must hand clients a made-up backend pid and cancel key to route cancel
    requests; a direct connection reports the backend's own pid."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return row is not None and int(row[0]) == conn.info.backend_pid


def prepare_when_direct(dbapi_conn: Any, _record: Any) -> None:
    # Named statements save the server a parse and plan per lock statement (measured:
    # 0-16% of a pair's time, docs/operations.md); only where nothing can hand the
    # name to another client. An explicit prepare_threshold in the engine options wins.
    if dbapi_conn.prepare_threshold is not None:
        return
    prev = dbapi_conn.autocommit
    dbapi_conn.autocommit = True
    try:
        # Part of opening the connection: ends by the caller's deadline like a statement.
        with watchdog.watch(int(dbapi_conn.pgconn.socket)):
            direct = backend_pid_is_real(dbapi_conn)
        if direct:
            dbapi_conn.prepare_threshold = PREPARE_THRESHOLD
    finally:
        dbapi_conn.autocommit = prev


_warned_pooled: set[str] = set()


def warn_once(url: URL, message: str) -> None:
    shown = url.render_as_string(hide_password=True)
    if (message, shown) not in _warned:
        _warned.add((message, shown))
        log.warning(message, shown)


_warned: set[tuple[str, str]] = set()


def warn_pooled_once(engine: Engine) -> None:
    url = engine.url.render_as_string(hide_password=True)
    if url not in _warned_pooled:
        _warned_pooled.add(url)
        log.warning(
            "wait= on %s: this URL goes through a connection pooler, where LISTEN cannot "
            "keep its connection; waiters poll instead (every 0.5 s at most). Set "
            "taskguard_listen_url (TaskGuard(listen_url=...)) to a direct or "
            "session-pooled URL of the same database to be woken by releases.",
            url,
        )
