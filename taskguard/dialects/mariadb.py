"""MariaDB: taskguard's lock SQL, connection setup and error classification.

Everything MariaDB-specific lives here. Tested on MariaDB 10.11; the statements
need MariaDB 10.6+ (sequences 10.3, ``INSERT … RETURNING`` 10.5, ``JSON_TABLE``
10.6). MySQL servers are refused: they have neither sequences nor ``RETURNING``.

Why the statements look the way they do:

* **Clock**: ``UTC_TIMESTAMP(6)``, fixed for the duration of one statement, into
  ``DATETIME(6)`` columns (no session time zone involved).
* **Keys compare byte-exactly**: the tables use ``utf8mb4_nopad_bin`` (a ``_bin``
  collation with PAD SPACE would make ``'a'`` equal ``'a '``). A 255-character
  utf8mb4 key is at most 1,020 bytes, inside InnoDB's 3,072-byte index limit, so
  the primary key is ``(key, slot)`` exactly as on the other stores.
* **Acquire** is one ``INSERT … ON DUPLICATE KEY UPDATE … RETURNING``. Assignments
  run left to right and each sees the columns already assigned, so the takeover
  condition is evaluated once, in the first assignment, into ``@tg_take``; every
  later assignment reads that. ``RETURNING`` gives the row as it is after the
  statement: the grant is ours exactly when the returned owner is ours (the
  affected-row count cannot tell: SQLAlchemy sets CLIENT_FOUND_ROWS).
* **Tokens** come from the sequence ``task_locks_token_seq``. A takeover draws
  ``NEXT VALUE`` inside the update branch, i.e. while it holds the row lock, so it
  is above the token of the grant it replaces. The sequence is an InnoDB object:
  it survives row deletion (reaping) and restarts (after a restart it continues
  above its cache, never below).
* **Isolation**: lock connections run READ COMMITTED (no gap locks, so an insert of
  a new key never waits for a neighbour's statement) in autocommit.
* **No UPDATE … RETURNING**: renewals and waiter announcements read their rows
  back in a second statement on the same connection (:attr:`Statement.then`).
* **No LISTEN/NOTIFY**: waiters poll.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    URL,
    BigInteger,
    ColumnElement,
    DateTime,
    Engine,
    Executable,
    Table,
    bindparam,
    event,
    literal,
    literal_column,
    select,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect as SADialect
from sqlalchemy.sql import func
from sqlalchemy.sql.elements import BindParameter

from taskguard.dialects.base import (
    INFO_COLS,
    RESERVE_GRACE,
    Dialect,
    Driver,
    ErrorKind,
    Flavor,
    ReapStep,
    T,
)
from taskguard.dialects.mariadb_server import error_kind, refuse_server, server_info
from taskguard.green import green_library
from taskguard.urls import mask_url

__all__ = ["SESSION_SETUP", "MariaDB"]

log = logging.getLogger("taskguard")

#: Run once on every new lock connection.
SESSION_SETUP = (
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
    "SET SESSION time_zone = '+00:00'",
)

#: Seconds to wait for a connection (the drivers' default is the OS's, minutes).
CONNECT_TIMEOUT = 10
NOW = "UTC_TIMESTAMP(6)"
#: ttl and other durations are passed as whole microseconds.
PLUS_TTL = f"{NOW} + INTERVAL :ttl MICROSECOND"
GRACE_AGO = f"{NOW} - INTERVAL {round(RESERVE_GRACE * 1e6)} MICROSECOND"


def free_sql(row: str, owner: str) -> str:
    """The row's lease ended and it is not reserved for another waiter."""
    return (
        f"{row}.expires_at <= {NOW} AND ({row}.next_owner IS NULL"
        f" OR {row}.next_owner = {owner} OR {row}.next_owner = {row}.owner"
        f" OR {row}.next_until <= {NOW} OR {row}.expires_at <= {GRACE_AGO})"
    )


