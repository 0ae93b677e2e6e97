"""Section 8's taskiq rows: Python lines executed per taskiq run (issue 43).

In this process, a taskiq ``Receiver`` (what ``taskiq worker`` runs per message) takes
serialized messages of three trivial async tasks: ``plain``; ``minimal``, the minimal
correct lock by hand around its body (:class:`benchlib.pairs.MinimalLock`'s upsert,
then its owner-checked delete, each on a thread as an async body must); ``guarded``, the
``taskguard`` label with its defaults (``lock="run"``, PostgreSQL). Every thread's
'line' events are counted while one message is processed (the event loop's and the
threads the lease statements run on), by the file they run in. Each task: 50 warm-up
runs, then the mean of 100. The target: guarded adds at most 1.5 x the lines the
minimal lock adds.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import uuid
from collections import Counter
from types import FrameType
from typing import Any

from benchlib import lines  # (which imports this module: names read when called)
from benchlib.common import Row

KINDS = ("plain", "minimal", "guarded")


def rows() -> list[Row]:
    def r(id_: str, label: str) -> Row:
        return Row(id=f"lines.taskiq_{id_}", section="8. lines per run", label=label, unit="lines")

    return [
        r("plain", "a plain taskiq task's run (Receiver.callback of a message)"),
        r("minimal", "lines the minimal correct lock by hand adds to a taskiq run"),
        r("guarded", "lines the taskguard label (lock='run') adds to a taskiq run"),
        r("ratio", "taskiq: guarded / minimal (added lines; target <= 1.5)"),
    ]


def measure(url: str) -> dict[str, tuple[float, dict[str, float]]]:
    """Mean lines per run of each kind (its total, and by file kind)."""
    seen: Counter[str] = Counter()
    on = threading.Event()

    def local(frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "line" and on.is_set():
            seen[lines._where(frame.f_code.co_filename)] += 1
        return local

    def tracer(frame: FrameType, event: str, _arg: Any) -> Any:
        return local

    threading.settrace(tracer)  # the threads started from now on: the lease threads
    sys.settrace(tracer)
    try:
        return asyncio.run(_runs(url, seen, on))
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]


async def _runs(url: str, seen: Counter[str], on: threading.Event) -> dict[str, Any]:
    from taskiq import InMemoryBroker, TaskiqMessage
    from taskiq.receiver import Receiver

    from benchlib.pairs import MINIMAL_ACQUIRE, MINIMAL_RELEASE, TTL, MinimalLock
    from taskguard.taskiq import TaskguardMiddleware

    broker = InMemoryBroker().with_middlewares(TaskguardMiddleware(url))
    by_hand = MinimalLock(Row("lines.taskiq_minimal", "", ""), url)
    prefix = f"tiqlines:{uuid.uuid4().hex[:8]}:"

    @broker.task(task_name="plain")
    async def plain(i: int) -> None:
        return None

    def acquire(key: str) -> str:
        owner = uuid.uuid4().hex
        by_hand.cur.execute(MINIMAL_ACQUIRE, {"key": key, "owner": owner, "ttl": TTL}, prepare=True)
        if by_hand.cur.fetchone() is None:
            raise RuntimeError(f"minimal acquire of {key} was not granted")
        return owner

    def release(key: str, owner: str) -> None:
        by_hand.cur.execute(MINIMAL_RELEASE, {"key": key, "owner": owner}, prepare=True)
        if by_hand.cur.rowcount != 1:
            raise RuntimeError(f"minimal release of {key} matched {by_hand.cur.rowcount} rows")

    @broker.task(task_name="minimal")
    async def minimal(i: int) -> None:
        key = f"{prefix}m:{i}"
        owner = await asyncio.to_thread(acquire, key)
        await asyncio.to_thread(release, key, owner)  # the body would run between

    @broker.task(task_name="guarded", taskguard={"key": prefix + "k:{i}", "ttl": 60})
    async def guarded(i: int) -> None:
        return None

    await broker.startup()
    receiver = Receiver(broker, max_async_tasks=10, run_startup=False)
    out = {}
    try:
        for kind in KINDS:
            samples = []
            for i in range(lines.WARM + lines.RUNS):
                message = TaskiqMessage(
                    task_id=uuid.uuid4().hex, task_name=kind, labels={}, args=[i], kwargs={}
                )
                data = broker.formatter.dumps(message).message
                seen.clear()
                on.set()
                await receiver.callback(data, raise_err=True)
                on.clear()
                samples.append(Counter(seen))
            out[kind] = lines._mean(samples[lines.WARM :])
    finally:
        await broker.shutdown()
        by_hand.close()
    return out


def fill(rows_: list[Row], runs: dict[str, tuple[float, dict[str, float]]]) -> None:
    by_id = {r.id: r for r in rows_}
    plain_total, plain_by = runs["plain"]
    by_id["lines.taskiq_plain"].rate = plain_total
    added = {}
    for kind in KINDS[1:]:
        total, by = runs[kind]
        added[kind] = total - plain_total
        row = by_id[f"lines.taskiq_{kind}"]
        row.rate, row.note = added[kind], "added, by file: " + lines._split(by, plain_by)
    ratio = by_id["lines.taskiq_ratio"]
    ratio.rate, ratio.unit = added["guarded"] / added["minimal"], "x"


if __name__ == "__main__":  # cd scripts && python -m benchlib.lines_taskiq URL (migrated)
    out = rows()
    fill(out, measure(sys.argv[1]))
    for r in out:
        print(f"{r.label}: {r.rate:.1f} {r.unit}  {r.note}")
