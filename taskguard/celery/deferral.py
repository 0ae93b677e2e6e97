"""Deferred runs: countdowns, a start put off by re-publishing, and runs an outage
of the lock database put off.

Putting a start off without holding a worker slot: the message is published
again with a countdown and the current execution ends in Celery's RETRY state.

Unlike ``Task.retry`` this does not count against ``max_retries`` (the run was
never attempted, so a deferral may repeat as long as the key stays busy or over
its rate) and keeps ``request.retries`` as it was. The copy carries the key and
whatever else the caller puts in the header (a coalesced run's pending lease).

In eager mode (``apply()``, ``task_always_eager``) there is no broker to hold a
countdown: Celery would re-run a retry at once, over and over while the key stays
busy, so a deferred eager run is not re-run; its result is in state RETRY.

How long to wait: publish delays, retry delays, conflict and poll countdowns.

A guarded run that cannot reach the lock database is tried again later.

When the lock database cannot be reached before a run's body starts (its acquire,
the hand-over of a queued lease, its pending place, its finished-record check: a
:class:`~taskguard.DatabaseUnavailable`, or an :class:`~taskguard.OutcomeUnknown`),
the message is published again with a countdown (:func:`defer`:
outside ``max_retries``), :data:`FIRST_DELAY` seconds doubling up to :data:`MAX_DELAY`,
until ``taskguard_outage_retry_for`` seconds have passed since its first failure;
after that the run fails with the error (FAILURE, one ERROR line) and gives back
what it holds or was handed (the lease it took, the queued lease, the pending
place), when the database answers again (:func:`~taskguard.held_lease.release_when_reachable`),
not when those leases expire. Nothing runs
without its lock and nothing is dropped: each deferral is logged (WARNING) and sent
as :data:`taskguard.signals.run_deferred` with reason ``"outage"`` (the metric
``taskguard_runs_deferred_total{reason="outage"}``).

The copy carries the message's taskguard header on (a pending place, a debounce
batch) and the lease this run may hold, which the copy adopts rather than waiting
for it to expire: the one it took, when the outage came after that; when an
acquire's or a hand-over's outcome was unknown, the owner id that may hold the key
(and the handed owner id as the alternative). A body that has started is never run again for this: an error it raises is
its own. Eager runs (no broker to hold a countdown) raise the error at once.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.exceptions import Reject, Retry

from taskguard import signals
from taskguard.celery.message import HEADER, Handed, Header, carry
from taskguard.config import setting
from taskguard.exceptions import DatabaseUnavailable, OutcomeUnknown
from taskguard.held_lease import release_when_reachable
from taskguard.lease import Lease, LockInfo
from taskguard.validation import validate_ttl

__all__ = ["defer", "poll_countdown", "publish_delay", "retry_delay", "retry_later"]

log = logging.getLogger("taskguard.celery")


def defer(
    task: Any,
    request: Any,
    key: str,
    countdown: float,
    reason: str,
    extra_header: dict[str, Any] | None = None,
) -> Retry:
    """Publish ``request`` again in ``countdown`` seconds and return the
    :class:`~celery.exceptions.Retry` to raise (so the result shows RETRY, not a
    value). ``reason`` is logged and sent with :data:`taskguard.signals.run_deferred`."""
    header = Header(key, "retry", deferred=reason)._replace(**(extra_header or {}))
    headers = {**(getattr(request, "headers", None) or {}), HEADER: header.to_message()}
    sig = task.signature_from_request(
        request, countdown=countdown, retries=request.retries, headers=headers
    )
    log.info(
        "deferring %s[%s] by %.2fs (%s): key %r", task.name, request.id, countdown, reason, key
    )
    signals.run_deferred.send(
        sender=task, key=key, task_id=request.id, reason=reason, countdown=countdown
    )
    if request.is_eager:
        log.warning("%s[%s] is not re-run: eager mode has no countdown", task.name, request.id)
        return Retry(
            f"deferred ({reason}); not re-run in eager mode", when=countdown, is_eager=True
        )
    try:
        sig.apply_async()
    except Exception as exc:
        raise Reject(exc, requeue=False) from exc
    return Retry(f"deferred ({reason})", when=countdown, sig=sig)


# -- countdowns --------------------------------------------------------------------------


#: First and longest countdown (seconds) of a deferred start re-checking a busy key.
FIRST_POLL = 0.25
MAX_POLL = 1.0


def _as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


def publish_delay(options: Mapping[str, Any]) -> float:
    """Seconds until a message published with these options may start."""
    countdown = options.get("countdown")
    if countdown:
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if isinstance(eta, datetime):
        return max(0.0, (_as_utc(eta) - datetime.now(timezone.utc)).total_seconds())
    return 0.0


def retry_delay(countdown: Any, eta: Any, default: Any) -> float:
    """The delay ``Task.retry`` will use, for sizing the lease kept across it."""
    if eta is not None:
        return publish_delay({"eta": eta})
    if countdown is None:
        countdown = default
    return max(0.0, float(countdown or 0))


def poll_countdown(polls: int, holder: LockInfo | None) -> float:
    """Countdown of a start deferred while the key is busy (a pending run, a rate=
    start), its ``polls``-th time: from :data:`FIRST_POLL`, doubling up to
    :data:`MAX_POLL`, never past the holder's expiry, at least 0.05 s."""
    countdown = min(MAX_POLL, FIRST_POLL * 2.0**polls)
    if holder is not None:
        countdown = min(countdown, max(holder.expires_in.total_seconds(), 0.0) + 0.05)
    return max(countdown, 0.05)


# -- outages -----------------------------------------------------------------------------


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
        extra["lease"] = carry(held)
    elif isinstance(exc, OutcomeUnknown) and exc.key == key and opts.locks_run and opts.limit == 1:
        # The acquire (or the hand-over) may have committed under exc.owner: the copy
        # adopts that lease if it did, else the one the message carried.
        at, ttl = datetime.now(timezone.utc), task._ttl()
        maybe = Lease(
            key, exc.owner, 0, at, at + timedelta(seconds=ttl), ttl, 0, opts.min_hold or 0
        )
        given = _handed_owner(header)
        extra["lease"] = carry(maybe, given if given != exc.owner else None)
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


def _handed_owner(header: Header) -> str | None:
    """The owner id of the lease the message carried, if any (and well formed)."""
    try:
        return None if header.lease is None else Handed.of(header.lease).owner
    except (KeyError, TypeError, ValueError):
        return None


def _given_up(run: Any) -> list[Lease]:
    """What a run that gives up holds or was handed: the lease it took, the lease
    the message carries (under either owner id it may have), its pending place."""
    header: Header = run.header
    leases: list[Lease] = []
    held: Lease | None = run.lease
    try:
        if header.lease is not None:
            given = Handed.of(header.lease)
            carried = given.lease(header.key)
            leases.append(carried)
            if given.alternate:
                leases.append(dataclasses.replace(carried, owner=given.alternate))
        if header.pending is not None:
            leases.append(Lease.from_dict(header.pending))
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring a malformed lease in %s[%s]: %s", run.task.name, run.request.id, exc)
    if held is None:
        return leases
    return [held, *(lease for lease in leases if lease.owner != held.owner)]
