"""Many leases per statement: :meth:`TaskGuard.acquire_many` and
:meth:`TaskGuard.release_many` (a mixin of :class:`~taskguard.TaskGuard`). One
statement each where the dialect has one (PostgreSQL); one call per lease
elsewhere, with the same results."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from taskguard.exceptions import InvalidArgument
from taskguard.keys import normalize_key, validate_holder, validate_marker, validate_ttl
from taskguard.lease import Attempt, Holder, Lease, LeaseRequest, Marker
from taskguard.store import Store

__all__ = ["BatchOperations"]

log = logging.getLogger("taskguard")


class BatchOperations:
    """The batch half of :class:`~taskguard.TaskGuard`'s lease API."""

    _store: Store
    hostname: str
    history: bool
    if TYPE_CHECKING:  # TaskGuard's own, for the one-by-one fallbacks
        try_acquire: Callable[..., Attempt]
        release: Callable[..., bool]

    @property
    def batches_in_one_statement(self) -> bool:
        """Whether :meth:`acquire_many` and :meth:`release_many` send one statement
        (else one per lease)."""
        return self._store.batches.one_statement

    def acquire_many(self, requests: Sequence[LeaseRequest]) -> list[Lease | None]:
        """Several single-slot grants, each key once, in one statement and one
        commit on PostgreSQL: a lease per request, ``None`` where the key was held
        (or its ``unless`` key was). The holders of refused keys are not read: ask
        :meth:`try_acquire` for one."""
        keys = [normalize_key(r.key) for r in requests]
        if len(set(keys)) != len(keys):
            twice = next(k for k in keys if keys.count(k) > 1)
            raise InvalidArgument(
                f"acquire_many: key {twice!r} appears twice in one batch; pass each key once",
                "key",
                twice,
            )
        if not self.batches_in_one_statement:
            return [
                self.try_acquire(r.key, r.ttl, unless=r.unless, **_details(r.holder)).lease
                for r in requests
            ]
        store = self._store
        batch: list[dict[str, Any]] = []
        seconds: list[float] = []
        for r, key in zip(requests, keys, strict=True):
            ttl = validate_ttl(r.ttl)
            h = r.holder
            validate_holder(h.task_name, h.task_id, h.hostname, h.pid, 0)
            holder = Holder(
                h.task_name,
                h.task_id,
                h.hostname if h.hostname is not None else self.hostname,
                h.pid if h.pid is not None else os.getpid(),
            )
            unless = None if r.unless is None else normalize_key(r.unless)
            batch.append(store.grant_values(key, 0, uuid.uuid4().hex, ttl, holder, 1, unless))
            seconds.append(ttl)
        leases = store.batches.grant(batch, seconds)
        for lease, values in zip(leases, batch, strict=True):
            if lease is None:
                log.debug("lock %r not granted in a batch of %d", values["key"], len(batch))
            elif self.history:
                store.history.acquired(lease, values, None, "granted in a batch")
        return leases

    def release_many(self, items: Sequence[tuple[Lease, Marker | None]]) -> list[bool]:
        """:meth:`release` for each ``(lease, marker)`` (marker may be ``None``), in
        one statement on PostgreSQL: ``True`` where that call ended the lease. A
        lease with a throttle window or a slot, and a marker key already taken by an
        earlier item, go through :meth:`release` one by one."""
        if not self.batches_in_one_statement:
            return [self.release(lease, marker=marker) for lease, marker in items]
        batch: list[tuple[Lease, Marker | None]] = []
        batched: list[int] = []
        marks: set[str] = set()
        out = [False] * len(items)
        for i, (lease, given) in enumerate(items):
            marker = None if given is None else validate_marker(given, lease.key, self.hostname)
            if lease.min_hold or lease.slot or (marker is not None and marker.key in marks):
                out[i] = self.release(lease, marker=marker)  # records its own history
                continue
            if marker is not None:
                marks.add(marker.key)
            batch.append((lease, marker))
            batched.append(i)
        if batch:
            ended = self._store.batches.release(batch)
            for i, (lease, _), done in zip(batched, batch, ended, strict=True):
                out[i] = done
                if self.history:
                    self._store.history.ended(lease, "released" if done else "lost", "at release")
        return out


def _details(holder: Holder) -> dict[str, Any]:
    return {
        "task_name": holder.task_name,
        "task_id": holder.task_id,
        "hostname": holder.hostname,
        "pid": holder.pid,
    }
