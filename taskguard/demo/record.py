"""What the demo measures: every execution of the task body, with its start and
end time, recorded by the body itself.

The "max at once" figures are computed from these intervals after the fact, so
the demo reports what happened rather than what the lock promised.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Run", "RunLog", "max_concurrency"]


@dataclass(frozen=True, slots=True)
class Run:
    """One execution of the task body."""

    feed: str
    task_id: str | None
    started: float
    ended: float
    #: Fencing token of the lease the run held (None when run without taskguard).
    token: int | None = None


def max_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """The largest number of ``(start, end)`` intervals open at one instant.

    An interval ending at the very instant another starts does not overlap it: the
    first run returned (and released its lock) before the second one began.
    """
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((end, -1))
    # At equal times the end (-1) sorts before the start (+1).
    events.sort()
    current = peak = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


class RunLog:
    """Thread-safe record of body executions, readable while they happen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: list[Run] = []
        self._open: dict[str, int] = {}
        self._peak: dict[str, int] = {}

    @contextmanager
    def running(self, feed: str, task_id: str | None, token: int | None = None) -> Iterator[None]:
        """Record one execution of the body for ``feed`` around the ``with`` block."""
        with self._lock:
            started = time.monotonic()
            now_open = self._open.get(feed, 0) + 1
            self._open[feed] = now_open
            self._peak[feed] = max(self._peak.get(feed, 0), now_open)
        try:
            yield
        finally:
            with self._lock:
                self._open[feed] -= 1
                self._runs.append(Run(feed, task_id, started, time.monotonic(), token))

    def running_now(self) -> dict[str, int]:
        """Feeds with an execution in progress, and how many."""
        with self._lock:
            return {feed: n for feed, n in self._open.items() if n}

    def live_peak(self) -> dict[str, int]:
        """Most executions seen in progress at once per feed, counted as they started."""
        with self._lock:
            return dict(self._peak)

    def runs(self) -> list[Run]:
        """Finished executions, in the order they ended."""
        with self._lock:
            return list(self._runs)

    def peak_by_feed(self) -> dict[str, int]:
        """Max concurrent executions per feed, from the recorded start/end times."""
        by_feed: dict[str, list[tuple[float, float]]] = {}
        for run in self.runs():
            by_feed.setdefault(run.feed, []).append((run.started, run.ended))
        return {feed: max_concurrency(spans) for feed, spans in by_feed.items()}