_COLS = (
    "`key`, slot, owner, token, acquired_at, expires_at, task_name, task_id, hostname, pid, "
    "phase, slots"
)
# @tg_take is computed by the first assignment (from the old row) and read by the rest.
_TAKEOVER = (
    f"owner = IF(@tg_take := ({free_sql('task_locks', 'VALUES(owner)')}), VALUES(owner), owner), "
    "token = IF(@tg_take, NEXT VALUE FOR task_locks_token_seq, token), "
    "acquired_at = IF(@tg_take, VALUES(acquired_at), acquired_at), "
    "expires_at = IF(@tg_take, VALUES(expires_at), expires_at), "
    "task_name = IF(@tg_take, VALUES(task_name), task_name), "
    "task_id = IF(@tg_take, VALUES(task_id), task_id), "
    "hostname = IF(@tg_take, VALUES(hostname), hostname), "
    "pid = IF(@tg_take, VALUES(pid), pid), "
    "phase = IF(@tg_take, VALUES(phase), phase), "
    "slots = IF(@tg_take, VALUES(slots), slots), "
    # The reserved waiter's grant uses its reservation up; another waiter's is kept.
    # next_owner goes last: the two before it read the old one.
    "next_since = IF(@tg_take AND next_owner = VALUES(owner), NULL, next_since), "
    "next_until = IF(@tg_take AND next_owner = VALUES(owner), NULL, next_until), "
    "next_owner = IF(@tg_take AND next_owner = VALUES(owner), NULL, next_owner)"
)

#: -> (owner, token, acquired_at, expires_at, then the rest of the row and the time
#: it was read): granted iff owner is ours; else it is the holder's row.
ACQUIRE = f"""
INSERT INTO task_locks ({_COLS})
VALUES (:key, :slot, :owner, NEXT VALUE FOR task_locks_token_seq, {NOW}, {PLUS_TTL},
        :task_name, :task_id, :hostname, :pid, :phase, :n)
ON DUPLICATE KEY UPDATE {_TAKEOVER}
RETURNING owner, token, acquired_at, expires_at, `key`, slot, task_name, task_id, hostname, pid,
          phase, slots, {NOW}
"""

#: Columns of ACQUIRE's rows: the lease's four, the rest of ``get``'s row, read_at.
_ACQUIRE_WIDTH = 4 + 2 + len(INFO_COLS) + 1

#: Concurrency limit: a random slot of 0..n-1 that has no row or a free one.
#: -> no row (all taken) or (slot, owner, token, acquired_at, expires_at): granted
#: iff owner is ours; another owner means a concurrent acquirer won that slot first.
ACQUIRE_SLOTS = f"""
INSERT INTO task_locks ({_COLS})
WITH RECURSIVE s(slot) AS (SELECT 0 UNION ALL SELECT slot + 1 FROM s WHERE slot + 1 < :n)
SELECT :key, s.slot, :owner, NEXT VALUE FOR task_locks_token_seq, {NOW}, {PLUS_TTL},
       :task_name, :task_id, :hostname, :pid, :phase, :n
FROM s
WHERE NOT EXISTS (
    SELECT 1 FROM task_locks AS t
    WHERE t.`key` = :key AND t.slot = s.slot AND NOT ({free_sql("t", ":owner")})
)
ORDER BY RAND() LIMIT 1
ON DUPLICATE KEY UPDATE {_TAKEOVER}
RETURNING slot, owner, token, acquired_at, expires_at
"""

_MINE = f"`key` = :key AND slot = :slot AND owner = :owner AND expires_at > {NOW}"
#: Affected rows (found rows under CLIENT_FOUND_ROWS: 1 iff the lease was ours and live).
RELEASE = f"UPDATE task_locks SET expires_at = {NOW} WHERE {_MINE}"
#: No UPDATE … RETURNING on MariaDB: renew, then read the lease back by owner.
RENEW = f"UPDATE task_locks SET expires_at = {PLUS_TTL} WHERE {_MINE}"

# Not re-checked for expiry: the UPDATE just found it live (a ttl of milliseconds may
# have run out since); a takeover in between changed the owner and finds nothing.
_LEASE = (
    "SELECT token, acquired_at, expires_at FROM task_locks"
    " WHERE `key` = :key AND slot = :slot AND owner = :owner"
)

