"""Celery integration: ``@guarded_task`` and the :class:`GuardedTask` base class.

For users: docs/options.md (keys, lock phases, conflict strategies, TTL and renewal,
settings) and docs/behaviour.md (retries, eager mode, fencing tokens, signals).
"""

from taskguard.celery.message import is_skipped
from taskguard.celery.options import CONFLICT_STRATEGIES, LOCK_PHASES
from taskguard.celery.pending import is_coalesced
from taskguard.celery.task import GuardedTask, guarded_task
from taskguard.celery.worker import GuardedRequest  # and connects the worker's hooks
from taskguard.holding import check_lease, current_lease
from taskguard.keys import KeyDeriver, args_digest, canonical
from taskguard.lease import MARKER, SKIPPED, skipped_result

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
