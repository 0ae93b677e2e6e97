"""taskguard: per-key locks for Celery tasks, kept as rows in your own SQL database."""

from taskguard.exceptions import (
    AlreadyLocked,
    ConfigurationError,
    DatabaseUnavailable,
    InvalidKey,
    InvalidTTL,
    LeaseLost,
    LockHeld,
    OutcomeUnknown,
    SchemaMissing,
    TaskGuardError,
)
from taskguard.guard import ReapResult, TaskGuard
from taskguard.keys import normalize_key, validate_ttl
from taskguard.lease import Holder, Lease, LockInfo
from taskguard.models import TaskLock, metadata

__version__ = "0.1.0"

__all__ = [
    "AlreadyLocked",
    "ConfigurationError",
    "DatabaseUnavailable",
    "Holder",
    "InvalidKey",
    "InvalidTTL",
    "Lease",
    "LeaseLost",
    "LockHeld",
    "LockInfo",
    "OutcomeUnknown",
    "ReapResult",
    "SchemaMissing",
    "TaskGuard",
    "TaskGuardError",
    "TaskLock",
    "__version__",
    "metadata",
    "normalize_key",
    "validate_ttl",
]
