"""CPU time of processes, read from /proc: what the benchmark reports beside time,
because machine load moves time far more than it moves CPU.

* :func:`task_cpu_s`: one single-threaded process (a PostgreSQL backend, Redis's
  main thread), exact (``/proc/<pid>/schedstat``: nanoseconds on a CPU).
* :func:`process_cpu_s`: a whole process with its threads, including threads that
  have exited (``/proc/<pid>/stat`` utime + stime, in clock ticks: statistical,
  right on average over many ticks).
* :func:`backends`: PostgreSQL backend pids by ``application_name`` or database.
* :func:`loadavg` and :func:`run_queue_s`: how loaded the machine was.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")


def task_cpu_s(pid: int) -> float:
    """Seconds ``pid``'s main thread has spent on a CPU (0.0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def run_queue_s(pid: int) -> float:
    """Seconds ``pid``'s main thread has waited for a CPU while runnable: how much
    other load stood in its way."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def process_cpu_s(pid: int) -> float:
    """Seconds of CPU (user + system) of process ``pid`` and all its threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / HZ


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (pool processes of a worker, a server's backends)."""
    by_parent: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        by_parent.setdefault(ppid, []).append(int(name))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = by_parent.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def tree_cpu_s(pid: int, exact: bool = False) -> dict[int, float]:
    """CPU seconds of ``pid`` and each of its descendants, by pid (``exact``: each
    process's main thread from schedstat, for single-threaded servers)."""
    read = task_cpu_s if exact else process_cpu_s
    return {p: read(p) for p in (pid, *children(pid))}


def spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds between two :func:`tree_cpu_s` readings (processes that started
    in between count from zero; those that ended are lost: keep them alive)."""
    return sum(after[p] - before.get(p, 0.0) for p in after)


def backends(
    conn: Any, *, application_name: str | None = None, database: str | None = None
) -> list[int]:
    """Backend pids on ``conn``'s server with that ``application_name`` (or database)."""
    if application_name is not None:
        sql, arg = "SELECT pid FROM pg_stat_activity WHERE application_name = %s", application_name
    else:
        sql, arg = "SELECT pid FROM pg_stat_activity WHERE datname = %s", database
    return [int(r[0]) for r in conn.execute(sql, (arg,)).fetchall()]


def sum_task_cpu_s(pids: Iterable[int]) -> float:
    return sum(task_cpu_s(p) for p in pids)


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()
