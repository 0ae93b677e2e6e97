"""Celery integration: ``@guarded_task`` and the :class:`GuardedTask` base class.

For users: docs/options.md (keys, lock phases, conflict strategies, TTL and renewal,
settings) and docs/behaviour.md (retries, eager mode, fencing tokens, signals).
"""

from taskguard.celery.message import MARKER, SKIPPED, is_skipped, skipped_result
from taskguard.celery.options import CONFLICT_STRATEGIES, LOCK_PHASES
from taskguard.celery.pending import is_coalesced
from taskguard.celery.task import GuardedTask, guarded_task
from taskguard.celery.worker import GuardedRequest  # and connects the worker's hooks
from taskguard.holding import check_lease, current_lease
from taskguard.keys import KeyDeriver, args_digest, canonical

__all__ = [
    "CONFLICT_STRATEGIES",
    "LOCK_PHASES",
    "MARKER",
    "SKIPPED",
    "GuardedRequest",
    "GuardedTask",
    "KeyDeriver",
    "args_digest",
    "canonical",
    "check_lease",
    "current_lease",
    "guarded_task",
    "is_coalesced",
    "is_skipped",
    "skipped_result",
]
