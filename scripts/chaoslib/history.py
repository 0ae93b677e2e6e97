"""The history every worker records: one JSON list per line, one file per worker.

Times are microseconds since the epoch **by the database clock** (taken from
``RETURNING`` or a statement's own timestamp), never the client's clock.

Events (first element is the kind):

``["G", w, key, owner, token, acquired_us, expires_us]``  a grant
``["N", w, owner, ok, expires_us]``                       a renewal (ok: True/False/None=unknown)
``["R", w, owner, ok, lower_us, exact_us]``               a release; ``exact_us`` is its
    database time when a read-back still found our row, else ``None``; ``lower_us``
    is a database time at which the lease was still ours (the release came later)
``["S", w, owner, op, ok]``  release/renew by an owner whose lease had expired by the
    database clock (ok must be False)
``["W", w, key, token, accepted, counter, ts_us]``  a fenced write to the resource
    (accepted: True/False/None=unknown; counter: the value it wrote)
``["U", w, key, what]``  an outcome reported unknown (OutcomeUnknown)
``["E", w, what]``       a DatabaseUnavailable the worker rode out
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def us(dt: datetime) -> int:
    """A timezone-aware datetime as integer microseconds since the epoch."""
    delta = dt - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


class Recorder:
    """Appends events for one worker; buffered, flushed every ``flush_every`` events."""

    def __init__(self, path: Path, worker: int, flush_every: int = 2000) -> None:
        self.worker = worker
        self._fh: IO[str] = path.open("a", encoding="utf-8")
        self._buf: list[str] = []
        self._flush_every = flush_every

    def add(self, kind: str, *fields: Any) -> None:
        self._buf.append(json.dumps([kind, self.worker, *fields], separators=(",", ":")))
        if len(self._buf) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            self._fh.write("\n".join(self._buf) + "\n")
            self._fh.flush()
            self._buf.clear()

    def close(self) -> None:
        self.flush()
        self._fh.close()


def read_history(directory: Path) -> Iterator[list[Any]]:
    """Every event from every ``*.jsonl`` file under ``directory``."""
    for path in sorted(directory.glob("*.jsonl")):
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    yield json.loads(line)
