"""Section 9: taskguard's compat backends against the peers' Redis backends, per call.

Each backend is called the way its peer calls it. celery-once's ``QueueOnce`` builds
its backend from the ``ONCE`` setting on every publish (``import_backend``) and calls
``raise_or_lock(key, timeout)``; celery-singleton's ``Singleton`` keeps one backend,
calls ``lock(key, task_id, expiry)`` and, when that fails, ``get(key)`` for the
task id it answers a duplicate with. A **new key** is one not taken before in this
run (each call its own key, so nothing is cleared between the timed calls); a
**duplicate** is a call on a key held throughout (``AlreadyQueued``; ``lock`` False
then ``get``). taskguard's backends run on a scratch PostgreSQL database, the
peers' on the local Redis (keys under the run's prefix, deleted at the end).

What each part costs: beside the backend calls, the same work through
:class:`~taskguard.TaskGuard` itself (``try_acquire``, ``get``) on the backends'
guard and connection; the difference is the compat layer. Every taskguard row
reports client CPU and PostgreSQL CPU per call (its connection's backend, from /proc;
the rest of its time is waiting: network, WAL flush). Every row also reports the
function calls it makes per call and every taskguard row its SQL statements per call
(calls of psycopg's ``Cursor.execute``), both counted by cProfile outside the timed
rounds: deterministic, unlike times. Measured like the pairs: one process,
interleaved rounds.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from typing import Any

from benchlib.common import Env, Row, not_run, scratch_db
from benchlib.pairs import TTL, Contestant, measure
from taskguard import TaskGuard

SECTION = "9. compat"
HOLDER = "holder-task-id"
APP_NAME = "tgbench:compat"


def rows() -> list[Row]:
    def r(id_: str, label: str, ref: str | None) -> Row:
        return Row(
            id=f"compat.{id_}", section=SECTION, label=label, unit="calls/s",
            ref=ref and f"compat.{ref}", ratio_kind="p50",
        )  # fmt: skip

    return [
        r("once_new_redis", "celery-once Redis backend: raise_or_lock, new key", None),
        r("once_new", "taskguard's celery-once backend: raise_or_lock, new key", "once_new_redis"),
        r("try_new", "part of it: TaskGuard.try_acquire, new key", "once_new"),
        r("once_dup_redis", "celery-once Redis backend: raise_or_lock, duplicate", None),
        r("once_dup", "taskguard's celery-once backend: raise_or_lock, duplicate", "once_dup_redis"),
        r("try_dup", "part of it: TaskGuard.try_acquire, held key (holder read)", "once_dup"),
        r("singleton_new_redis", "celery-singleton Redis backend: lock, new key", None),
        r("singleton_new", "taskguard's celery-singleton backend: lock, new key",
          "singleton_new_redis"),
        r("singleton_dup_redis", "celery-singleton Redis backend: duplicate (lock, get)", None),
        r("singleton_dup", "taskguard's celery-singleton backend: duplicate (lock, get)",
          "singleton_dup_redis"),
        r("get", "part of it: TaskGuard.get of the held key", "singleton_dup"),
    ]  # fmt: skip


class OnceCall(Contestant):
    """``QueueOnce.apply_async``'s part: build the backend, ``raise_or_lock``."""

    def __init__(self, row: Row, conf: dict[str, Any], prefix: str, held: bool) -> None:
        super().__init__(row)
        from celery_once import AlreadyQueued  # type: ignore[import-untyped]
        from celery_once.helpers import import_backend  # type: ignore[import-untyped]

        self.build, self.refused, self.conf = import_backend, AlreadyQueued, conf
        self.prefix, self.n, self.held = f"{prefix}{row.id}:", 0, held
        if held:
            self.build(conf).raise_or_lock(self.prefix, timeout=3600)

    def pair(self) -> None:
        backend = self.build(self.conf)
        if not self.held:
            self.n += 1
            backend.raise_or_lock(f"{self.prefix}{self.n}", timeout=int(TTL))
            return
        try:
            backend.raise_or_lock(self.prefix, timeout=int(TTL))
        except self.refused:
            return
        raise RuntimeError(f"{self.row.id}: a held key was granted")


class SingletonCall(Contestant):
    """``Singleton.apply_async``'s part: ``lock``, and ``get`` when it fails."""

    def __init__(self, row: Row, backend: Any, prefix: str, held: bool) -> None:
        super().__init__(row)
        self.backend, self.prefix, self.n, self.held = backend, f"{prefix}{row.id}:", 0, held
        if held:
            backend.lock(self.prefix, HOLDER, expiry=3600)

    def pair(self) -> None:
        self.n += 1
        if not self.held:
            if not self.backend.lock(f"{self.prefix}{self.n}", str(self.n), expiry=int(TTL)):
                raise RuntimeError(f"{self.row.id}: a new key was refused")
        elif self.backend.lock(self.prefix, str(self.n), expiry=int(TTL)):
            raise RuntimeError(f"{self.row.id}: a held key was granted")
        elif self.backend.get(self.prefix) != HOLDER:
            raise RuntimeError(f"{self.row.id}: the holder's task id did not come back")


