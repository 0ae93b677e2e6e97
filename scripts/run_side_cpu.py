#!/usr/bin/env python3
"""The Python a guarded task adds to a run, without its lock statements.

    python scripts/run_side_cpu.py [--tasks 4000] [--rounds 10] [--stub hb,ctx,...]
                                   [--driver] [--profile N]

Runs a plain and a ``@guarded_task(lock="run")`` trivial task through Celery's own
tracer (what a pool child calls per message) in this process, with the guard's
statements answered by canned values: what is left is taskguard's run side (key,
header, lease bookkeeping, heartbeat, signals). With ``--driver`` the guard's own
Python runs too (validation, the store, the executor, the statement watchdog): only
the database driver's cursor answers from memory. ``--profile N`` prints a cProfile
of N guarded runs instead. Prints the minimum CPU µs per task
over the rounds (the minimum is what other load on the machine cannot inflate),
which ``scripts/e2e_cpu.py`` cannot resolve: its pool-child column moves by ±50 µs
from run to run. No services are needed.

The figure is warm (the same code over and over); in a real pool child, where
every task follows a wait for the broker and the database, the same code costs
several times more (docs/benchmarks.md).

``--stub`` replaces parts of the run side with no-ops to see what each costs:
``hb`` (heartbeat), ``ctx`` (the active-run context variable), ``sig``
(lock_acquired/lock_released sends), ``hdr`` (header and key), ``acq`` (the
acquire wrapper: holder details, retry on a vanished holder).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import socket
import time
import uuid
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

from celery import Celery
from celery.app.trace import build_tracer

from taskguard import TaskGuard, guarded_task, signals
from taskguard.celery import running
from taskguard.config import guard_for
from taskguard.lease import Attempt, Lease

NOW = datetime.now(timezone.utc)


class _NoHeartbeat:
    def __init__(self, *_: Any) -> None:
        pass

    def start(self) -> _NoHeartbeat:
        return self

    def stop(self) -> None:
        pass


def _stub(parts: set[str]) -> None:
    if "hb" in parts:
        running.Heartbeat = _NoHeartbeat  # type: ignore[assignment,misc]
    if "ctx" in parts:
        running.enter_run = lambda run: None  # type: ignore[assignment,return-value]
    if "sig" in parts:
        signals.lock_acquired.send = lambda **_: []  # type: ignore[method-assign]
        running.send_released = lambda *_: None
    if "hdr" in parts:
        running.header_of = lambda request: {"v": 1, "key": "k", "via": "enqueue"}
        running.message_key = lambda opts, header, args, kwargs: "k"
    if "acq" in parts:
        running._acquire = lambda task, guard, request, key, ttl, track: (  # type: ignore[assignment]
            guard.try_acquire(key, ttl).lease,
            None,
            None,
        )


class _Cursor:
    """A DBAPI cursor answering from memory: a grant for a statement with RETURNING
    (the acquires), one row affected by anything else (the releases)."""

    description = None

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.rowcount = 0

    def execute(self, sql: str, params: Any = None) -> None:
        self.rows = [(1, NOW, NOW + timedelta(seconds=60))] if "RETURNING" in sql else []
        self.rowcount = 1

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self.rows


def _driver_in_memory(guard: TaskGuard) -> None:
    """The guard's pinned connection, with a cursor that answers from memory (and a
    real socket for the statement watchdog to watch)."""
    sock, _peer = socket.socketpair()
    _SOCKETS.extend((sock, _peer))
    dbapi = SimpleNamespace(pgconn=SimpleNamespace(socket=sock.fileno()))
    pinned = SimpleNamespace(cursor=_Cursor(), conn=SimpleNamespace(dbapi_connection=dbapi))
    executor = guard._store._db
    executor._pin_limit = 1
    executor._pinned_connection = lambda: pinned  # type: ignore[method-assign]


_SOCKETS: list[socket.socket] = []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=4000, help="tasks per round and variant")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--stub", default="", help="comma-separated: hb,ctx,sig,hdr,acq")
    p.add_argument(
        "--driver",
        action="store_true",
        help="run the guard's own Python too; only the driver's cursor answers from memory",
    )
    p.add_argument("--profile", type=int, metavar="N", help="cProfile N guarded runs instead")
    args = p.parse_args()

    app = Celery("run_side_cpu", broker="memory://")
    app.conf.update(
        task_ignore_result=True,
        taskguard_database_url="postgresql+psycopg://nobody@127.0.0.1:1/unused",
    )

    @app.task(name="plain")
    def plain(i: int) -> None:
        return None

    @guarded_task(app=app, key="k:{i}", ttl=60, lock="run", name="guarded")
    def guarded(i: int) -> None:
        return None

    app.finalize()
    guard = guard_for(app)  # built lazily: no connection is made
    if args.driver:
        _driver_in_memory(guard)
    else:
        guard.try_acquire = lambda key, ttl, **_: Attempt(  # type: ignore[method-assign]
            Lease(key, "owner", 1, NOW, NOW, ttl), None
        )
        guard.release = lambda lease, **_: True  # type: ignore[method-assign]
    _stub({s for s in args.stub.split(",") if s})

    def run(name: str, n: int) -> float:
        task = app.tasks[name]
        tracer = build_tracer(name, task, app=app, eager=False, hostname="w@h")
        calls = []
        for i in range(n):
            tid = str(uuid.uuid4())
            request: dict[str, Any] = {"id": tid, "task": name, "hostname": "w@h"}
            request.update(headers=None, is_eager=False, retries=0, root_id=tid)
            if name == "guarded":  # as published: the key travels in the header
                request["taskguard"] = {"v": 1, "key": f"k:{i}", "via": "enqueue"}
            calls.append((tid, (i,), request))
        c0 = time.process_time()
        for tid, targs, request in calls:
            tracer(tid, targs, {}, request)
        return (time.process_time() - c0) * 1e6 / n

    run("plain", 500)
    run("guarded", 500)
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(run, "guarded", args.profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        return 0
    plains, guardeds = [], []
    for _ in range(args.rounds):
        plains.append(run("plain", args.tasks))
        guardeds.append(run("guarded", args.tasks))
    p_min, g_min = min(plains), min(guardeds)
    print(f"plain {p_min:.1f}  guarded {g_min:.1f}  run side {g_min - p_min:.1f} CPU us/task")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
