"""The protected resource: a counter per key that only accepts fenced writes.

``UPDATE … SET counter = counter + 1, last_token = :token WHERE last_token < :token``
- a holder whose token is lower than one the resource has already seen (a paused
or expired holder coming back) is refused. It lives in the lock database so its
timestamps share the lock's clock, but in its own table and on its own connection.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Engine, create_engine, text

from scripts.chaoslib.history import us
from taskguard import Lease, LeaseLost, TaskGuard

_CREATE = {
    "postgresql": "CREATE TABLE IF NOT EXISTS chaos_resource (key text PRIMARY KEY, "
    "last_token bigint NOT NULL DEFAULT 0, counter bigint NOT NULL DEFAULT 0)",
    "sqlite": "CREATE TABLE IF NOT EXISTS chaos_resource (key TEXT PRIMARY KEY, "
    "last_token INTEGER NOT NULL DEFAULT 0, counter INTEGER NOT NULL DEFAULT 0)",
    # No UPDATE … RETURNING: the write stamps written_at, read back in its transaction.
    "mysql": "CREATE TABLE IF NOT EXISTS chaos_resource (`key` VARCHAR(255) PRIMARY KEY, "
    "last_token BIGINT NOT NULL DEFAULT 0, counter BIGINT NOT NULL DEFAULT 0, "
    "written_at DATETIME(6)) COLLATE utf8mb4_nopad_bin",
}
_NOW = {
    "postgresql": "statement_timestamp()",
    "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now')",
}
_MARIA_WRITE = (
    "UPDATE chaos_resource SET counter = counter + 1, last_token = :token, "
    "written_at = UTC_TIMESTAMP(6) WHERE `key` = :key AND last_token < :token"
)
_MARIA_READ = "SELECT counter, written_at FROM chaos_resource WHERE `key` = :key"


class Resource:
    """Fenced counters in table ``chaos_resource`` of the database at ``url``."""

    def __init__(self, url: str) -> None:
        # SQLite: wait for the writer; PostgreSQL: no named prepared statements, so the
        # resource works through a transaction pooler too; MariaDB: nothing to add.
        args: dict[str, Any] = {"prepare_threshold": None}
        if url.startswith("sqlite"):
            args = {"timeout": 30}
        elif url.startswith(("mysql", "mariadb")):
            args = {}
        self.engine: Engine = create_engine(
            url, isolation_level="AUTOCOMMIT", pool_size=1, connect_args=args
        )
        self.dialect = self.engine.dialect.name
        self.maria = self.dialect == "mysql"
        # Transactions for fenced writes (fence() joins the caller's transaction).
        self.tx_engine: Engine = create_engine(url, pool_size=1, connect_args=args)
        if not self.maria:
            self._write = text(
                "UPDATE chaos_resource SET counter = counter + 1, last_token = :token "
                "WHERE key = :key AND last_token < :token "
                f"RETURNING counter, {_NOW[self.dialect]}"
            )

    def fenced_write(
        self, guard: TaskGuard, lease: Lease, key: str
    ) -> tuple[bool, int | None, int | None]:
        """Read-modify-write (not an atomic increment) inside one transaction that
        first proves the lease with :meth:`TaskGuard.fence`. Only exclusion keeps
        it from losing updates. (accepted, counter written, database time in us)."""
        try:
            with self.tx_engine.begin() as conn:
                guard.fence(lease, conn)
                value = conn.execute(
                    text("SELECT counter FROM chaos_resource WHERE `key` = :key")
                    if self.maria
                    else text("SELECT counter FROM chaos_resource WHERE key = :key"),
                    {"key": key},
                ).scalar_one()
                values = {"key": key, "token": lease.token, "value": int(value) + 1}
                if self.maria:
                    conn.execute(
                        text(
                            "UPDATE chaos_resource SET counter = :value, last_token = :token, "
                            "written_at = UTC_TIMESTAMP(6) WHERE `key` = :key"
                        ),
                        values,
                    )
                    ts = conn.execute(text(_MARIA_READ), {"key": key}).one()[1]
                else:
                    ts = conn.execute(
                        text(
                            "UPDATE chaos_resource SET counter = :value, last_token = :token "
                            f"WHERE key = :key RETURNING {_NOW[self.dialect]}"
                        ),
                        values,
                    ).scalar_one()
        except LeaseLost:
            return False, None, None
        return True, int(value) + 1, us(_as_datetime(ts))

    def setup(self, keys: list[str]) -> None:
        with self.engine.connect() as conn:
            conn.execute(text(_CREATE[self.dialect]))
            insert = (
                "INSERT IGNORE INTO chaos_resource (`key`) VALUES (:key)"
                if self.maria
                else "INSERT INTO chaos_resource (key) VALUES (:key) ON CONFLICT DO NOTHING"
            )
            for key in keys:
                conn.execute(text(insert), {"key": key})

    def write(self, key: str, token: int) -> tuple[bool, int | None, int | None]:
        """Fenced increment: (accepted, counter written, database time in us)."""
        if self.maria:
            with self.tx_engine.begin() as conn:  # our UPDATE's row lock covers the read
                if conn.execute(text(_MARIA_WRITE), {"key": key, "token": token}).rowcount != 1:
                    return False, None, None
                row = conn.execute(text(_MARIA_READ), {"key": key}).first()
        else:
            with self.engine.connect() as conn:
                row = conn.execute(self._write, {"key": key, "token": token}).first()
        if row is None:
            return False, None, None
        return True, int(row[0]), us(_as_datetime(row[1]))

    def counters(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(text("SELECT * FROM chaos_resource")).all()
        return {str(r[0]): int(r[2]) for r in rows}

    def dispose(self) -> None:
        self.engine.dispose()
        self.tx_engine.dispose()


def _as_datetime(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(str(value)).replace(tzinfo=timezone.utc)
