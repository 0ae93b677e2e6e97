"""taskguard: per-key locks for Celery tasks, kept as rows in your own SQL database."""

import importlib
import sys
from typing import TYPE_CHECKING, Any

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
from taskguard.guard import TaskGuard
from taskguard.history import LockEvent
from taskguard.lease import Attempt, Holder, Lease, LockInfo, Marker
from taskguard.models import metadata

if TYPE_CHECKING:
    from taskguard.celery import (
        GuardedTask,
        check_lease,
        current_lease,
        guarded_task,
        is_coalesced,
        is_skipped,
    )
    from taskguard.celery.reaper import reap_expired_locks, schedule_reaper

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
    "LockEvent",
    "LockHeld",
    "LockInfo",
    "Marker",
    "OutcomeUnknown",
    "PermissionDenied",
    "SchemaMissing",
    "TaskGuard",
    "TaskGuardError",
    "__version__",
    "check_lease",
    "current_lease",
    "guarded_task",
    "is_coalesced",
    "is_skipped",
    "metadata",
    "reap_expired_locks",
    "schedule_reaper",
]

# The Celery integration is imported on first use of one of its names (PEP 562):
# importing it costs more than the whole lock API, which `taskguard locks` and other
# callers of TaskGuard alone never need. Inside a Celery process (Celery imported
# first: every worker and beat) it is imported right away, as `imports = ["taskguard"]`
# expects (the reaper task, the settings route, the worker hooks); a process that
# imports taskguard before Celery gets it when its first Celery app is finalized.
#: Each lazy name and the module it comes from.
_CELERY_NAMES = {
    "GuardedTask": "taskguard.celery",
    "check_lease": "taskguard.celery",
    "current_lease": "taskguard.celery",
    "guarded_task": "taskguard.celery",
    "is_coalesced": "taskguard.celery",
    "is_skipped": "taskguard.celery",
    "reap_expired_locks": "taskguard.celery.reaper",
    "schedule_reaper": "taskguard.celery.reaper",
}


def _import_celery_integration(*_: Any) -> None:
    """Import the integration (which wires its hooks and the reaper) and bind its
    names here, so later lookups never reach :func:`__getattr__`."""
    for name, module in _CELERY_NAMES.items():
        globals()[name] = getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    if name not in _CELERY_NAMES:
        raise AttributeError(f"module 'taskguard' has no attribute {name!r}")
    _import_celery_integration()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# Last: every name above exists before the integration's modules can ask for one.
if "celery" in sys.modules:
    _import_celery_integration()
else:
    from celery._state import connect_on_app_finalize

    connect_on_app_finalize(_import_celery_integration)
