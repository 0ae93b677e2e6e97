"""Celery integration: ``@guarded_task`` and the :class:`GuardedTask` base class.

For users: docs/options.md (keys, lock phases, conflict strategies, TTL and renewal,
settings) and docs/behaviour.md (retries, eager mode, fencing tokens, signals).
"""

from taskguard.celery.message import is_skipped
from taskguard.celery.pending import is_coalesced
from taskguard.celery.task import GuardedTask, guarded_task
from taskguard.celery.worker import GuardedRequest  # and connects the worker's hooks
from taskguard.held_lease import check_lease, current_lease
from taskguard.key_derivation import canonical

__all__ = [
    "GuardedRequest",
    "GuardedTask",
    "canonical",
    "check_lease",
    "current_lease",
    "guarded_task",
    "is_coalesced",
    "is_skipped",
]