#: Every lease of a key ends now: (slot, owner, token, task_name, task_id, hostname, pid).
#: No UPDATE … RETURNING here, so each live row is "re-inserted" onto itself and the
#: duplicate-key branch ends it; RETURNING then shows the row as it was ended (a
#: takeover in between ends, and reports, the new holder). LEAST: never extends.
FORCE_RELEASE = f"""
INSERT INTO task_locks (`key`, slot, owner, token, acquired_at, expires_at)
SELECT l.`key`, l.slot, l.owner, l.token, l.acquired_at, l.expires_at
FROM task_locks AS l WHERE l.`key` = :key AND l.expires_at > {NOW}
ON DUPLICATE KEY UPDATE expires_at = LEAST(task_locks.expires_at, {NOW})
RETURNING slot, owner, token, task_name, task_id, hostname, pid
"""

#: One reap batch: walks the primary key from the cursor (keyset pagination) and
#: deletes up to :batch_size rows whose lease ended more than -:grace ago, re-checked
#: by the DELETE itself. Under READ COMMITTED InnoDB locks only the rows it deletes
#: (it lets go of live rows as soon as they fail the WHERE) and takes no gap locks,
#: so acquires of other keys, new or not, never wait for a batch.
REAP = f"""
DELETE FROM task_locks
WHERE (`key` > :after_key OR (`key` = :after_key AND slot > :after_slot))
  AND expires_at <= {NOW} + INTERVAL :grace MICROSECOND
ORDER BY `key`, slot
LIMIT :batch_size
RETURNING `key`, slot, owner, token
"""
#: History of a reap batch, in a second statement: the deleted rows as one JSON array.
REAPED_EVENTS = f"""
INSERT INTO task_lock_events (at, `key`, slot, event, owner, token)
SELECT {NOW}, j.k, j.s, 'reaped', j.o, j.t
FROM JSON_TABLE(:rows, '$[*]' COLUMNS (
    k VARCHAR(255) PATH '$[0]', s SMALLINT PATH '$[1]',
    o VARCHAR(32) PATH '$[2]', t BIGINT PATH '$[3]'
)) AS j
"""
#: Oldest history first, a batch at a time (MariaDB refuses LIMIT inside IN (…)).
TRIM_EVENTS = (
    f"DELETE FROM task_lock_events WHERE at < {NOW} + INTERVAL :keep MICROSECOND"
    " ORDER BY at LIMIT :batch_size"
)

#: Fencing, inside the caller's transaction: a takeover needs the row's exclusive
#: lock, so it waits until that transaction ends.
FENCE = f"""
SELECT token FROM task_locks
WHERE `key` = :lease_key AND slot = :lease_slot AND owner = :lease_owner AND expires_at > {NOW}
LOCK IN SHARE MODE
"""
#: Renewals, then the lease read back (only run when the UPDATE matched our row).
RENEW_HOLD = (
    f"UPDATE task_locks SET expires_at = GREATEST({PLUS_TTL},"
    f" acquired_at + INTERVAL :hold MICROSECOND) WHERE {_MINE}"
)
#: Adoption under a new owner id (see the shared ``handover``); the read that
#: follows finds the lease by its new owner (``:owner``).
_HANDED = f"`key` = :key AND slot = :slot AND owner = :from_owner AND expires_at > {NOW}"
_NEW_HOLDER = (
    "owner = :owner, task_name = :task_name, task_id = :task_id, hostname = :hostname, pid = :pid,"
    " phase = COALESCE(:phase, phase)"
)
HANDOVER = f"UPDATE task_locks SET expires_at = {PLUS_TTL}, {_NEW_HOLDER} WHERE {_HANDED}"
HANDOVER_HOLD = (
    f"UPDATE task_locks SET expires_at = GREATEST({PLUS_TTL},"
    f" acquired_at + INTERVAL :hold MICROSECOND), {_NEW_HOLDER} WHERE {_HANDED}"
)
LEASE = _LEASE
#: Confirms a grant read back after a broken connection. It must really change the
#: row: InnoDB commits a no-op update without writing (or flushing) the redo log,
#: and only a flushed commit proves the grant before it is durable. One microsecond
#: more for the owner's own live lease is harmless.
CONFIRM = f"UPDATE task_locks SET expires_at = expires_at + INTERVAL 1 MICROSECOND WHERE {_MINE}"
_UNTIL = f"{NOW} + INTERVAL :wait MICROSECOND"
_SINCE = f"COALESCE(:since, {NOW})"
#: A waiter raises wanted_until on the key's rows and, if it has waited longest,
#: becomes next_owner. Whether it leads is decided once per row, in the first
#: assignment that needs it (later ones would see next_owner already changed).
ANNOUNCE = f"""
UPDATE task_locks SET
    wanted_until = GREATEST(COALESCE(wanted_until, {_UNTIL}), {_UNTIL}),
    next_owner = IF(@tg_lead := (next_owner IS NULL OR next_owner = :owner
                                 OR next_owner = owner OR next_until <= {NOW}
                                 OR next_since > {_SINCE}), :owner, next_owner),
    next_since = IF(@tg_lead, {_SINCE}, next_since),
    next_until = IF(@tg_lead, {_UNTIL}, next_until)
WHERE `key` = :key AND slot >= :first AND slot < :n AND expires_at > {GRACE_AGO}
"""
#: The key's rows a waiter's announcement touched, as PostgreSQL's RETURNING gives them.
ANNOUNCED = f"""
SELECT slot, owner, expires_at, next_owner, {NOW} FROM task_locks
WHERE `key` = :key AND slot >= :first AND slot < :n AND expires_at > {GRACE_AGO}
ORDER BY slot
"""


