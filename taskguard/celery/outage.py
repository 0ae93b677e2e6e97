"""A guarded run that cannot reach the lock database is tried again later.

When the lock database cannot be reached before a run's body starts (its acquire,
the hand-off of a queued lease, its pending place, its finished-record check: a
:class:`~taskguard.DatabaseUnavailable`, or an :class:`~taskguard.OutcomeUnknown`),
the message is published again with a countdown (:func:`taskguard.celery.deferral.defer`:
outside ``max_retries``), :data:`FIRST_DELAY` seconds doubling up to :data:`MAX_DELAY`,
until ``taskguard_outage_retry_for`` seconds have passed since its first failure;
after that the run fails with the error (FAILURE, one ERROR line) and gives back
what it holds or was handed (the lease it took, the queued lease, the pending
place), when the database answers again (:func:`~taskguard.celery.leasing.release_when_reachable`),
not when those leases expire. Nothing runs
without its lock and nothing is dropped: each deferral is logged (WARNING) and sent
as :data:`taskguard.signals.run_deferred` with reason ``"outage"`` (the metric
``taskguard_runs_deferred_total{reason="outage"}``).

The copy carries the message's taskguard header on (a pending place, a debounce
batch) and the lease this run may hold, which the copy adopts rather than waiting
for it to expire: the one it took, when the outage came after that; when an
acquire's or a hand-off's outcome was unknown, the owner id that may hold the key
(and the handed owner id as the alternative). A body that has started is never run again for this: an error it raises is
its own. Eager runs (no broker to hold a countdown) raise the error at once.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from taskguard.celery.deferral import defer
from taskguard.celery.header import Header
from taskguard.celery.leasing import release_when_reachable
from taskguard.config import setting
from taskguard.exceptions import DatabaseUnavailable, OutcomeUnknown
from taskguard.keys import validate_ttl
from taskguard.lease import Lease

__all__ = ["FIRST_DELAY", "MAX_DELAY", "retry_later"]

log = logging.getLogger("taskguard.celery")

#: First and longest countdown (seconds) of a run put off by an outage.
FIRST_DELAY = 1.0
MAX_DELAY = 30.0


def retry_later(run: Any, exc: DatabaseUnavailable) -> BaseException:
    """What to raise for ``exc``, met by ``run`` (a :class:`~taskguard.celery.running.Run`): the :class:`~celery.exceptions.Retry`
    of a copy published with a countdown, or ``exc`` itself (the body had started, an
    eager run, retries off, or the outage outlasted ``taskguard_outage_retry_for``)."""
    task, request = run.task, run.request
    if run.body_started or request.is_eager:
        return exc
    value = setting(task._get_app(), "taskguard_outage_retry_for")
    bound = 0.0 if value in (0, None) else validate_ttl(value, name="taskguard_outage_retry_for")
    header = run.header
    state = header.outage
    now = time.time()
    try:
        since, n = float(state["since"]), int(state["n"])
    except (KeyError, TypeError, ValueError):
        since, n = now, 0
    left = since + bound - now
    if left <= 0:
        log.error(
            "giving up on %s[%s]: the lock database was unreachable for %.0fs "
            "(taskguard_outage_retry_for = %g): %s",
            task.name,
            request.id,
            now - since,
            bound,
            exc,
        )
        why = f"{task.name}[{request.id}] gave up on the outage"
        release_when_reachable(run.guard, _given_up(run), why)
        return exc
    opts = run.opts
    key = run.key or header.message_key(
        opts.deriver.derive, request.args or (), request.kwargs or {}
    )
    countdown = min(MAX_DELAY, FIRST_DELAY * 2 ** min(n, 8), left) * random.uniform(0.8, 1.0)
    # The copy starts as this message would have (its deferred flag, pending place, ...).
    extra = header._replace(key=key, via="retry", outage={"since": since, "n": n + 1})._asdict()
    held: Lease | None = run.lease
    if held is not None:
        extra["lease"] = held.to_dict()
    elif isinstance(exc, OutcomeUnknown) and exc.key == key and opts.locks_run and opts.limit == 1:
        # The acquire (or the hand-off) may have committed under exc.owner: the copy
        # adopts that lease if it did, else the one the message carried.
        at, ttl = datetime.now(timezone.utc), task._ttl()
        maybe = Lease(
            key, exc.owner, 0, at, at + timedelta(seconds=ttl), ttl, 0, opts.min_hold or 0
        )
        extra["lease"] = maybe.to_dict()
        handed = header.lease
        if handed is not None and handed.get("owner") not in (None, exc.owner):
            extra["lease"]["alternate"] = handed["owner"]
    log.warning(
        "lock database unreachable before %s[%s] could start (%s); trying again in %.1fs, "
        "for %.0fs more at most",
        task.name,
        request.id,
        exc,
        countdown,
        left,
    )
    retry: BaseException = defer(task, request, key, countdown, "outage", extra)
    return retry


def _given_up(run: Any) -> list[Lease]:
    """What a run that gives up holds or was handed: the lease it took, the lease
    the message carries (under either owner id it may have), its pending place."""
    header: Header = run.header
    leases: list[Lease] = []
    held: Lease | None = run.lease
    try:
        handed = header.lease
        if handed is not None:
            carried = Lease.from_dict(handed)
            leases.append(carried)
            if handed.get("alternate"):
                leases.append(dataclasses.replace(carried, owner=str(handed["alternate"])))
        if header.pending is not None:
            leases.append(Lease.from_dict(header.pending))
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring a malformed lease in %s[%s]: %s", run.task.name, run.request.id, exc)
    if held is None:
        return leases
    return [held, *(lease for lease in leases if lease.owner != held.owner)]
