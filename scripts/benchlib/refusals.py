"""Section 6: a refused acquire, the unit a duplicate storm is made of.

Each contestant's ``pair()`` here is one attempt on a key that is held (set up
before the clock starts), reporting who holds it, the way each library does when a
duplicate is submitted: taskguard's ``try_acquire`` returns the holder (and logs
it); celery-once's ``raise_or_lock`` raises ``AlreadyQueued`` with the lock's
remaining time (a ``SET NX``, then a ``PTTL``); celery-singleton's ``lock`` fails and
``Singleton`` then reads the holder's task id (a ``SET NX``, then a ``GET``).
Measured like the pairs (interleaved rounds, one process).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import ExitStack

from benchlib.common import Env, Row, maria_scratch_db, scratch_db
from benchlib.pairs import TTL, UNNAMED, Contestant, measure_rows
from taskguard import TaskGuard


def rows() -> list[Row]:
    """The rows of this section, in table order."""

    def r(id_: str, label: str, ref: str | None) -> Row:
        return Row(
            id=f"refusal.{id_}",
            section="6. refusals",
            label=label,
            unit="refusals/s",
            ref=ref and f"refusal.{ref}",
        )

    return [
        r("celery_once", "celery-once raise_or_lock on a held key (SET NX, PTTL)", None),
        r("celery_singleton", "celery-singleton lock + holder's task id (SET NX, GET)", None),
        r("taskguard", "taskguard try_acquire on a held key, holder returned", "celery_once"),
        r(
            "taskguard_unnamed",
            "same, unnamed statements (as via a pooler: acquire, then holder read)",
            "taskguard",
        ),
        r("maria_taskguard", "same on MariaDB (holder in the upsert's RETURNING)", "taskguard"),
    ]


class GuardRefusal(Contestant):
    """``try_acquire`` of a key another owner holds; the holder must come back."""

    def __init__(self, row: Row, url: str, **engine_kwargs: object) -> None:
        super().__init__(row)
        connect_args = dict(engine_kwargs.pop("connect_args", {}))  # type: ignore[call-overload]
        if url.startswith("postgresql"):
            self.app_name = connect_args["application_name"] = f"tgbench:{row.id}"
        self.guard = TaskGuard(url, connect_args=connect_args, **engine_kwargs)
        self.key = f"bench:refusal:{row.id}"
        if self.guard.acquire(self.key, 3600, task_name="bench.holder") is None:
            raise RuntimeError(f"could not take {self.key} for the refusals")

    def pair(self) -> None:
        attempt = self.guard.try_acquire(self.key, TTL, task_name="bench.duplicate")
        if attempt.lease is not None or attempt.holder is None:
            raise RuntimeError(f"{self.key} was not refused with its holder: {attempt}")

    def close(self) -> None:
        self.guard.dispose()


class CeleryOnceRefusal(Contestant):
    def __init__(self, row: Row, env: Env) -> None:
        super().__init__(row)
        from celery_once import AlreadyQueued
        from celery_once.backends import Redis

        self.backend = Redis({"url": env.redis_url, "default_timeout": 3600})
        self.refused = AlreadyQueued
        self.key = f"{env.redis_prefix}refusal:once"
        self.backend.raise_or_lock(self.key, timeout=3600)

    def pair(self) -> None:
        try:
            self.backend.raise_or_lock(self.key, timeout=int(TTL))
        except self.refused as exc:
            if exc.countdown <= 0:
                raise RuntimeError("celery-once refused without the lock's remaining time") from exc
        else:
            raise RuntimeError("celery-once granted a held key")

    def close(self) -> None:
        self.backend.clear_lock(self.key)


class CelerySingletonRefusal(Contestant):
    def __init__(self, row: Row, env: Env) -> None:
        super().__init__(row)
        from celery_singleton.backends.redis import RedisBackend

        self.backend = RedisBackend(env.redis_url)
        self.key = f"{env.redis_prefix}refusal:singleton"
        self.backend.lock(self.key, "holder-task-id", expiry=3600)

    def pair(self) -> None:
        if self.backend.lock(self.key, uuid.uuid4().hex, expiry=int(TTL)):
            raise RuntimeError("celery-singleton granted a held key")
        if self.backend.get(self.key) is None:
            raise RuntimeError("celery-singleton's holder vanished")

    def close(self) -> None:
        self.backend.unlock(self.key)


def run(env: Env) -> list[Row]:
    out = rows()
    rounds, per_round, warmup = env.pick((2, 150, 20), (6, 1500, 100))
    with ExitStack() as stack:
        url = stack.enter_context(scratch_db(env, "refusals"))
        maria = stack.enter_context(maria_scratch_db(env, "refusals"))
        makers: dict[str, Callable[[Row], Contestant]] = {
            "refusal.celery_once": lambda row: CeleryOnceRefusal(row, env),
            "refusal.celery_singleton": lambda row: CelerySingletonRefusal(row, env),
            "refusal.taskguard": lambda row: GuardRefusal(row, url),
            "refusal.taskguard_unnamed": lambda row: GuardRefusal(row, url, **UNNAMED),
            "refusal.maria_taskguard": lambda row: GuardRefusal(row, maria),
        }
        measure_rows(out, makers, rounds, per_round, warmup, admin_url=url)
    for row in out:
        if row.status == "ok":
            row.note = row.note.replace("us/pair", "us/refusal")
    return out