def _now() -> ColumnElement[Any]:
    return func.utc_timestamp(literal_column("6"), type_=DateTime())


def _plus(now: ColumnElement[Any], name: str) -> ColumnElement[Any]:
    return func.timestampadd(
        literal_column("MICROSECOND"), bindparam(name, type_=BigInteger), now, type_=DateTime()
    )


class MariaDB(Dialect):
    """MariaDB 10.6+ through mysqlclient (``mysql://``, ``mariadb://``) or PyMySQL."""

    name = "mysql"
    label = "MariaDB"
    aliases = ("mariadb",)
    drivers = {
        "mysqldb": Driver("MySQLdb", "mysql", "mysqlclient: pip install 'taskguard-sql[mysql]'"),
        "pymysql": Driver("pymysql", "mysql+pymysql", "PyMySQL: pip install PyMySQL"),
    }
    naive_timestamps = True
    pins_connections = True

    def flavor(self) -> Flavor:
        return Flavor(
            now=_now(),
            now_sql=NOW,
            plus=lambda p: _plus(_now(), p),
            plus_sql=lambda p: f"{NOW} + INTERVAL :{p} MICROSECOND",
            add=_plus,
            since=lambda col: (
                func.timestampdiff(literal_column("MICROSECOND"), col, _now()) / literal(1e6)
            ),
            greatest=func.greatest,
            grace_ago=literal_column(GRACE_AGO, DateTime()),
            grace_ago_sql=GRACE_AGO,
            ts_bind=lambda n: bindparam(n, type_=DateTime()),
        )

    def insert(self, table: Table) -> Any:
        raise NotImplementedError("MariaDB's acquire is its own statement (own_statements)")

    def own_statements(self, fl: Flavor) -> dict[str, Any]:
        t = T
        now = fl.now
        prefix: BindParameter[str] = bindparam("prefix")
        # CHAR_LENGTH: LENGTH counts bytes here.
        prefix_match = func.substring(t.c.key, 1, func.char_length(prefix)) == prefix
        row_and_now = (
            t.c.key,
            t.c.slot,
            t.c.owner,
            t.c.token,
            t.c.acquired_at,
            t.c.expires_at,
            *(t.c[c] for c in INFO_COLS),
            now.label("read_at"),
        )
        by_key = (t.c.key, t.c.slot)
        limit: BindParameter[int] = bindparam("limit")
        return {
            "acquire": text(ACQUIRE),
            "acquire_slots": text(ACQUIRE_SLOTS),
            "renew": (text(RENEW), text(LEASE)),
            "renew_hold": (text(RENEW_HOLD), text(LEASE)),
            "handover": (text(HANDOVER), text(LEASE)),
            "handover_hold": (text(HANDOVER_HOLD), text(LEASE)),
            "confirm": (text(CONFIRM), text(LEASE)),
            "held": select(*row_and_now)
            .where(prefix_match, t.c.expires_at > now)
            .order_by(*by_key)
            .limit(limit),
            "held_all": select(*row_and_now).where(prefix_match).order_by(*by_key).limit(limit),
            "force_release": text(FORCE_RELEASE),
            "announce": (text(ANNOUNCE), text(ANNOUNCED)),
            "trim_events": text(TRIM_EVENTS),
        }

    def granted(
        self, rows: list[tuple[Any, ...]], owner: str, slots: bool
    ) -> list[tuple[Any, ...]]:
        # RETURNING shows the row after the statement, whoever holds it: ours iff the
        # owner is ours. A slot someone else won first reads as a lost race (NULL token).
        if slots:
            return [(r[0], r[2] if r[1] == owner else None, *r[3:]) for r in rows]
        return [tuple(r[1:4]) for r in rows if r[0] == owner]

    def holders(self, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        # The single acquire's row in ``get``'s shape (the holder's, when refused).
        return [(r[4], r[5], *r[:4], *r[6:]) for r in rows if len(r) == _ACQUIRE_WIDTH]

    def reap_sql(self, history: bool) -> str:
        return REAP

    def reaped_events_sql(self) -> str:
        return REAPED_EVENTS

    def fence_statement(self) -> Executable:
        return text(FENCE)

    def to_datetime(self, value: Any) -> datetime:
        assert isinstance(value, datetime)
        return value.replace(tzinfo=timezone.utc)

    def seconds_param(self, seconds: float) -> int:
        return round(seconds * 1_000_000)

    def ts_param(self, value: datetime) -> datetime:
        return value.astimezone(timezone.utc).replace(tzinfo=None)

    def timestamp_type(self) -> Any:
        return mysql.DATETIME(fsp=6)  # plain DATETIME drops the fractional seconds

    def check_server(self, sa_dialect: SADialect) -> None:
        version = tuple(getattr(sa_dialect, "server_version_info", None) or ())
        refuse_server(bool(getattr(sa_dialect, "is_mariadb", False)), version)

    def engine_options(self, url: URL, options: dict[str, Any]) -> None:
        options["connect_args"] = {**self.connect_args(url), **options.get("connect_args", {})}

    def connect_args(self, url: URL) -> dict[str, Any]:
        """Driver options for any engine taskguard creates (locks, migrations, checks):
        utf8mb4 (keys are utf8mb4 text; a 3-byte charset would mangle emoji) unless the
        URL names a charset, and a bounded wait for a server that does not answer."""
        args: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT}
        if "charset" not in url.query:
            args["charset"] = "utf8mb4"
        return args

    def socket_of(self, dbapi_conn: Any) -> int | None:
        try:
            if hasattr(dbapi_conn, "fileno"):  # mysqlclient
                return int(dbapi_conn.fileno())
            return int(dbapi_conn._sock.fileno())  # PyMySQL
        except Exception:  # closed or broken: nothing to watch
            return None

    def configure_engine(self, engine: Engine, url: URL, *, durable: bool) -> None:
        library = green_library()
        if library and engine.dialect.driver == "mysqldb":
            log.warning(
                "%s: mysqlclient blocks the %s event loop for each statement, and no time "
                "limit can cut a hung one; use a mysql+pymysql:// URL in this process",
                mask_url(engine.url), library,
            )  # fmt: skip

        @event.listens_for(engine, "connect")
        def _session(dbapi_conn: Any, _record: Any) -> None:
            refuse_server(*server_info(str(dbapi_conn.get_server_info())))  # not MySQL
            cur = dbapi_conn.cursor()
            try:
                with self.setting_up(dbapi_conn):
                    for stmt in SESSION_SETUP:
                        cur.execute(stmt)
            finally:
                cur.close()

    def classify(self, exc: BaseException, text: str) -> ErrorKind | None:
        args = getattr(getattr(exc, "orig", None) or exc, "args", ())
        return error_kind(args[0]) if args and isinstance(args[0], int) else None

    def reap_start(self) -> dict[str, Any]:
        return {"after_key": "", "after_slot": -1}

    def reap_step(self, rows: list[tuple[Any, ...]], after: dict[str, Any]) -> ReapStep:
        rows = [tuple(r) for r in rows]
        if rows:
            last_key, last_slot = max((r[0], r[1]) for r in rows)
            after = {"after_key": str(last_key), "after_slot": int(last_slot)}
        return ReapStep(len(rows), len(rows), after, rows)