class GuardCall(Contestant):
    """The same work through TaskGuard itself: ``try_acquire`` of a new or a held
    key, or ``get`` of a held one."""

    def __init__(self, row: Row, guard: TaskGuard, prefix: str, held_key: str | None) -> None:
        super().__init__(row)
        self.guard, self.prefix, self.n, self.held_key = guard, f"{prefix}{row.id}:", 0, held_key

    def pair(self) -> None:
        if self.held_key is None:
            self.n += 1
            if self.guard.try_acquire(f"{self.prefix}{self.n}", TTL).lease is None:
                raise RuntimeError(f"{self.row.id}: a new key was refused")
        elif self.row.id == "compat.get":
            info = self.guard.get(self.held_key)
            if info is None or not info.held:
                raise RuntimeError(f"{self.row.id}: the held key was not found held")
        elif self.guard.try_acquire(self.held_key, TTL).holder is None:
            raise RuntimeError(f"{self.row.id}: no holder came back")


def profile(c: Contestant, calls: int = 50) -> tuple[float, float]:
    """Function calls (cProfile: Python and built-in) and psycopg ``Cursor.execute``
    calls per ``c.pair()``, counted outside the timed rounds."""

    def calls_of_pair() -> None:
        for _ in range(calls):
            c.pair()

    prof = cProfile.Profile()
    prof.runcall(calls_of_pair)
    stats = pstats.Stats(prof)
    executes = sum(
        v[1]
        for (path, _, name), v in stats.stats.items()  # type: ignore[attr-defined]
        if "psycopg" in path and name == "execute"
    )
    return stats.total_calls / calls, executes / calls  # type: ignore[attr-defined]


def run(env: Env) -> list[Row]:
    from celery import Celery
    from celery_singleton.backends.redis import RedisBackend  # type: ignore[import-untyped]

    from taskguard.compat.celery_singleton import Backend as SingletonBackend

    out = rows()
    rounds, per_round, warmup = env.pick((2, 150, 20), (6, 1500, 100))
    prefix = f"{env.redis_prefix}compat:"
    with scratch_db(env, "compat") as url:
        app = Celery("tgbench_compat", set_as_current=False)
        app.conf.update(
            taskguard_engine_options={"connect_args": {"application_name": APP_NAME}},
            ONCE={"backend": "taskguard.compat.celery_once.Backend",
                  "settings": {"url": url, "default_timeout": 3600}},
            singleton_backend_class="taskguard.compat.celery_singleton.Backend",
            singleton_backend_url=url,
        )  # fmt: skip
        redis_once = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": env.redis_url, "default_timeout": 3600},
        }
        ours = app.conf.ONCE
        singleton = SingletonBackend(url)
        guard = singleton.guard  # the one both backends use: one per URL per process
        peer = RedisBackend(env.redis_url)
        makers: dict[str, Callable[[Row], Contestant]] = {
            "compat.once_new_redis": lambda row: OnceCall(row, redis_once, prefix, False),
            "compat.once_new": lambda row: OnceCall(row, ours, prefix, False),
            "compat.try_new": lambda row: GuardCall(row, guard, prefix, None),
            "compat.once_dup_redis": lambda row: OnceCall(row, redis_once, prefix, True),
            "compat.once_dup": lambda row: OnceCall(row, ours, prefix, True),
            "compat.try_dup": lambda row: GuardCall(row, guard, prefix, f"{prefix}compat.once_dup:"),
            "compat.singleton_new_redis": lambda row: SingletonCall(row, peer, prefix, False),
            "compat.singleton_new": lambda row: SingletonCall(row, singleton, prefix, False),
            "compat.singleton_dup_redis": lambda row: SingletonCall(row, peer, prefix, True),
            "compat.singleton_dup": lambda row: SingletonCall(row, singleton, prefix, True),
            "compat.get": lambda row: GuardCall(row, guard, prefix, f"{prefix}compat.singleton_dup:"),
        }  # fmt: skip
        contestants: list[Contestant] = []
        try:
            for row in out:  # in table order: the held keys exist before their parts run
                try:
                    contestants.append(makers[row.id](row))
                except Exception as exc:
                    not_run([row], f"{type(exc).__name__}: {exc}", error=True)
            for c in contestants:
                c.app_name = APP_NAME if not c.row.id.endswith("_redis") else None
            measure(contestants, rounds, per_round, warmup, admin_url=url)
            for c in (c for c in contestants if c.row.status == "ok"):
                functions, statements = profile(c)
                c.row.extra.update(function_calls=functions, statements=statements)
                c.row.note += f", {functions:.0f} function calls/call"
                if c.app_name is not None:
                    c.row.note += f", {statements:.0f} SQL statement(s)/call"
        finally:
            peer.redis.close()
            guard.dispose()
    for row in out:
        row.note = row.note.replace("us/pair", "us/call")
    return out
