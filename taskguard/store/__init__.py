"""The storage layer: the only code that runs taskguard's SQL or decodes its rows.

:class:`Store` executes the dialect's compiled statements on the guard's own
connections (:mod:`taskguard.store.connections`), converts values both ways
(durations and timestamps as the dialect binds and returns them), reads back the
outcome of a statement whose connection broke, walks the reaper's batches and
records lock history. Driver errors become taskguard's exceptions in one place,
:mod:`taskguard.store.errors`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Literal, NamedTuple

from sqlalchemy import URL, Engine

from taskguard.deadline import DEFAULT_CALL_TIMEOUT, bounded, call_limit
from taskguard.dialects import Dialect, Statement, lock_sql_for
from taskguard.exceptions import DatabaseUnavailable, OutcomeUnknown
from taskguard.lease import Holder, Lease, LockInfo, Marker
from taskguard.store import infos, reaping
from taskguard.store.connections import Executor
from taskguard.store.events import EventLog, Recorder, Unrecorded
from taskguard.store.waiters import Waiters, WaitRow
from taskguard.validation import new_owner

__all__ = ["EventLog", "Recorder", "Store", "Unrecorded", "WaitRow", "Waiters"]

log = logging.getLogger("taskguard")

#: ``renewed``; ``lost`` (the statement found the lease gone); ``gone`` (a read-back
#: after a broken connection found it no longer ours).
RenewOutcome = Literal["renewed", "lost", "gone"]
#: Keys remembered as contended (a lean acquire of theirs was refused), whose
#: attempts send the full acquire at once; all are forgotten beyond this many.
CONTENDED_KEYS = 1024
#: The parameters of a grant, in :meth:`Store.grant_values`' order.
_GRANT = (
    "unless", "key", "slot", "n", "phase", "owner", "ttl", "task_name", "task_id", "hostname", "pid"
)  # fmt: skip
#: The marker's parameters of :attr:`LockSQL.release_marking`.
_MARK = ("mark_key", "mark_owner", "mark_ttl", "task_name", "task_id", "hostname", "pid")


class _Acquire(NamedTuple):
    """One full acquire: its statement and parameters, how many slots it may take,
    and what its lease records (``seconds``, ``hold``, ``sent``: see :class:`Lease`)."""

    stmt: Statement
    values: dict[str, Any]
    limit: int
    seconds: float
    hold: float
    sent: float


class Store:
    """One database's lock rows, for one :class:`~taskguard.TaskGuard`.

    ``url_or_engine``: a URL (the store creates and owns a small autocommit
    engine) or a caller's :class:`~sqlalchemy.Engine` (borrowed one statement at a
    time, never joining a transaction).
    """

    def __init__(
        self,
        url_or_engine: str | URL | Engine,
        *,
        durable: bool = True,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        listen_url: str | URL | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self._db = Executor(url_or_engine, durable=durable, **engine_kwargs)
        #: Seconds one lease operation (with its read-back) may take, client-side.
        self.call_timeout = call_timeout
        self.engine: Engine = self._db.engine
        self.url: str = self._db.url
        self.dialect: Dialect = self._db.dialect
        self._sql = lock_sql_for(self.engine.dialect)
        self._conv = self.dialect.to_datetime
        self._secs = self.dialect.seconds_param
        #: Lock history (``task_lock_events``) in the same database.
        self.history = EventLog(self._db, self._sql, self.dialect)
        #: Waiters' announcements and release notifications.
        self.waiters = Waiters(self._db, self._sql, listen_url)
        #: Keys a lean acquire was refused on (see :meth:`_grant`).
        self._contended: set[str] = set()
        #: The lean acquire, without and with ``unless`` (None: the dialect has none).
        self._lean = (self._sql.acquire_lean, self._sql.acquire_unless_lean)
        #: Executes one statement in its own transaction: (rows, affected count).
        self.run = self._db.run

    def dispose(self) -> None:
        self._db.dispose()
        self.waiters.dispose()

    # -- grants --------------------------------------------------------------------

    def grant_values(
        self,
        key: str,
        slot: int,
        owner: str,
        seconds: float,
        holder: Holder,
        n: int = 1,
        unless: str | None = None,
        phase: str | None = None,
    ) -> dict[str, Any]:
        """The parameters of one grant attempt (kept across retries of it); refused
        while the key ``unless`` is held. The row records ``n`` (the key's limit) and
        ``phase`` (a :class:`~taskguard.options.Phase`, stored as its value)."""
        ttl, phase = self._secs(seconds), phase and str(phase)
        return dict(zip(_GRANT, (unless, key, slot, n, phase, owner, ttl, *holder), strict=True))

    @bounded
    def grant(
        self, values: dict[str, Any], limit: int, seconds: float, hold: float
    ) -> Lease | None:
        """One grant attempt (two statements at most); ``None`` if the key is held.

        If the connection broke after the statement was sent, the grant may have
        committed: the outcome is read back by owner (unique to this attempt), never
        assumed; if even that fails, :class:`~taskguard.OutcomeUnknown`.
        """
        return self._grant(values, limit, seconds, hold, time.monotonic())[0]

    def grant_seeing(
        self, values: dict[str, Any], seconds: float, hold: float = 0.0
    ) -> tuple[Lease | None, LockInfo | None]:
        """:meth:`grant` of one slot and, when refused, the live holder of the key (of
        ``unless`` if the key is free) where the attempt read it anyway: by the acquire
        statement itself, or by the check of ``unless``; else ``None`` (read it)."""
        sent = time.monotonic()  # the lease's local clock starts here (Lease.confirmed_at)
        return self._grant(values, 1, seconds, hold, sent, sent + self.call_timeout)

    def _grant(
        self,
        values: dict[str, Any],
        limit: int,
        ttl: float,
        hold: float,
        sent: float,
        deadline: float | None = None,
    ) -> tuple[Lease | None, LockInfo | None]:
        """Every grant attempt. The lean acquire first where it applies (one slot, a
        key not known as contended): it grants nothing wherever the full one might
        decide otherwise (a waiter, a refusal). Then the full one decides and reads the
        holder, and the key's next attempts go to it at once. ``deadline``: the call's
        (else the context's: :func:`~taskguard.deadline.bounded`)."""
        key, owner, slot, failed = values["key"], values["owner"], values["slot"], None
        lean = self._lean[values["unless"] is not None] if limit == 1 else None
        if lean is not None and key not in self._contended:
            try:
                rows = self.run(lean, values, deadline)[0]
            except (OutcomeUnknown, DatabaseUnavailable) as exc:
                rows, failed = [], exc
            if rows:
                (token, at, until), conv = rows[0], self._conv
                lease = Lease(key, owner, int(token), conv(at), conv(until), ttl, slot, hold, sent)
                return lease, None
            if failed is None:
                if len(self._contended) >= CONTENDED_KEYS:
                    self._contended.clear()  # forgotten: the lean one goes first again
                self._contended.add(key)
        with call_limit(deadline - time.monotonic()) if deadline else contextlib.nullcontext():
            full = _Acquire(self._full(values, limit), values, limit, ttl, hold, sent)
            return self._failed_grant(failed, full) if failed else self._full_grant(full)

    def _full(self, values: dict[str, Any], limit: int) -> Statement:
        sql = self._sql
        if limit > 1:
            return sql.acquire_slots
        return (
            sql.acquire_unless
            if values.get("unless") is not None and sql.acquire_unless is not None
            else sql.acquire
        )

    def _full_grant(self, full: _Acquire) -> tuple[Lease | None, LockInfo | None]:
        """The full acquire (the lean one was tried, or does not apply)."""
        values, limit = full.values, full.limit
        key, unless = values["key"], values.get("unless")
        unread = limit > 1 or self._sql.acquire_unless is None  # unless= not in the statement
        if unless is not None and unread and (marker := self.live_holder(unless)) is not None:
            return None, (self.live_holder(key) or marker) if limit == 1 else None
        try:
            rows, _ = self.run(full.stmt, values)
        except (OutcomeUnknown, DatabaseUnavailable) as exc:
            return self._failed_grant(exc, full)
        return self._granted(rows, full)

    def _failed_grant(
        self, exc: OutcomeUnknown | DatabaseUnavailable, full: _Acquire
    ) -> tuple[Lease | None, LockInfo | None]:
        """After a broken connection: the grant read back, else the full acquire again."""
        if isinstance(exc, OutcomeUnknown) or not exc.statement_sent:
            raise exc  # nothing reached the server: certainly not granted
        values = full.values
        recovered = self._recover(values, None if full.limit > 1 else values["slot"], exc)
        if recovered is not None:
            recovered.ttl, recovered.min_hold = full.seconds, full.hold
            recovered.confirmed_at = full.sent
            return recovered, None
        try:
            rows, _ = self.run(full.stmt, values)
        except DatabaseUnavailable as again:
            if not again.statement_sent:
                raise
            key, owner = values["key"], values["owner"]
            raise self._unknown(
                f"again while retrying the acquire of {key!r}", key, owner
            ) from again
        return self._granted(rows, full)

    def _granted(
        self, rows: list[tuple[Any, ...]], full: _Acquire
    ) -> tuple[Lease | None, LockInfo | None]:
        """The full acquire's rows: the lease, or the holder it read."""
        stmt, values, limit = full.stmt, full.values, full.limit
        seen = self.dialect.holders(rows) if limit == 1 else []
        rows = self.dialect.granted(rows, values["owner"], limit > 1)
        if limit > 1:
            if rows and rows[0][1] is None:
                # Lost the race for a new slot to a concurrent acquirer: one more try
                # (that slot now exists; the retry takes another or finds all taken).
                rows = self.dialect.granted(self.run(stmt, values)[0], values["owner"], True)
            if not rows or rows[0][1] is None:
                return None, None
            slot, token, acquired_at, expires_at = rows[0]
        elif rows:
            slot = values["slot"]
            token, acquired_at, expires_at = rows[0]
        else:
            read = infos.decode(seen, self._conv)
            return None, infos.live(read, values["key"]) or infos.live(read, values.get("unless"))
        conv = self._conv
        return Lease(
            values["key"],
            values["owner"],
            int(token),
            conv(acquired_at),
            conv(expires_at),
            full.seconds,
            int(slot),
            full.hold,
            full.sent,
        ), None

    def _recover(
        self, values: dict[str, Any], slot: int | None, cause: DatabaseUnavailable
    ) -> Lease | None:
        key, owner = values["key"], values["owner"]
        try:
            if slot is None:
                info = next((r for r in self.rows(key) if r.owner == owner), None)
            else:
                info = self.read_owner(key, slot, owner)
        except DatabaseUnavailable:
            broke = f"while acquiring {key!r} and the outcome could not be read back"
            raise self._unknown(broke, key, owner) from cause
        if info is not None and info.held:
            # Seen is not durable: the grant may be committed on this server only (its
            # wait for a synchronous standby cut short). A no-op write by the owner
            # commits only once everything before it is durable and replicated.
            try:
                rows, _ = self.run(
                    self._sql.confirm, {"key": key, "slot": info.slot, "owner": owner}
                )
            except DatabaseUnavailable:
                broke = f"while confirming the acquire of {key!r}"
                raise self._unknown(broke, key, owner) from cause
            if rows:
                token, acquired_at, expires_at = rows[0]
                log.warning("acquire of %r committed before the connection broke; keeping it", key)
                conv = self._conv
                return Lease(
                    key, owner, int(token), conv(acquired_at), conv(expires_at), 0.0, info.slot
                )
        log.warning("acquire of %r did not take effect before the connection broke; retrying", key)
        return None

    def release(self, lease: Lease, marker: Marker | None = None) -> tuple[bool, bool]:
        """End ``lease`` if its owner still holds it: ``(ended, by_statement)``;
        ``by_statement`` is False when the outcome came from a read-back. ``marker``
        is taken whether or not the lease was still ours: in the same statement
        where the dialect can, else by a second one."""
        deadline = time.monotonic() + self.call_timeout
        values: dict[str, Any] = {"key": lease.key, "slot": lease.slot, "owner": lease.owner}
        stmt, marking = self._sql.release, self._sql.release_marking
        if marker is not None and marking is not None and not lease.min_hold:
            stmt, mark = marking, (marker.key, new_owner(), self._secs(marker.ttl), *marker.holder)
            values.update(zip(_MARK, mark, strict=True))
        else:
            if lease.min_hold:
                stmt, values["hold"] = self._sql.release_hold, self._secs(lease.min_hold)
            if marker is not None:
                # Before the release: the key is never free while the record is missing.
                self._take_marker(marker, deadline)
        try:
            return self.run(stmt, values, deadline)[1] == 1, True
        except DatabaseUnavailable as exc:
            if not exc.statement_sent:
                raise
            with call_limit(deadline - time.monotonic()):
                return self._failed_release(exc, lease, marker, stmt, values)

    def _failed_release(
        self,
        exc: DatabaseUnavailable,
        lease: Lease,
        marker: Marker | None,
        stmt: Statement,
        values: dict[str, Any],
    ) -> tuple[bool, bool]:
        """After a broken connection: the outcome read back, else the release again."""
        if stmt is self._sql.release_marking and marker is not None:
            self._take_marker(marker)  # committed or not: taking it again is harmless
        info = self._reread_or_unknown(lease, "releasing", exc)
        if info is None or info.owner != lease.owner:
            return False, False
        if not info.held:
            # Still our row but ended before its expiry: our release committed and
            # only the reply was lost. Ended at or after it: it had expired.
            return info.expires_at < lease.expires_at, False
        return self.run(stmt, values)[1] == 1, True

    def _take_marker(self, marker: Marker, deadline: float | None = None) -> None:
        values = self.grant_values(marker.key, 0, new_owner(), marker.ttl, marker.holder)
        with call_limit(deadline - time.monotonic()) if deadline else contextlib.nullcontext():
            self.grant(values, 1, marker.ttl, 0.0)

    @bounded
    def renew(self, lease: Lease, seconds: float) -> RenewOutcome:
        """Extend ``lease`` to ``seconds`` from now (database clock); on success
        ``lease.expires_at`` and ``lease.ttl`` are updated."""
        values = {"key": lease.key, "slot": lease.slot, "owner": lease.owner}
        sent = time.monotonic()
        rows = self._extend(values, seconds, lease.min_hold, lease)
        if rows is None:
            return "gone"
        if not rows:
            return "lost"
        lease.expires_at = self._conv(rows[0][2])
        lease.ttl = seconds
        lease.confirmed_at = sent
        return "renewed"

    @bounded
    def adopt(
        self,
        key: str,
        owner: str,
        slot: int,
        seconds: float,
        hold: float,
        new: tuple[str, Holder] | None = None,
        phase: str | None = None,
    ) -> Lease | None:
        """Renew a live lease known only by its owner id; ``None`` if not held.
        ``new``: the (owner id, holder) it passes to, in the same statement, and with
        it the row's ``phase`` (``None``: kept)."""
        values: dict[str, Any] = {"key": key, "slot": slot, "owner": owner}
        if new is not None:
            owner, h = new
            values.update(zip(h._fields, h, strict=True), from_owner=values["owner"])
            values.update(owner=owner, phase=phase and str(phase))
        sent = time.monotonic()
        rows = self._extend(values, seconds, hold, None, handover=new is not None)
        if not rows:
            return None
        token, acquired_at, expires_at = rows[0]
        conv = self._conv
        return Lease(
            key, owner, int(token), conv(acquired_at), conv(expires_at), seconds, slot, hold, sent
        )

    def _extend(
        self,
        values: dict[str, Any],
        seconds: float,
        hold: float,
        lease: Lease | None,
        handover: bool = False,
    ) -> list[tuple[Any, ...]] | None:
        values["ttl"] = self._secs(seconds)
        stmt = self._sql.handover if handover else self._sql.renew
        if hold:
            stmt = self._sql.handover_hold if handover else self._sql.renew_hold
            values["hold"] = self._secs(hold)
        try:
            rows, _ = self.run(stmt, values)
        except DatabaseUnavailable as exc:
            if not exc.statement_sent or (lease is None and not handover):
                raise
            if handover:  # committed iff the row is under the new owner id
                info = self._reread_or_unknown(values, "adopting", exc)
                if info is not None:
                    return [(info.token, info.acquired_at, info.expires_at)] if info.held else None
            else:
                assert lease is not None
                info = self._reread_or_unknown(lease, "renewing", exc)
                if info is None or info.owner != lease.owner or not info.held:
                    return None
            rows, _ = self.run(stmt, values)
        return rows

    def _reread_or_unknown(
        self, lease: Lease | Mapping[str, Any], doing: str, cause: DatabaseUnavailable
    ) -> LockInfo | None:
        """The row of ``lease`` (or of key, slot, owner) read back, or OutcomeUnknown."""
        if isinstance(lease, Lease):
            key, slot, owner, by = lease.key, lease.slot, lease.owner, lease.expires_at
        else:
            key, slot, owner, by = lease["key"], lease["slot"], lease["owner"], None
        try:
            return self.read_owner(key, slot, owner)
        except DatabaseUnavailable:
            latest = f" (lease expires by {by.isoformat()} at the latest)" if by else ""
            raise self._unknown(
                f"while {doing} {key!r}", key, owner, f"outcome unknown{latest}"
            ) from cause

    def _unknown(self, broke: str, key: str, owner: str, then: str = "") -> OutcomeUnknown:
        """The error of a lock statement whose outcome could not be read back."""
        then = then or f"owner {owner} may hold it until its ttl ends"
        return OutcomeUnknown(
            f"connection to {self.url} broke {broke}; {then}", key, owner, self.url
        )

    # -- reading rows ----------------------------------------------------------------

    def _infos(self, stmt: Statement, values: Mapping[str, Any]) -> list[LockInfo]:
        return infos.decode(self.run(stmt, values)[0], self._conv)

    def rows(self, key: str) -> list[LockInfo]:
        """Every slot row of ``key``, live or not."""
        return self._infos(self._sql.get, {"key": key})

    def read_owner(self, key: str, slot: int, owner: str) -> LockInfo | None:
        found = self._infos(self._sql.get_owner, {"key": key, "slot": slot, "owner": owner})
        return found[0] if found else None

    def live_holder(self, key: str) -> LockInfo | None:
        """The live holder whose lease ends first (under a limit there may be several)."""
        return infos.live(self.rows(key), key)

    def held(self, prefix: str, *, include_expired: bool, limit: int) -> list[LockInfo]:
        stmt = self._sql.held_all if include_expired else self._sql.held
        return self._infos(stmt, {"prefix": prefix, "limit": limit})

    def force_release(self, key: str) -> list[tuple[int, str, int, Holder]]:
        """End every live lease on ``key``: (slot, owner, token, holder) of each."""
        rows, _ = self.run(self._sql.force_release, {"key": key})
        return [(int(r[0]), r[1], int(r[2]), Holder(*r[3:])) for r in rows]

    def waited_for(self) -> int:
        rows, _ = self.run(self._sql.waited_for, {})
        return int(rows[0][0])

    def db_now(self) -> datetime:
        rows, _ = self.run(self._sql.db_now, {})
        return self._conv(rows[0][0])

    # -- reaping -------------------------------------------------------------------------

    def reap(
        self,
        grace: float,
        batch_size: int,
        max_batches: int | None,
        log_to: EventLog | None,
        progress: Callable[[int], Any] | None,
    ) -> tuple[int, int]:
        """Delete rows whose lease ended more than ``grace`` seconds ago, one short
        transaction per batch, recording each in ``log_to``; (removed, batches)."""
        args = (grace, batch_size, max_batches, progress)
        return reaping.reap(self.run, self._sql, self.dialect, log_to, *args)
