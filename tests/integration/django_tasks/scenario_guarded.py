"""Run with tinysite's settings: exercises @guarded and GuardedBackend in-process
(ImmediateBackend) and prints one JSON line of what it saw."""

import asyncio
import json
import os
import sqlite3
import threading

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.utils.timezone import now  # noqa: E402
from tinytasks import tasks  # noqa: E402

from taskguard.contrib.django_tasks import guarded, is_skipped, project_guard  # noqa: E402
from taskguard.contrib.django_tasks.framework import task_backends  # noqa: E402
from taskguard.exceptions import ConfigurationError  # noqa: E402

call_command("migrate", verbosity=0)
guard = project_guard()
out: dict[str, object] = {}
out["inner_options"] = task_backends["default"].options == {"seen_by": "the real backend"}

# A free key: the body runs with its lease; the lease is released after.
r = tasks.skipping.enqueue(1)
out["ran"] = r.status == "SUCCESSFUL" and r.return_value >= 1
out["released"] = not guard.get("item:1").held

# A held key: skipped (marker naming the holder) / failed with AlreadyLocked.
held = guard.acquire("item:1", 30, task_name="someone.else")
r = tasks.skipping.enqueue(1)
out["skipped"] = is_skipped(r.return_value) and r.return_value["holder"]["owner"] == held.owner
r = tasks.raising.enqueue(1)
out["raised"] = r.status == "FAILED" and r.errors[0].exception_class.__name__ == "AlreadyLocked"
# on_conflict="retry" where the backend can defer: the job ends, a new one waits 30 s.
r = tasks.retrying.enqueue(1)
call_command("db_worker", "--batch", "--backend", "queue", "--no-startup-delay", "--no-reload")
r.refresh()
again = tasks.retrying.get_result(r.return_value["retry_id"])
wait = (again.task.run_after - now()).total_seconds() if again.task.run_after else None
out["deferred"] = r.return_value["__taskguard__"] == "deferred" and again.status == "READY"
out["deferred_30s"] = wait is not None and 20 < wait <= 30
guard.release(held)

# takes_context: the context is not part of the key; the holder names the job.
r = tasks.with_context.enqueue(2)
out["context_key"] = tasks.SEEN[-1][1] == "ctx:2" and r.return_value == r.id
out["history_names_job"] = any(e.holder.task_id == r.id for e in guard.events("ctx:2"))

# async def: lock statements off the loop; the lease outlives its 0.6 s ttl by renewal.
r = tasks.slow_async.enqueue(3)
out["async_ran"] = r.status == "SUCCESSFUL"


async def enqueue_async() -> bool:
    result = await tasks.slow_async.aenqueue(4)
    return result.status == "SUCCESSFUL"


out["async_aenqueue"] = asyncio.run(enqueue_async())


# An async run cancelled while its acquire is in flight (another connection holds the
# database's write lock for 1 s) leaves no lease behind, then or later.
async def cancelled_in_flight() -> bool:
    blocker = sqlite3.connect(os.environ["TINYSITE_DB"], isolation_level=None,
                              check_same_thread=False)  # fmt: skip
    blocker.execute("BEGIN IMMEDIATE")
    threading.Timer(1.0, blocker.commit).start()
    run = asyncio.ensure_future(tasks.slow_async.func(8))
    await asyncio.sleep(0.3)
    run.cancel()
    try:
        await run
        return False
    except asyncio.CancelledError:
        pass
    await asyncio.sleep(1.2)  # past the write lock's end: a late grant would be here
    row = guard.get("slow:8")
    return row is None or not row.held


out["async_cancelled_leaves_no_lease"] = asyncio.run(cancelled_in_flight())

# @task(key=..., lock=...) keyword arguments (GuardedBackend's task_class). Immediate
# runs inside enqueue, so the queue lease is adopted and released before it returns.
r = tasks.by_task_kwargs.enqueue(5)
out["task_kwargs_ran"] = r.status == "SUCCESSFUL" and tasks.SEEN[-1][1] == "kw:5"
out["task_kwargs_released"] = not guard.get("kw:5").held

# lock="queue_and_run" on a backend that is not a GuardedBackend: an error, not a run
# that silently went without its enqueue-time lock.
r = tasks.queued_without_guarded_backend.enqueue(6)
out["needs_guarded_backend"] = (
    r.status == "FAILED" and r.errors[0].exception_class.__name__ == "ConfigurationError"
)

# @guarded above @task (it gets a Task, not a function): one line naming the order.
try:
    guarded(key="x")(tasks.skipping)
    out["above_task_refused"] = False
except ConfigurationError as exc:
    out["above_task_refused"] = "place @guarded under @task" in str(exc) and "\n" not in str(exc)

# stop_on_lease_loss=True: a lease lost mid-body raises LeaseLost there: the job FAILED.
r = tasks.losing.enqueue(7)
out["lost_lease_fails_job"] = (
    r.status == "FAILED" and r.errors[0].exception_class.__name__ == "LeaseLost"
)
print(json.dumps(out))
