"""Run leases for prefetched messages, taken by the worker's main process in batches.

A prefork worker reserves (prefetches) more messages than it has pool processes.
For ``lock="run"`` tasks its main process takes the run leases of the messages it
reserved, many per statement (:meth:`TaskGuard.acquire_many`: one round trip and
one commit on PostgreSQL), on a thread of its own (:mod:`taskguard.celery.leaser`)
so its event loop never waits on the database, and hands each lease to the pool
process in the request (header field ``granted``). The process starts the body
without a statement of its own and releases as usual: a guarded run costs it one
statement, not two, and the database one commit per batch instead of one per run.

What changes: the lease is taken when the worker hands the message to its pool,
not when a process starts it, so a prefetched message holds its key while it waits
for a free process (a duplicate submitted meanwhile finds the key held), and that
wait counts towards the ttl. A process that starts a run whose grant is older than
:data:`STALE_FRACTION` of the ttl renews it first, or acquires afresh if it was
lost. The token, the release, renewals, fencing and every conflict rule are
unchanged: a message the batch did not grant (its key was held, a second message
of the same key in one batch, the database unreachable) goes to the pool as it
would without batching, and its process acquires, and acts on a conflict, itself.

Batches form on their own: reserved messages wait in a buffer while :data:`AHEAD`
granted messages per pool process are ready, so a busy worker grants several at
once, and an idle one grants each message as it arrives. Only workers with an event
loop (prefork) batch, and only where the database takes a batch in one statement
(PostgreSQL); tasks with a concurrency limit, a throttle window, a start rate,
coalesce or debounce, and messages that carry a lease or a pending place, take the
usual path. Off with ``taskguard_prefetch_grants = False``.

A granted message that never reaches a process (revoked, or the worker stops) gives
its lease back (:func:`give_back`); one whose process dies is released by
:mod:`taskguard.celery.worker`, by owner.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

from celery.signals import worker_shutdown
from celery.worker.strategy import default as default_strategy
from kombu.asynchronous import get_event_loop

from taskguard.celery import completions
from taskguard.celery.header import HEADER
from taskguard.celery.leaser import Granted, Leaser
from taskguard.celery.taskids import stored_task_id
from taskguard.config import guard_for, setting
from taskguard.exceptions import TaskGuardError
from taskguard.guard import TaskGuard
from taskguard.lease import Holder, Lease, LeaseRequest

__all__ = [
    "GRANTED",
    "STALE_FRACTION",
    "adopt",
    "give_back",
    "started",
    "strategy",
]

log = logging.getLogger("taskguard.celery")

#: The header field a granted lease travels in, main process -> pool child.
GRANTED = "granted"
#: A child renews a grant older than this fraction of its ttl before the body runs
#: (the heartbeat then keeps its usual ttl/3 rhythm from there).
STALE_FRACTION = 0.05
#: Granted requests kept ready per pool process: a process that finishes finds
#: the next one granted while the following batch is being granted (measured: one
#: per process left processes idle during the batch's commit).
AHEAD = 2
#: Most grants in one statement.
MAX_BATCH = 100
#: Longest a reserved message waits for its batch (seconds), whatever the counts say.
MAX_DELAY = 0.05
#: Header fields that mean the message takes another path (see the module docstring).
_OTHER_PATHS = ("lease", "marker", "pending", "debounce", "deferred", GRANTED)


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """``GuardedTask.Strategy``: Celery's default message handler, whose requests
    go through the main process's batcher first when the task qualifies."""
    if _qualifies(task, app):
        hub: Any = get_event_loop()
        batcher = _batchers.get(consumer)
        if batcher is None and hub is not None:
            batcher = _batchers[consumer] = _Batcher(app, consumer, hub)
        if batcher is not None:
            consumer = _Consumer(consumer, batcher.submit)
    return default_strategy(task, app, consumer, **kwargs)


def _qualifies(task: Any, app: Any) -> bool:
    opts = getattr(task, "taskguard_options", None)
    if opts is None or not setting(app, "taskguard_prefetch_grants"):
        return False
    simple = opts.lock == "run" and opts.limit == 1 and opts.min_hold is None
    if not simple or opts.pending_runs or opts.rate is not None:
        return False
    try:
        return guard_for(app).batches_in_one_statement
    except TaskGuardError as exc:
        log.warning("grants for prefetched %s messages stay in the pool: %s", task.name, exc)
        return False


class _Consumer:
    """The worker's consumer as the default strategy sees it, except that reserved
    requests go to ``on_task_request`` (the batcher) instead of the pool."""

    def __init__(self, consumer: Any, on_task_request: Any) -> None:
        self._consumer = consumer
        self.on_task_request = on_task_request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


