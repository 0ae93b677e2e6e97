"""The programmatic API: :class:`TaskGuard`. The Celery glue and the CLI are thin
layers over it; every statement it sends goes through :mod:`taskguard.store`."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import URL, Engine

from taskguard.aio import AsyncLeases
from taskguard.companions import without_companions
from taskguard.deadline import DEFAULT_CALL_TIMEOUT
from taskguard.exceptions import InvalidKey, LockHeld
from taskguard.fencing import FENCED, fence
from taskguard.history import EVENTS, LockEvent, explain, story
from taskguard.lease import (
    Attempt,
    Holder,
    Lease,
    LockInfo,
    Marker,
    ReapResult,
    describe_holder,
)
from taskguard.options import Phase
from taskguard.store import Recorder, Store, Unrecorded
from taskguard.urls import url_source
from taskguard.validation import (
    adopter_for,
    holder_for,
    new_owner,
    normalize_key,
    normalize_prefix,
    optional_seconds,
    validate_limit,
    validate_marker,
    validate_ttl,
)
from taskguard.waiting import wait_for

__all__ = ["ReapResult", "TaskGuard"]

log = logging.getLogger("taskguard")

_HOSTNAME = socket.gethostname()
#: Times a run's acquire is sent when its refusal found no holder (released before
#: it could be read): :meth:`TaskGuard.take`.
ATTEMPTS_WHEN_FREED = 3
#: Lock history older than this is trimmed by the reaper (seconds: one week).
DEFAULT_HISTORY_RETENTION = 7 * 24 * 3600.0
# Cap on rows returned by held(); an operator listing more wants SQL, not a list.
_DEFAULT_LIMIT = 10_000


class TaskGuard(AsyncLeases):
    """Per-key leases stored in ``task_locks``.

    ``url_or_engine`` is a SQLAlchemy URL (taskguard creates and owns a small
    autocommit engine) or an existing :class:`~sqlalchemy.Engine` (taskguard
    borrows its pool, one statement at a time, never joining a transaction).

    Every lease operation is one short statement (two at most under a concurrency
    limit) judged by the database clock, and is safe to call from several threads;
    only ``acquire(..., wait=...)`` blocks, and only up to its timeout (asyncio: ``aacquire`` etc.).

    ``durable=False`` (PostgreSQL, own engine only) trades crash durability of
    recent grants for speed; see docs/reliability.md before using it.
    ``history=True`` records every grant, conflict, release and loss in
    ``task_lock_events`` (one extra statement per operation; see
    ``taskguard explain``); the reaper trims it to ``history_retention`` seconds.
    ``call_timeout``: seconds one lease operation may take before it ends as
    :class:`~taskguard.OutcomeUnknown` (acquire, renew) or
    :class:`~taskguard.DatabaseUnavailable`, whatever the server does (a commit
    waiting for a stopped synchronous standby, a dead host).
    ``listen_url``: where ``acquire(..., wait=...)`` LISTENs for releases (a direct
    or session-pooled URL of the same database); needed behind a transaction pooler,
    where waiters otherwise poll (docs/operations.md).
    Extra keyword arguments go to :func:`sqlalchemy.create_engine`.
    """

    def __init__(
        self,
        url_or_engine: str | URL | Engine,
        *,
        hostname: str | None = None,
        durable: bool = True,
        history: bool = False,
        history_retention: float | timedelta = DEFAULT_HISTORY_RETENTION,
        call_timeout: float | timedelta = DEFAULT_CALL_TIMEOUT,
        listen_url: str | URL | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self._store = Store(
            url_source(url_or_engine),  # also Django's DjangoDatabaseURL
            durable=durable,
            call_timeout=validate_ttl(call_timeout, name="call_timeout"),
            listen_url=listen_url,
            **engine_kwargs,
        )
        self.durable = durable
        self.hostname = hostname or _HOSTNAME
        self.history = bool(history)
        #: What the lock history records (decided here, once).
        self._history = (Recorder if self.history else Unrecorded)(self._store.history)
        self.history_retention = validate_ttl(history_retention, name="history_retention")

    @property
    def engine(self) -> Engine:
        """The engine lock statements run on."""
        return self._store.engine

    @property
    def call_timeout(self) -> float:
        """Seconds one lease operation may take (read-only)."""
        return self._store.call_timeout

    @property
    def url(self) -> str:
        """The database URL with the password masked."""
        return self._store.url

    @property
    def dialect_name(self) -> str:
        """SQLAlchemy's name of the lock database's dialect."""
        return self._store.dialect.name

    def __repr__(self) -> str:
        return f"TaskGuard({self.url!r})"

    # -- leases ----------------------------------------------------------------------

    def acquire(
        self,
        key: str,
        ttl: float | timedelta,
        *,
        task_name: str | None = None,
        task_id: str | None = None,
        hostname: str | None = None,
        pid: int | None = None,
        slot: int = 0,
        limit: int = 1,
        min_hold: float | timedelta | None = None,
        wait: float | timedelta | None = None,
    ) -> Lease | None:
        """Take ``key`` for ``ttl`` seconds if it is free or its lease expired.

        Returns ``None`` (and logs the holder) when the key is held. One
        ``INSERT … ON CONFLICT DO UPDATE … WHERE expired`` statement. Holder details
        are for people reading the table; ownership is the random ``owner`` on the
        returned :class:`Lease`.

        * ``limit=N``: at most N holders at once, one row (slot) each; the lease
          says which ``slot`` it got. Use the same N everywhere for a key.
        * ``min_hold=S``: throttle window. The key stays taken until at least S
          seconds after this grant, even after release or a crash (at most one run
          per window). Renewals keep the window too.
        * ``wait=T``: if the key is held, wait up to T seconds for it (woken by the
          release where the database can, polling elsewhere; the longest waiter
          goes first). Without it, ``acquire`` never blocks.
        """
        return self._attempt(
            key, ttl, task_name, task_id, hostname, pid, slot, limit, min_hold, wait
        )[0]

    def try_acquire(
        self,
        key: str,
        ttl: float | timedelta,
        *,
        task_name: str | None = None,
        task_id: str | None = None,
        hostname: str | None = None,
        pid: int | None = None,
        slot: int = 0,
        limit: int = 1,
        min_hold: float | timedelta | None = None,
        wait: float | timedelta | None = None,
        unless: str | None = None,
        record_refusal: bool = True,
        phase: Phase | None = None,
    ) -> Attempt:
        """:meth:`acquire`, also saying who holds the key when it is taken: an
        :class:`~taskguard.lease.Attempt` ``(lease, holder)`` with the holder read
        once, by the same call that found the conflict (and logged it).

        ``unless=K``: refused while key K is held, e.g. a :class:`Marker` left by
        :meth:`release` (checked by the acquire statement itself where the dialect
        can); the holder is then K's row if ``key`` itself is free, and a ``wait``
        ends as soon as K is seen held.
        ``record_refusal=False``: a refusal is logged, not recorded in the history.
        ``phase``: the lock phase the lease is taken for (a guarded task's enqueue or
        run), recorded in the row for operators (:attr:`LockInfo.phase`)."""
        details = (task_name, task_id, hostname, pid, slot, limit, min_hold, wait)
        return self._attempt(key, ttl, *details, unless, record_refusal, phase)

    def _attempt(
        self,
        key: str,
        ttl: float | timedelta,
        task_name: str | None,
        task_id: str | None,
        hostname: str | None,
        pid: int | None,
        slot: int,
        limit: int,
        min_hold: float | timedelta | None,
        wait: float | timedelta | None,
        unless: str | None = None,
        record_refusal: bool = True,
        phase: Phase | None = None,
    ) -> Attempt:
        key = normalize_key(key)
        if unless is not None:
            unless = normalize_key(unless)
        seconds = validate_ttl(ttl)
        holder = holder_for(self.hostname, task_name, task_id, hostname, pid, slot)
        store = self._store
        if limit == 1 and min_hold is None and wait is None and type(limit) is int:
            return self.take(key, seconds, holder, unless, record_refusal, slot, phase)
        n = validate_limit(limit, slot)
        hold = optional_seconds(min_hold, "min_hold")
        waiting = optional_seconds(wait, "wait")
        # One owner for every attempt (the waiters' queue knows it); the row keeps the
        # throttle window, so a crashed holder frees it no earlier.
        owner, seconds_held = new_owner(), max(seconds, hold)
        values = store.grant_values(key, slot, owner, seconds_held, holder, n, unless, phase)

        def attempt() -> Lease | None:
            return store.grant(values, n, seconds, hold)

        lease, seen = store.grant_seeing(values, seconds, hold) if n == 1 else (attempt(), None)
        waited = None
        # Refused for ``unless`` (the job's finished record): no wait ends that.
        settled = (lambda: store.live_holder(unless) is not None) if unless else None
        if lease is None and waiting > 0 and not (settled and settled()):
            started = time.monotonic()
            current, seen = seen or store.live_holder(key), None  # stale after the wait
            log.info(
                "lock %r is held by %s; waiting up to %gs",
                key,
                describe_holder(current),
                waiting,
            )
            slots = range(slot, slot + 1) if n == 1 else range(n)
            lease = wait_for(store, attempt, key, values["owner"], slots, waiting, settled)
            waited = time.monotonic() - started
        return self._outcome(lease, values, holder, waited, seen, record_refusal)

    def _outcome(
        self,
        lease: Lease | None,
        values: dict[str, Any],
        holder: Holder,
        waited: float | None,
        seen: LockInfo | None = None,
        record_refusal: bool = True,
    ) -> Attempt:
        key = values["key"]
        if lease is not None:
            self._history.acquired(lease, values, waited)
            return Attempt(lease, None)
        # The holder the refusing statement saw, where it reads one; else read now.
        current = seen or self._store.live_holder(key)
        if current is None and values["unless"] is not None:
            current = self._store.live_holder(values["unless"])
        gave_up = f" (gave up after waiting {waited:.3f}s)" if waited else ""
        log.info("lock %r is held by %s%s", key, describe_holder(current), gave_up)
        if record_refusal:
            self._history.refused(values, holder, waited, current)
        return Attempt(None, current)

    def release(
        self, lease: Lease, *, marker: Marker | None = None, reason: str | None = None
    ) -> bool:
        """Give the lease back. ``True`` if this call ended it; ``False`` if it had
        already expired or been taken over (a stale owner never touches another's row).
        Under a throttle window (``min_hold``) the key stays taken until the window ends.

        ``marker``: also take that key for ``marker.ttl`` seconds (either way), in the
        same statement on PostgreSQL; see ``unless=`` of :meth:`try_acquire`.
        ``reason``: recorded in the history (why it was released for its holder).
        Before the transaction that fenced the lease ends, on its thread: ``True`` at
        once, and the release right after that transaction (:meth:`give_back`)."""
        if marker is not None:
            marker = validate_marker(marker, lease.key, self.hostname)
        return self.give_back(lease, marker, reason)

    # -- an integration's run: its arguments in stored form already -------------------

    def take(
        self,
        key: str,
        seconds: float,
        holder: Holder,
        unless: str | None = None,
        record_refusal: bool = True,
        slot: int = 0,
        phase: Phase | None = None,
        _tries: int = ATTEMPTS_WHEN_FREED,
    ) -> Attempt:
        """:meth:`try_acquire` of one slot for an integration's run, whose key is
        stored form (:func:`~taskguard.validation.normalize_key`), ``seconds`` validated and
        ``holder`` complete: nothing is validated again (this is every run's path). A
        refusal whose holder released before it could be read is tried again (the key
        is likely free now), :data:`ATTEMPTS_WHEN_FREED` times in all. ``phase``: as
        :meth:`try_acquire`'s."""
        values = self._store.grant_values(key, slot, new_owner(), seconds, holder, 1, unless, phase)
        lease, seen = self._store.grant_seeing(values, seconds)
        if lease is None:
            attempt = self._outcome(lease, values, holder, None, seen, record_refusal)
            if attempt.holder is None and _tries > 1:
                again = (unless, record_refusal, slot, phase, _tries - 1)
                return self.take(key, seconds, holder, *again)
            return attempt
        self._history.acquired(lease, values)
        return Attempt(lease, None)

    def give_back(
        self, lease: Lease, marker: Marker | None = None, reason: str | None = None
    ) -> bool:
        """:meth:`release` for an integration's run, whose ``marker`` (if any) is
        complete (stored key, ttl in seconds, holder with host and pid).

        Called on the thread that fenced ``lease`` before the fenced transaction ended,
        it returns ``True`` at once and releases right after that transaction commits
        or rolls back (see :mod:`taskguard.fencing`): it would otherwise wait for the
        fence's own row lock."""
        if (fenced := FENCED.get(lease.owner)) and fenced.defer(
            lease, lambda: self.give_back(lease, marker, reason)
        ):
            return True
        ended, by_statement = self._store.release(lease, marker)
        self._history.released(lease, ended, by_statement, reason)
        return ended

    def record_event(self, key: str, event: str, detail: str, **holder: Any) -> None:
        """With history on, record an event of an integration's (``"coalesced"``: a
        submission merged into a pending run); ``holder``: as :meth:`acquire`'s."""
        who = holder_for(self.hostname, **holder)
        self._history.event(normalize_key(key), event, detail, who)

    def renew(self, lease: Lease, ttl: float | timedelta | None = None) -> bool:
        """Extend the lease to ``ttl`` (default: its original ttl) from now, by the
        database clock. Updates ``lease.expires_at``. ``False`` if it is no longer ours."""
        seconds = lease.ttl if ttl is None else validate_ttl(ttl)
        outcome = self._store.renew(lease, seconds)
        if outcome == "lost":
            self._history.lost(lease)
        return outcome == "renewed"

    def adopt(
        self,
        key: str,
        owner: str,
        ttl: float | timedelta,
        *,
        slot: int = 0,
        min_hold: float | timedelta | None = None,
        exclusive: bool = False,
        task_name: str | None = None,
        task_id: str | None = None,
        hostname: str | None = None,
        pid: int | None = None,
        phase: Phase | None = None,
    ) -> Lease | None:
        """Take over a live lease by its owner id (e.g. one a publisher acquired and
        handed to the worker in the message), renewing it to ``ttl``; pass the
        lease's ``min_hold`` to keep its throttle window. ``None`` if that owner no
        longer holds the key. ``exclusive=True``: in the same statement the lease
        passes to a new owner id (the returned lease's) and holder (``task_name``,
        ``task_id``, ``hostname``, ``pid`` as for :meth:`acquire`; same row, token and
        ``acquired_at``), so of several callers adopting one owner id one gets it,
        and with ``phase`` the row's phase changes (a run adopting its enqueue's lease)."""
        key = normalize_key(key)
        seconds = validate_ttl(ttl)
        hold = optional_seconds(min_hold, "min_hold")
        holder = adopter_for(self.hostname, exclusive, task_name, task_id, hostname, pid, slot)
        if holder is not None:  # exclusive: the hand-over, validated
            return self.take_over(key, owner, seconds, holder, slot, hold, phase)
        return self._store.adopt(key, owner, slot, seconds, hold, None)

    def take_over(
        self,
        key: str,
        owner: str,
        seconds: float,
        holder: Holder,
        slot: int,
        min_hold: float,
        phase: Phase | None = None,
    ) -> Lease | None:
        """:meth:`adopt` with ``exclusive=True`` for an integration's run (a lease handed
        over in a message), whose key is stored form, ``seconds`` validated and
        ``holder`` complete: nothing is validated again (every hand-over's path)."""
        lease = self._store.adopt(key, owner, slot, seconds, min_hold, (new_owner(), holder), phase)
        if lease is not None:
            self._history.handed_over(owner, lease, holder)
        return lease

    def fence(self, lease: Lease, session: Any) -> int:
        """:meth:`Lease.fence`: check ``lease`` inside ``session``'s transaction and
        return its token; raises :class:`~taskguard.LeaseLost` if it is not held."""
        return fence(lease, session)

    def is_held_by(self, lease: Lease) -> bool:
        """Whether ``lease`` is still live by the database clock (one read)."""
        info = self._store.read_owner(lease.key, lease.slot, lease.owner)
        return info is not None and info.held

    @contextmanager
    def lock(self, key: str, ttl: float | timedelta, **holder_details: Any) -> Iterator[Lease]:
        """``with guard.lock(key, ttl) as lease:`` — raises :class:`LockHeld` (with
        the current holder) if the key is taken; releases on exit. It does not renew:
        keep the body shorter than ``ttl`` or call :meth:`renew`."""
        lease, holder = self.try_acquire(key, ttl, **holder_details)
        if lease is None:
            raise LockHeld(normalize_key(key), holder)
        try:
            yield lease
        finally:
            if not self.release(lease):
                late = "lease on %r (owner %s) had already expired or been taken over at release"
                log.warning(late, lease.key, lease.owner)

    # -- inspection and operations ----------------------------------------------

    def get(self, key: str) -> LockInfo | None:
        """The row for ``key`` (slot 0 for a mutex), live or not; ``None`` if there is
        none. ``info.held`` says whether it is live by the database clock."""
        rows = self._store.rows(normalize_key(key))
        return next((r for r in rows if r.held), rows[0] if rows else None)

    def get_all(self, key: str) -> list[LockInfo]:
        """Every slot row for ``key`` (several under a concurrency limit)."""
        return self._store.rows(normalize_key(key))

    def held(
        self,
        prefix: str | None = None,
        *,
        include_expired: bool = False,
        companions: bool = False,
        limit: int = _DEFAULT_LIMIT,
    ) -> list[LockInfo]:
        """Live leases (or every row with ``include_expired``) whose key starts with
        ``prefix``, by key; the Celery glue's companion rows (finished runs' records,
        #pending/#rate/#debounce: :mod:`taskguard.companions`) only with ``companions``."""
        if prefix is not None and not isinstance(prefix, str):
            raise InvalidKey(f"prefix must be a str, not {type(prefix).__name__}", prefix)
        stored = normalize_prefix(prefix or "")  # keys are stored in NFC

        def read(n: int) -> list[LockInfo]:
            return self._store.held(stored, include_expired=include_expired, limit=n)

        return read(int(limit)) if companions else without_companions(read, int(limit))

    def force_release(self, key: str, *, by: str | None = None) -> bool:
        """Operator override: end every live lease on ``key`` whoever holds it.
        The holder's next renew/release returns ``False``. ``True`` if one was live.
        ``by`` names the operator: then each ended lease is recorded in the lock
        history with that name, even when the guard records no other history."""
        key = normalize_key(key)
        ended = self._store.force_release(key)
        if ended:
            who = f" by {by}" if by else ""
            log.warning("force-released %r%s (%d live lease(s))", key, who, len(ended))
            self._history.force_released(key, ended, by)
        return bool(ended)

    def reap(
        self,
        *,
        grace: float | timedelta = 300.0,
        batch_size: int = 5_000,
        max_batches: int | None = None,
        progress: Callable[[int], Any] | None = None,
        by: str | None = None,
    ) -> ReapResult:
        """Delete rows whose lease ended more than ``grace`` seconds ago, in batches of
        ``batch_size`` (each its own short transaction). Live leases are never touched;
        two reapers may run at once. ``progress(removed_so_far)`` is called per batch.

        ``grace`` must exceed the longest an acquire statement can run: the row is
        what keeps a late, slow acquire from reusing a lower fencing token.

        With lock history on, each removed row is recorded as ``reaped``, the run as
        ``reap`` (on the key ``taskguard:reaper``), and history older than
        ``history_retention`` is trimmed afterwards. ``by`` names the operator who
        asked: the run is then recorded with that name even without history.
        """
        grace_s = optional_seconds(grace, "grace")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        removed, batches = self._store.reap(
            grace_s, batch_size, max_batches, self._history.reaped_to, progress
        )
        if removed:
            log.info("reaped %d expired lock row(s) in %d batch(es)", removed, batches)
        self._history.reap_ran(
            removed, batches, by, lambda: self.trim_history(batch_size=batch_size)
        )
        return ReapResult(removed, batches)

    def trim_history(
        self, older_than: float | timedelta | None = None, *, batch_size: int = 5_000
    ) -> int:
        """Delete lock history older than ``older_than`` seconds (default: the
        guard's ``history_retention``), in batches. Returns the number removed."""
        keep = self.history_retention if older_than is None else validate_ttl(older_than)
        removed = self._store.history.trim(keep, batch_size)
        if removed:
            log.info("trimmed %d lock history event(s) older than %gs", removed, keep)
        return removed

    def events(self, key: str, *, limit: int = 50) -> list[LockEvent]:
        """The most recent ``limit`` history events of ``key``, oldest first (empty
        unless some guard records history: ``TaskGuard(..., history=True)``)."""
        return story(self._store.history.read(normalize_key(key), limit))[-limit:]

    def recent_events(
        self, *, since: datetime, kinds: Collection[str] | None = None, limit: int = 1_000
    ) -> list[LockEvent]:
        """The newest ``limit`` history events of every key recorded at or after
        ``since`` (e.g. ``guard.db_now() - timedelta(hours=1)``), oldest first, as
        recorded (a key's story, takeovers told, is :meth:`events`); ``kinds``: only
        these events (names in :data:`taskguard.history.EVENTS`; default all)."""
        wanted = list(EVENTS if kinds is None else dict.fromkeys(kinds))
        if not wanted or any(k not in EVENTS for k in wanted):
            raise ValueError(f"kinds must be event names among {', '.join(EVENTS)}: {kinds!r}")
        return self._store.history.recent(since, wanted, int(limit))

    def explain(self, key: str, *, limit: int = 50) -> str:
        """The recent story of ``key`` as text: who held it, for how long, who was
        turned away, and its state now (``taskguard explain KEY``)."""
        key = normalize_key(key)
        return explain(key, self.events(key, limit=limit), self.get_all(key))

    def waited_for(self) -> int:
        """How many keys someone is waiting for: an ``acquire(..., wait=)`` still
        inside its wait (announced on the key's rows, by the database clock)."""
        return self._store.waited_for()

    def db_now(self) -> datetime:
        """The database clock (UTC), as lock statements see it."""
        return self._store.db_now()

    def dispose(self) -> None:
        """Close the guard's connections (only if it created its own engine) and end
        its asyncio lease threads."""
        self._end_lease_threads()
        self._store.dispose()
