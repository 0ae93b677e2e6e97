"""The reaper's walk over ended rows: one short transaction per batch, in the order
the dialect says (:meth:`Dialect.reap_start`, :meth:`Dialect.reap_step`), so a
large table is never locked or scanned in one statement."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from taskguard.dialects import Dialect, LockSQL, Statement
from taskguard.store.events import EventLog

__all__ = ["reap"]


def reap(
    run: Callable[[Statement, dict[str, Any]], tuple[list[tuple[Any, ...]], int]],
    sql: LockSQL,
    dialect: Dialect,
    history: EventLog | None,
    grace: float,
    batch_size: int,
    max_batches: int | None,
    progress: Callable[[int], Any] | None,
) -> tuple[int, int]:
    """Delete rows whose lease ended more than ``grace`` seconds ago (recording
    ``reaped`` events in ``history`` when given); (removed, batches)."""
    stmt = sql.reap_batch if history is None else sql.reap_batch_history
    after = dialect.reap_start()
    removed = batches = 0
    while max_batches is None or batches < max_batches:
        values = {**after, "grace": dialect.seconds_param(-grace), "batch_size": batch_size}
        rows, _ = run(stmt, values)
        batches += 1
        step = dialect.reap_step(rows, after)
        after = step.after
        if step.reaped and history is not None:
            history.reaped(step.reaped)
        removed += step.deleted
        if progress is not None:
            progress(removed)
        if step.scanned < batch_size:
            break
    return removed, batches
