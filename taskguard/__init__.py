"""taskguard: per-key locks for Celery tasks, kept as rows in your own SQL database."""

from taskguard.celery import (
    GuardedTask,
    check_lease,
    current_lease,
    guarded_task,
    is_skipped,
)
from taskguard.celery.reaper import reap_expired_locks, schedule_reaper
from taskguard.exceptions import (
    AlreadyLocked,
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailable,
    InvalidArgument,
    InvalidKey,
    InvalidTTL,
    LeaseLost,
    LockHeld,
    OutcomeUnknown,
    PermissionDenied,
    SchemaMissing,
    TaskGuardError,
)
from taskguard.guard import ReapResult, TaskGuard
from taskguard.history import LockEvent
from taskguard.keys import normalize_key, validate_ttl
from taskguard.lease import Attempt, Holder, Lease, LeaseRequest, LockInfo, Marker
from taskguard.models import TaskLock, TaskLockEvent, metadata

__version__ = "0.1.0"

__all__ = [
    "AlreadyLocked",
    "Attempt",
    "ConfigurationError",
    "DatabaseError",
    "DatabaseUnavailable",
    "GuardedTask",
    "Holder",
    "InvalidArgument",
    "InvalidKey",
    "InvalidTTL",
    "Lease",
    "LeaseLost",
    "LeaseRequest",
    "LockEvent",
    "LockHeld",
    "LockInfo",
    "Marker",
    "OutcomeUnknown",
    "PermissionDenied",
    "ReapResult",
    "SchemaMissing",
    "TaskGuard",
    "TaskGuardError",
    "TaskLock",
    "TaskLockEvent",
    "__version__",
    "check_lease",
    "current_lease",
    "guarded_task",
    "is_skipped",
    "metadata",
    "normalize_key",
    "reap_expired_locks",
    "schedule_reaper",
    "validate_ttl",
]
