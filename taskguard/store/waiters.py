"""Waiters' rows: announcing a waiter on a key's rows, withdrawing it, and the
connection that hears releases (where the dialect can notify)."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy import URL, Engine

from taskguard.dialects import LockSQL
from taskguard.dialects.base import Listener
from taskguard.store.connections import Executor, create_lock_engine

__all__ = ["WaitRow", "Waiters"]

log = logging.getLogger("taskguard")

#: A row as a waiter's announcement saw it: slot, owner, expires_at, next_owner, now.
WaitRow = tuple[int, str, datetime, str | None, datetime]


class Waiters:
    """The waiting side of one :class:`~taskguard.store.Store`."""

    def __init__(self, db: Executor, sql: LockSQL, listen_url: str | URL | None) -> None:
        self._db = db
        self._sql = sql
        self._listen_url = listen_url
        self._listen_engine: Engine | None = None

    def announce(
        self, key: str, slots: range, owner: str, since: Any, wait: float
    ) -> tuple[list[WaitRow], Any]:
        """Raise the key's rows' ``wanted_until`` and queue ``owner`` as next in line;
        returns the rows as seen, and the database time of the first announcement
        (pass it back as ``since`` to keep the place in line)."""
        dialect = self._db.dialect
        values = {
            "key": key,
            "first": slots.start,
            "n": slots.stop,
            "owner": owner,
            "since": since,
            "wait": dialect.seconds_param(wait),
        }
        raw, _ = self._db.run(self._sql.announce, values)
        conv = dialect.to_datetime
        rows: list[WaitRow] = [
            (int(slot), row_owner, conv(expires_at), next_owner, conv(now))
            for slot, row_owner, expires_at, next_owner, now in raw
        ]
        return rows, (raw[0][4] if raw and since is None else since)

    def withdraw(self, key: str, owner: str) -> None:
        self._db.run(self._sql.withdraw, {"key": key, "owner": owner})

    def listener(self) -> Listener | None:
        """A connection woken by releases, or ``None`` where waiters must poll.

        On ``listen_url`` when one is set (a direct or session-pooled URL of the same
        database); else on the lock URL, unless the dialect finds it behind a
        connection pooler, where a LISTEN cannot keep its server connection."""
        engine = self._db.engine
        if self._listen_url is not None:
            if self._listen_engine is None:
                self._listen_engine = create_lock_engine(self._listen_url, pool_size=1)
            engine = self._listen_engine
        try:
            return self._db.dialect.listener(engine, pooled_ok=self._listen_url is not None)
        except Exception as exc:
            log.warning("cannot listen for releases on %s (%s); polling instead", self._db.url, exc)
            return None

    def dispose(self) -> None:
        if self._listen_engine is not None:
            self._listen_engine.dispose()
