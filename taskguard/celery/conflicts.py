"""``on_conflict`` at enqueue: what a submission does when its key is held, one unit
per strategy; and the two Celery-only actions of a run that finds its key held.

Each :class:`Strategy` is what one conflict mode (:class:`taskguard.options.Conflict`;
what it accepts is the core's, :data:`taskguard.options.MODES`) does in Celery when
the key is held at enqueue (a queue phase: ``lock="queue"``/``"queue_and_run"``):
:meth:`GuardedTask.apply_async <taskguard.celery.task.GuardedTask.apply_async>` calls
the task's strategy (``options.strategy``) through :meth:`~Strategy.held_at_enqueue`
and never compares names: a new mode is one value in the core and one class here,
registered in :data:`ACTIONS`. In the run the core decides (:meth:`taskguard.runs.
GuardedRun.conflict`, Celery's actions: :class:`taskguard.celery.running.Run`), but
for a start deferred while the key is busy (:data:`DEFER`: ``rate=`` without
``on_conflict``) and another delivery of the very message holding the key (a broker
redelivery, whatever the strategy: :data:`REDELIVERY`).

Every conflict is logged with the key and its holder and sent as
:data:`taskguard.signals.lock_conflict` with the action taken (by the entry).

Inside a canvas (a chord or group member, a chain link, a task with link
callbacks) a skipped member is still published, carrying its skipped marker (see
:meth:`Submission.answer <taskguard.celery.message.Submission.answer>`);
``"existing"`` has no result to hand a canvas and behaves as ``"skip"``;
``"raise"`` raises :class:`AlreadyLocked` from ``apply_async`` (the canvas fails at
once); ``"retry"`` publishes the member deferred, as outside a canvas.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from taskguard import signals
from taskguard.celery.deferral import defer, poll_countdown
from taskguard.celery.message import Header, Submission, in_canvas, is_shortened
from taskguard.exceptions import AlreadyLocked
from taskguard.lease import LockInfo, describe_holder
from taskguard.options import Conflict
from taskguard.results import skipped_result
from taskguard.runs import conflict_countdown, conflict_line

__all__ = ["ACTIONS", "DEFER", "REDELIVERY", "Strategy"]

log = logging.getLogger("taskguard.celery")


class Strategy:
    """The Celery actions of one conflict mode (the base class: skip)."""

    name: ClassVar[str] = Conflict.SKIP

    def held_at_enqueue(self, sub: Submission, holder: LockInfo | None) -> Any:
        """The entry at enqueue: the key is held when a queue phase publishes ``sub``;
        the conflict is sent, then the strategy acts (:meth:`at_enqueue`)."""
        signals.lock_conflict.send(sender=sub.task, key=sub.key, holder=holder, action=self.name)
        return self.at_enqueue(sub, holder)

    def at_enqueue(self, sub: Submission, holder: LockInfo | None) -> Any:
        """Return what ``apply_async`` returns (skip: the skipped marker)."""
        task, task_id, key = sub.task, sub.task_id, sub.key
        value = skipped_result(
            task=task.name, task_id=task_id, key=key, phase="queue", holder=holder
        )
        canvas = "; publishing its skipped marker for the canvas" if in_canvas(sub.options) else ""
        log.warning(conflict_line(Conflict.SKIP, task.name, task_id, key, holder) + canvas)
        return sub.answer(value)


class Raise(Strategy):
    """Raise :class:`~taskguard.AlreadyLocked` from ``apply_async``."""

    name = Conflict.RAISE

    def at_enqueue(self, sub: Submission, holder: LockInfo | None) -> Any:
        log.warning(conflict_line(Conflict.RAISE, sub.task.name, sub.task_id, sub.key, holder))
        raise AlreadyLocked(sub.key, holder)


class Retry(Strategy):
    """Try again later: published with a countdown (``retry_countdown``; default:
    until the holder's lease ends, with jitter)."""

    name = Conflict.RETRY

    def at_enqueue(self, sub: Submission, holder: LockInfo | None) -> Any:
        task, key = sub.task, sub.key
        countdown = conflict_countdown(task.taskguard_options.retry_countdown, holder)
        line = conflict_line(
            Conflict.RETRY, task.name, sub.task_id, key, holder, countdown=countdown
        )
        log.warning(line)
        sub.options.pop("eta", None)
        sub.options["countdown"] = countdown
        return sub.publish(Header(key, deferred=True))


class Existing(Strategy):
    """Return the queued holder's ``AsyncResult`` from ``apply_async``. A started
    task has nothing to point the caller at: skipped in the run, and inside a canvas."""

    name = Conflict.EXISTING

    def held_at_enqueue(self, sub: Submission, holder: LockInfo | None) -> Any:
        holder_task = holder.holder.task_id if holder is not None else None
        if holder_task is None or is_shortened(holder_task):
            # No task to point at (e.g. taken with guard.lock()): skipped.
            return SKIP.held_at_enqueue(sub, holder)
        return super().held_at_enqueue(sub, holder)

    def at_enqueue(self, sub: Submission, holder: LockInfo | None) -> Any:
        assert holder is not None  # held_at_enqueue: a holder with a task to point at
        if in_canvas(sub.options):
            return SKIP.at_enqueue(sub, holder)
        log.warning(conflict_line(Conflict.EXISTING, sub.task.name, sub.task_id, sub.key, holder))
        return sub.task.AsyncResult(holder.holder.task_id)


class Defer(Strategy):
    """``rate=`` without ``on_conflict`` (:attr:`Conflict.DEFER`): a start that finds
    the run's lock held waits its turn (published again, polling like a pending run:
    never dropped, as a start over the rate is not)."""

    name = run_action = Conflict.DEFER
    #: The deferral's reason (``run_deferred``, the metric), and what it waits for.
    reason, waits_for = "busy", ""

    def held_at_run(self, run: Any, holder: LockInfo | None) -> Any:
        """The key is held as ``run`` (a :class:`~taskguard.celery.running.Run`) starts:
        the conflict is sent, then the start is published again (raises its Retry)."""
        task, request, key = run.task, run.request, run.key
        signals.lock_conflict.send(sender=task, key=key, holder=holder, action=self.run_action)
        described = describe_holder(holder)
        why = f"{task.name}[{request.id}] waits{self.waits_for}"
        log.info("%s: lock %r is held by %s", why, key, described)
        polls = run.header.polls
        countdown = poll_countdown(polls, holder)
        raise defer(task, request, key, countdown, self.reason, {"polls": polls + 1})


class Redelivery(Defer):
    """Another delivery of the very message holding the key (whatever ``on_conflict``
    says): re-checked like a deferred start until that run ends (then dropped as a late
    copy if it finished) or its lease runs out."""

    run_action = Conflict.RETRY
    reason, waits_for = "redelivery", " for another delivery of this task id"


SKIP = Strategy()
#: A start deferred while the key is busy (``rate=`` without ``on_conflict``).
DEFER = Defer()
#: What another delivery of the same message does (whatever the strategy).
REDELIVERY = Redelivery()
#: The Celery actions of every conflict mode at enqueue (wait and coalesce act in
#: the run; a queue phase's conflict skips).
ACTIONS: dict[Conflict, Strategy] = {
    Conflict.SKIP: SKIP,
    Conflict.RAISE: Raise(),
    Conflict.RETRY: Retry(),
    Conflict.EXISTING: Existing(),
    Conflict.WAIT: SKIP,
    Conflict.COALESCE: SKIP,
    Conflict.DEFER: DEFER,
}
