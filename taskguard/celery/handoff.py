"""Taking over a lease carried in a message (publisher -> worker, run -> retry).

The message header holds the lease (``Lease.to_dict()``). The worker adopts it
with :meth:`TaskGuard.adopt` — the same row, owner and fencing token, renewed to
the run's ttl — so there is no moment in which the key is free.

Adopting by owner alone would let a second delivery of the same message (a broker
redelivery while the first copy runs) adopt it too. So each delivery first takes
a companion *claim* row, ``<key>#run:<task id>``: the first delivery gets it and
holds it while it runs; another delivery of the same task id finds it held and is
a conflict. A hand-off that lapsed (the lease expired while the message waited)
falls back to a fresh acquisition.
"""

from __future__ import annotations

import logging
from typing import Any

from taskguard import signals
from taskguard.celery.leasing import (
    acquire_or_holder,
    claim_key,
    held_seconds,
    release_quietly,
    send_released,
)
from taskguard.celery.taskids import stored_task_id
from taskguard.guard import TaskGuard
from taskguard.lease import Lease, LockInfo

__all__ = ["start_queue_phase", "take_over"]

log = logging.getLogger("taskguard.celery")


def start_queue_phase(
    task: Any, guard: TaskGuard, request: Any, key: str, header: dict[str, Any]
) -> tuple[bool, LockInfo | None]:
    """lock="queue" at start: give back the lease carried in the message; a
    deferred message (on_conflict="retry" at enqueue) checks the key is free.
    Returns (blocked, holder)."""
    handed = header.get("lease")
    if isinstance(handed, dict):
        lease = Lease.from_dict(handed)
        released = release_quietly(guard, lease)
        send_released(task, lease, released, held_seconds(lease))
        return False, None
    if not header.get("deferred"):
        return False, None
    limit = task.taskguard_options.limit
    # No min_hold here: releasing a probe must not start a throttle window.
    probe, holder = acquire_or_holder(
        guard,
        key,
        task._ttl(),
        task_name=task.name,
        task_id=stored_task_id(request.id),
        hostname=request.hostname,
        **({"limit": limit} if limit != 1 else {}),
    )
    if probe is None:
        return True, holder
    release_quietly(guard, probe)
    return False, None


def take_over(
    task: Any, guard: TaskGuard, request: Any, key: str, handed: dict[str, Any], ttl: float
) -> tuple[Lease | None, Lease | None, bool, LockInfo | None]:
    """Adopt the lease carried in the message: (lease, claim, False, None); or
    (None, None, True, holder) when another delivery of this task id runs it; or
    (None, None, False, None) when the hand-off lapsed (it expired while queued)."""
    stored_id = stored_task_id(request.id)
    claim, holder = acquire_or_holder(
        guard,
        claim_key(key, stored_id),
        ttl,
        task_name=task.name,
        task_id=stored_id,
        hostname=request.hostname,
    )
    if claim is None:
        return None, None, True, holder
    lease = guard.adopt(
        key,
        str(handed.get("owner")),
        ttl,
        slot=int(handed.get("slot", 0)),
        min_hold=float(handed.get("min_hold", 0)) or None,
    )
    if lease is None:
        log.info("hand-off of lock %r to %s[%s] lapsed; acquiring", key, task.name, request.id)
        release_quietly(guard, claim)
        return None, None, False, None
    signals.lock_acquired.send(sender=task, key=key, lease=lease)
    return lease, claim, False, None
