"""Tasks of the tiny test project, one per behaviour under test."""

import asyncio
import threading
import time

from taskguard.contrib.django_tasks import current_lease, guarded

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

#: What the bodies saw: (name, key, token, thread) tuples.
SEEN: list[tuple[str, str, int, int]] = []


def _note(name: str) -> int:
    lease = current_lease()
    assert lease is not None
    SEEN.append((name, lease.key, lease.token, threading.get_ident()))
    return lease.token


@task()
@guarded(key="item:{item}", ttl=5)
def skipping(item: int) -> int:
    return _note("skipping")


@task()
@guarded(key="item:{item}", ttl=5, on_conflict="raise")
def raising(item: int) -> int:
    return _note("raising")


@task(takes_context=True)
@guarded(key="ctx:{item}", ttl=5)
def with_context(context, item: int) -> str:  # type: ignore[no-untyped-def]
    _note("with_context")
    return str(context.task_result.id)


@task()
@guarded(key="slow:{item}", ttl=0.6)
async def slow_async(item: int) -> int:
    await asyncio.sleep(1.5)  # longer than the ttl: renewal keeps the lease
    return _note("slow_async")


@task(key="kw:{item}", ttl=5, lock="queue_and_run", on_conflict="existing")
def by_task_kwargs(item: int) -> int:
    return _note("by_task_kwargs")


@task(backend="queue")
@guarded(key="item:{item}", ttl=5, on_conflict="retry", retry_countdown=30)
def retrying(item: int) -> int:
    return _note("retrying")


@task(backend="plain")
@guarded(key="item:{item}", lock="queue_and_run")
def queued_without_guarded_backend(item: int) -> int:
    return _note("queued_without_guarded_backend")


@task()
@guarded(key="frozen:{item}", ttl=300, lock="queue_and_run")
def queued_long(item: int) -> int:
    return _note("queued_long")


@task()
@guarded(key="lose:{item}", ttl=1, stop_on_lease_loss=True)
def losing(item: int) -> int:
    from taskguard.contrib.django_tasks import project_guard

    lease = current_lease()
    assert lease is not None
    project_guard().force_release(lease.key)  # taken away: the next renewal finds it gone
    time.sleep(5)  # interrupted by LeaseLost well before this ends
    return 0
