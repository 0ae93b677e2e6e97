"""Putting a start off without holding a worker slot: the message is published
again with a countdown and the current execution ends in Celery's RETRY state.

Unlike ``Task.retry`` this does not count against ``max_retries`` (the run was
never attempted, so a deferral may repeat as long as the key stays busy or over
its rate) and keeps ``request.retries`` as it was. The copy carries the key and
whatever else the caller puts in the header (a coalesced run's pending lease).

In eager mode (``apply()``, ``task_always_eager``) there is no broker to hold a
countdown: Celery would re-run a retry at once, over and over while the key stays
busy, so a deferred eager run is not re-run; its result is in state RETRY.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.exceptions import Reject, Retry

from taskguard import signals
from taskguard.celery.header import HEADER, Header

__all__ = ["defer"]

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
