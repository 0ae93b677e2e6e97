"""Many single-slot grants in one statement (where the dialect has one): one round
trip and one commit for a Celery worker's prefetched messages instead of one per
message (:meth:`taskguard.TaskGuard.acquire_many`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from taskguard.deadline import bounded
from taskguard.dialects import LockSQL
from taskguard.exceptions import DatabaseUnavailable, OutcomeUnknown
from taskguard.lease import Lease, Marker
from taskguard.store.connections import Executor

__all__ = ["Batches"]

log = logging.getLogger("taskguard")

_FIELDS = ("key", "owner", "ttl", "task_name", "task_id", "hostname", "pid", "unless")
#: Batches are padded up to one of these lengths: a handful of prepared statements.
SIZES = (1, 2, 4, 8, 16, 32, 64)


class Batches:
    """The batch side of one :class:`~taskguard.store.Store`."""

    def __init__(
        self,
        db: Executor,
        sql: LockSQL,
        call_timeout: float,
        marker_values: Callable[[Marker], dict[str, Any]],
    ) -> None:
        self._db = db
        self._sql = sql
        #: Seconds one batch (with its retry or give-back) may take.
        self.call_timeout = call_timeout
        self._marker_values = marker_values  # the single release's marker parameters

    @property
    def one_statement(self) -> bool:
        """Whether :meth:`grant` and :meth:`release` send one statement (else the
        caller loops)."""
        sql = self._sql
        pipelines = self._db.dialect.pipelines
        return sql.acquire_many is not None and sql.release_marking is not None and pipelines

    @bounded
    def grant(self, batch: list[dict[str, Any]], seconds: list[float]) -> list[Lease | None]:
        """Grant what is free of ``batch`` (parameters as ``Store.grant_values``
        makes them, slot 0, each key once) in one statement: the leases, ``None``
        where refused. If the connection broke with the statement sent, the batch's
        owners give back whatever it may have granted (so the outcome is known:
        nothing held); if even that fails, :class:`~taskguard.OutcomeUnknown`."""
        assert self._sql.acquire_many is not None, "no batch acquire (see one_statement)"
        if len(batch) > SIZES[-1]:
            head = SIZES[-1]
            return self.grant(batch[:head], seconds[:head]) + self.grant(
                batch[head:], seconds[head:]
            )
        size, params = _rows(batch, _FIELDS)
        sent = time.monotonic()
        try:
            rows, _ = self._db.run(self._sql.acquire_many(size), params)
        except DatabaseUnavailable as exc:
            if not exc.statement_sent:
                raise
            self._give_back(batch, exc)
            return [None] * len(batch)
        conv = self._db.dialect.to_datetime
        got = {(key, owner): (token, at, until) for key, owner, token, at, until in rows}
        out: list[Lease | None] = []
        for values, ttl in zip(batch, seconds, strict=True):
            row = got.get((values["key"], values["owner"]))
            if row is None:
                out.append(None)
                continue
            token_, at, until = row
            out.append(
                Lease(
                    values["key"], values["owner"], int(token_), conv(at), conv(until), ttl,
                    confirmed_at=sent,
                )
            )  # fmt: skip
        return out

    def _give_back(self, batch: list[dict[str, Any]], cause: DatabaseUnavailable) -> None:
        log.warning(
            "connection to %s broke during a batch of %d grants; giving back what it "
            "may have granted",
            self._db.url,
            len(batch),
        )
        for values in batch:
            mine = {"key": values["key"], "slot": 0, "owner": values["owner"]}
            try:
                self._db.run(self._sql.release, mine)
            except DatabaseUnavailable:
                raise OutcomeUnknown(
                    f"connection to {self._db.url} broke during a batch of grants and "
                    f"{values['key']!r} could not be given back; owner {values['owner']} "
                    "may hold it until its ttl ends",
                    values["key"],
                    values["owner"],
                    self._db.url,
                ) from cause

    @bounded
    def release(self, batch: list[tuple[Lease, Marker | None]]) -> list[bool]:
        """End each single-slot lease of ``batch`` its owner still holds and take its
        marker (each marker key once): pipelined, one round trip and one transaction
        for those with a marker and one for those without, each execution the single
        release's own statement and plan; whether each ended. A pipeline whose
        connection broke is sent once more (ending by owner and taking a live marker
        are idempotent; a retried release then reports False for what the first
        attempt ended)."""
        marking = self._sql.release_marking
        assert marking is not None, "no release with a marker (see one_statement)"
        plain: list[dict[str, Any]] = []
        marked: list[dict[str, Any]] = []
        for lease, marker in batch:
            values: dict[str, Any] = {"key": lease.key, "slot": 0, "owner": lease.owner}
            if marker is None:
                plain.append(values)
            else:
                marked.append({**values, **self._marker_values(marker)})
        ended: dict[str, int] = {}
        for stmt, rows in ((self._sql.release, plain), (marking, marked)):
            if rows:
                try:
                    counts = self._db.run_many(stmt, rows)
                except DatabaseUnavailable as exc:
                    if not exc.statement_sent:
                        raise
                    counts = self._db.run_many(stmt, rows)
                ended.update((r["owner"], n) for r, n in zip(rows, counts, strict=True))
        return [ended.get(lease.owner) == 1 for lease, _ in batch]


def _rows(batch: list[dict[str, Any]], fields: tuple[str, ...]) -> tuple[int, dict[str, Any]]:
    """The padded length for ``batch`` and its parameters (``<field>_<row>``); the
    padding rows are all NULL."""
    size = next(n for n in SIZES if n >= len(batch))
    params: dict[str, Any] = {}
    for i in range(size):
        values = batch[i] if i < len(batch) else None
        for name in fields:
            params[f"{name}_{i}"] = values[name] if values is not None else None
    return size, params