class _Batcher:
    """Reserved requests of one worker, on its event loop: buffered, handed to the
    lease thread in batches, dispatched to the pool when granted (or refused)."""

    def __init__(self, app: Any, consumer: Any, hub: Any) -> None:
        self.app = app
        self.hub = hub
        self.handle = consumer.on_task_request  # on to the pool (Celery's own path)
        self._consumer = weakref.ref(consumer)
        self.buffer: list[Any] = []
        #: Requests with the lease thread, not yet back.
        self.granting = 0
        #: Granted, not yet started by a pool process: task id -> lease.
        self.unstarted: dict[str, Lease] = {}
        self.backstop_due = False
        self.processes = 0
        self.leaser = Leaser(app, hub, self._granted)
        self.leaser.start()

    def submit(self, req: Any) -> None:
        header = req.request_dict.get(HEADER)
        key = header.get("key") if isinstance(header, dict) else None
        if not isinstance(key, str) or any(f in header for f in _OTHER_PATHS):
            self.handle(req)
            return
        self.buffer.append(req)
        self.schedule()

    def schedule(self) -> None:
        """Hand the buffer to the lease thread while fewer than :data:`AHEAD` granted
        requests per pool process wait to start (or the buffer is full); else at the
        latest after :data:`MAX_DELAY`."""
        if not self.buffer:
            return
        if not self.processes:
            self.processes = self._pool_size()
        waiting = len(self.unstarted) + self.granting
        if waiting < AHEAD * self.processes or len(self.buffer) >= MAX_BATCH:
            self._send()
        elif not self.backstop_due:
            self.backstop_due = True
            self.hub.call_later(MAX_DELAY, self._backstop)

    def _backstop(self) -> None:
        self.backstop_due = False
        if self.buffer:
            self._send()

    def _send(self) -> None:
        batch, self.buffer = self.buffer[:MAX_BATCH], self.buffer[MAX_BATCH:]
        items: list[Any] = []
        requests: list[LeaseRequest] = []
        keys: set[str] = set()
        pid = os.getpid()
        for req in batch:
            key = req.request_dict[HEADER]["key"]
            if key in keys:
                items.append((req, False))  # a second message of one key: its child acquires
                continue
            keys.add(key)
            task = req.task
            unless = None
            if completions.retention(task) > 0:
                unless = completions.finished_key(req.id)
            holder = Holder(task.name, stored_task_id(req.id), req.hostname, pid)
            requests.append(LeaseRequest(key, task._ttl(), holder, unless))
            items.append((req, True))
        self.granting += len(batch)
        self.leaser.grant(items, requests)

    def _granted(self, outcome: Granted) -> None:
        items, leases, sent = outcome
        self.granting -= len(items)
        granted = iter(leases)
        for req, asked in items:
            lease = next(granted) if asked else None
            if lease is not None:
                if req.revoked():  # revoked while its batch was out
                    self.leaser.give_back(lease)
                else:
                    header = dict(req.request_dict[HEADER])
                    header[GRANTED] = {**lease.to_dict(), "at": sent}
                    req.request_dict[HEADER] = header
                    self.unstarted[req.id] = lease
            self.handle(req)
        self.schedule()

    def started(self, task_id: str) -> None:
        if self.unstarted.pop(task_id, None) is not None:
            self.schedule()

    def give_back(self, task_id: str) -> None:
        lease = self.unstarted.pop(task_id, None)
        if lease is not None:
            self.leaser.give_back(lease)

    def _pool_size(self) -> int:
        consumer = self._consumer()
        limit = getattr(getattr(consumer, "pool", None), "limit", None)
        return max(int(limit or self.app.conf.worker_concurrency or os.cpu_count() or 1), 1)

    def stop(self) -> None:
        """The worker stopped: give back the grants no pool process started, and stop
        the lease thread once it has."""
        for lease in self.unstarted.values():
            self.leaser.give_back(lease)
        self.unstarted.clear()
        self.leaser.stop()


_batchers: weakref.WeakKeyDictionary[Any, _Batcher] = weakref.WeakKeyDictionary()


def started(task_id: str) -> None:
    """A pool process accepted ``task_id`` (``GuardedRequest.on_accepted``): its
    lease is that process's now."""
    for batcher in list(_batchers.values()):
        batcher.started(task_id)


def give_back(task_id: str) -> None:
    """Release the grant of ``task_id`` that no pool process started (revoked)."""
    for batcher in list(_batchers.values()):
        batcher.give_back(task_id)


def adopt(guard: TaskGuard, granted: dict[str, Any]) -> Lease | None:
    """In the pool child: the lease the main process took for this message, renewed
    first if the message waited for :data:`STALE_FRACTION` of the ttl; ``None`` if
    it was lost meanwhile (the caller then acquires)."""
    try:
        lease = Lease.from_dict(granted)
        # This host's monotonic clock, as the main process read it when it sent the grant.
        lease.confirmed_at = float(granted["at"])
        waited = time.monotonic() - lease.confirmed_at
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring a malformed granted lease in a message: %s", exc)
        return None
    if waited < STALE_FRACTION * lease.ttl:
        return lease
    try:
        if guard.renew(lease):
            return lease
    except TaskGuardError as exc:
        log.warning("could not renew the prefetched lease on %r: %s", lease.key, exc)
    log.info("prefetched lease on %r lapsed after %.1fs in the pool; acquiring", lease.key, waited)
    return None


def _on_worker_shutdown(**_: Any) -> None:
    for batcher in list(_batchers.values()):
        batcher.stop()


worker_shutdown.connect(_on_worker_shutdown, weak=False, dispatch_uid="taskguard.prefetched")
