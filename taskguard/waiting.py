"""Waiting for a held key: ``TaskGuard.acquire(..., wait=timeout)``.

A waiter first *announces* itself on the key's rows (one UPDATE): it raises the
row's ``wanted_until`` (a release before it wakes waiters), and if it has waited
longest it becomes ``next_owner``. Then:

* PostgreSQL (psycopg): it LISTENs on a dedicated connection (the dialect's
  listener), opened before the
  announcement so no release can slip between the two. A trigger NOTIFYs only
  when a lease ends early on a row with ``wanted_until`` set, so without waiters
  releases never notify (and never take NOTIFY's global commit lock). The waiter
  also wakes when the holder's lease would expire on its own (a crashed holder
  never releases), and re-checks every :data:`RECHECK` seconds at most.
* Dialects without wake-ups (SQLite): backoff polling, from :data:`POLL_MIN` up to
  :data:`POLL_MAX` seconds, never past the holder's expiry.

Fairness: for :data:`~taskguard.dialects.RESERVE_GRACE` seconds after a lease ends
only ``next_owner`` may take the row (the acquire statement's takeover condition
says so), so a stream of newcomers cannot starve the oldest waiter; a waiter that
loses a round re-announces and, once it is the oldest, gets the next release.

A place in line is a lease too: an announcement reserves the row (``next_until``)
and asks for wake-ups (``wanted_until``) for :data:`RESERVATION` seconds only, and
a live waiter renews both by announcing again every :data:`RENEW_EVERY` seconds
(keeping its first announcement's time, which orders the line). So a waiter that
dies without withdrawing (SIGKILL) stops holding the key up within
:data:`RESERVATION` seconds, whatever its timeout was. A live waiter that misses
its renewals (a paused process) is passed over only until its next announcement:
the earliest first announcement takes the lead back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar

from taskguard.dialects import RESERVE_GRACE
from taskguard.exceptions import TaskGuardError
from taskguard.lease import Lease
from taskguard.store import Store, WaitRow

__all__ = ["abandoned", "wait_for"]

log = logging.getLogger("taskguard")

#: Polling (no wake-ups): first and longest sleep between attempts, seconds.
POLL_MIN = 0.01
POLL_MAX = 0.5
#: With wake-ups: longest sleep without a re-check (a lost notification, or a
#: lease shortened by a renewal with a smaller ttl, costs at most this).
RECHECK = 5.0
#: How long one announcement keeps a waiter's place in line (seconds).
RESERVATION = 2.0
#: Longest time between a waiter's announcements (renewals of its place).
RENEW_EVERY = RESERVATION / 4
# Wake a little after a lease's expiry, so the retry sees it expired.
_AFTER_EXPIRY = 0.002
#: Set once the caller has stopped waiting (asyncio: its task was cancelled): the
#: wait ends at its next wake-up, without another attempt, and leaves the line.
abandoned: ContextVar[threading.Event | None] = ContextVar("taskguard_wait_abandoned", default=None)


def _next_try(rows: list[WaitRow], limit: int, owner: str) -> float:
    """Seconds until an attempt can succeed, judged from the announce's rows; 0
    means try now."""
    if len(rows) < limit:
        return 0.0  # a slot has no live (or reserved) row
    waits = []
    for _slot, row_owner, expires_at, next_owner, now in rows:
        left = (expires_at - now).total_seconds()
        if left > 0:
            waits.append(left + _AFTER_EXPIRY)
        elif next_owner in (None, owner, row_owner):
            return 0.0
        else:  # reserved for another waiter until the grace ends
            waits.append(left + RESERVE_GRACE + _AFTER_EXPIRY)
    return min(waits)


def wait_for(
    store: Store,
    attempt: Callable[[], Lease | None],
    key: str,
    owner: str,
    slots: range,
    timeout: float,
    settled: Callable[[], bool] | None = None,
) -> Lease | None:
    """Retry ``attempt`` (an acquire as ``owner`` of one of ``slots``) until it
    grants or ``timeout`` seconds pass, or a refusal is ``settled()`` (no wait would
    change it); the first attempt has already failed."""
    deadline = time.monotonic() + timeout
    gone = abandoned.get() or threading.Event()
    listener = store.waiters.listener()
    since: object = None
    announced = False
    lease: Lease | None = None
    quick = 0
    poll = POLL_MIN
    due = 0.0  # monotonic time of the next attempt
    try:
        while (remaining := deadline - time.monotonic()) > 0 and not gone.is_set():
            rows, since = store.waiters.announce(
                key, slots, owner, since, min(remaining, RESERVATION)
            )
            announced = True
            if time.monotonic() >= due:
                delay = _next_try(rows, len(slots), owner)
                if delay <= 0:
                    # Free by the database's word; a second miss in a row (a lost race)
                    # backs off so two waiters never spin against each other.
                    quick += 1
                    delay = 0.0 if quick == 1 else min(POLL_MIN * 2**quick, POLL_MAX)
                else:
                    quick = 0
                due = time.monotonic() + min(delay, remaining, RECHECK)
            nap = min(due - time.monotonic(), RENEW_EVERY)
            if nap > 0:
                if listener is not None:
                    if listener.wait(key, nap):
                        due = 0.0  # released (or the listener broke): try now
                else:
                    head = any(r[3] == owner for r in rows)
                    cap = RESERVE_GRACE / 4 if head else poll
                    gone.wait(min(nap, cap))
                    poll = min(poll * 2, POLL_MAX)
                    due = min(due, time.monotonic())
            if time.monotonic() < due or gone.is_set():
                continue  # woken only to renew the place in line (or abandoned)
            lease = attempt()
            if lease is not None:
                return lease
            if settled is not None and settled():
                return None
        return None
    finally:
        if announced and (lease is None or len(slots) > 1):
            # Give up our place in line (or, holding one slot, on the other rows).
            try:
                store.waiters.withdraw(key, owner)
            except TaskGuardError as exc:
                log.debug("could not withdraw waiter %s on %r: %s", owner, key, exc)
        if listener is not None:
            listener.close()
