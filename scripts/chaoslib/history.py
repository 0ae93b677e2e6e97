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

What :func:`check` verifies, each counted as violations with examples:

* ``token_reused``  - a fencing token handed out twice (any key);
* ``token_order``   - per key, grants ordered by database grant time must carry
  strictly increasing tokens;
* ``overlap``       - per key, ordered by token, a grant starts before an earlier
  grant ended. A grant ends at its release (exact database time when known, else
  a database time at which it was still held, which can only hide an overlap, never
  invent one) or at its expiry after its last successful renewal;
* ``stale_owner``   - a release or renewal by an owner whose lease had already
  expired by the database clock affected a row;
* ``fence_order``   - per key, accepted fenced writes in commit order (the counter
  they wrote) must carry strictly increasing tokens and counters 1, 2, 3, ...;
* ``counter``       - the resource's final counter must lie between the
  acknowledged increments and those plus the ones whose outcome is unknown;
* ``db_token``      - a row left in ``task_locks`` must carry a token at least the
  highest one the history granted on that key.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import pairwise
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


@dataclass
class _Grant:
    key: str
    owner: str
    token: int
    acquired: int
    expires: int
    released_exact: int | None = None
    released_lower: int | None = None


@dataclass
class Report:
    """Figures and violations of one history."""

    counts: Counter[str] = field(default_factory=Counter)
    violations: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def violate(self, kind: str, detail: str) -> None:
        self.counts[f"violations.{kind}"] += 1
        if len(self.violations[kind]) < 20:
            self.violations[kind].append(detail)

    @property
    def total_violations(self) -> int:
        return sum(v for k, v in self.counts.items() if k.startswith("violations."))

    def summary(self) -> str:
        lines = [f"  {k}: {v}" for k, v in sorted(self.counts.items())]
        for kind, examples in self.violations.items():
            lines.append(f"  {kind} examples:")
            lines += [f"    {e}" for e in examples[:5]]
        return "\n".join(lines)


def check(
    events: Iterable[list[Any]],
    *,
    counters: dict[str, int] | None = None,
    db_tokens: dict[str, int] | None = None,
) -> Report:
    """Check ``events``; ``counters`` (resource value per key) and ``db_tokens``
    (token of each ``task_locks`` row) are the final database state, if known."""
    rep = Report()
    grants: dict[str, _Grant] = {}
    writes: dict[str, list[tuple[int, int]]] = defaultdict(list)
    acked: Counter[str] = Counter()
    unknown_writes: Counter[str] = Counter()
    for ev in events:
        kind = ev[0]
        rep.counts[f"events.{kind}"] += 1
        if kind == "G":
            _, _w, key, owner, token, acq, exp = ev
            grants[owner] = _Grant(key, owner, int(token), int(acq), int(exp))
        elif kind == "N":
            _, _w, owner, ok, exp = ev
            if ok:
                grants[owner].expires = int(exp)
        elif kind == "R":
            _, _w, owner, ok, lower, exact = ev
            g = grants[owner]
            if ok is not False:  # True, or unknown: it may have ended here
                g.released_lower = int(lower)
                if ok and exact is not None:
                    g.released_exact = int(exact)
                    rep.counts["releases.exact_time"] += 1
                else:
                    rep.counts["releases.lower_bound_only"] += 1
        elif kind == "S":
            _, _w, owner, op, ok = ev
            rep.counts[f"stale_{op}.checked"] += 1
            if ok:
                rep.violate("stale_owner", f"{op} by expired owner {owner} affected a row")
        elif kind == "W":
            _, _w, key, token, accepted, counter, _ts = ev
            if accepted:
                acked[key] += 1
                writes[key].append((int(counter), int(token)))
            elif accepted is None:
                unknown_writes[key] += 1
            else:
                rep.counts["writes.rejected_stale_token"] += 1
    rep.counts["grants"] = len(grants)
    rep.counts["writes.acknowledged"] = sum(acked.values())
    rep.counts["writes.unknown"] = sum(unknown_writes.values())
    _check_grants(rep, grants)
    _check_writes(rep, writes, unknown_writes)
    if counters is not None:
        for key in set(counters) | set(acked):
            value = counters.get(key, 0)
            if not acked[key] <= value <= acked[key] + unknown_writes[key]:
                rep.violate(
                    "counter",
                    f"{key}: counter {value}, acknowledged {acked[key]}, unknown {unknown_writes[key]}",
                )
    if db_tokens is not None:
        top: dict[str, int] = {}
        for g in grants.values():
            top[g.key] = max(top.get(g.key, 0), g.token)
        for key, token in db_tokens.items():
            if key in top and token < top[key]:
                rep.violate("db_token", f"{key}: row token {token} < granted {top[key]}")
    return rep


def _check_grants(rep: Report, grants: dict[str, _Grant]) -> None:
    tokens = Counter(g.token for g in grants.values())
    for token, n in tokens.items():
        if n > 1:
            rep.violate("token_reused", f"token {token} granted {n} times")
    per_key: dict[str, list[_Grant]] = defaultdict(list)
    for g in grants.values():
        per_key[g.key].append(g)
    rep.counts["keys"] = len(per_key)
    for key, gs in per_key.items():
        by_time = sorted(gs, key=lambda g: (g.acquired, g.token))
        for a, b in pairwise(by_time):
            if b.token <= a.token:
                rep.violate(
                    "token_order",
                    f"{key}: token {b.token} granted at {b.acquired} after token {a.token} at {a.acquired}",
                )
        by_token = sorted(gs, key=lambda g: g.token)
        latest_end, latest = None, None
        for g in by_token:
            if latest_end is not None and g.acquired < latest_end and latest is not None:
                rep.violate(
                    "overlap",
                    f"{key}: token {g.token} from {g.acquired} overlaps token {latest.token} "
                    f"live until {latest_end} ({latest_end - g.acquired} us)",
                )
            end = _end(g)
            if latest_end is None or end > latest_end:
                latest_end, latest = end, g
        rep.counts["pairs_checked"] += max(0, len(gs) - 1)


def _end(g: _Grant) -> int:
    if g.released_exact is not None:
        return min(g.released_exact, g.expires)
    if g.released_lower is not None:
        return min(g.released_lower, g.expires)
    return g.expires


def _check_writes(
    rep: Report, writes: dict[str, list[tuple[int, int]]], unknown: Counter[str]
) -> None:
    for key, ws in writes.items():
        ws.sort()
        counters = [c for c, _ in ws]
        # Every acknowledged write wrote a distinct value; the only values missing
        # between 1 and the last are writes whose acknowledgement was lost.
        missing = counters[-1] - len(set(counters))
        if len(set(counters)) != len(counters) or missing > unknown[key]:
            rep.violate(
                "fence_order",
                f"{key}: counters {counters[:8]}... ({missing} missing, {unknown[key]} unknown)",
            )
        for (c1, t1), (c2, t2) in pairwise(ws):
            if t2 <= t1:
                rep.violate("fence_order", f"{key}: write #{c2} token {t2} after #{c1} token {t1}")
