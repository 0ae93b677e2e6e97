"""Value objects handed out by :class:`taskguard.TaskGuard`."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from taskguard.exceptions import HOLDER_GONE
from taskguard.fencing import fence

__all__ = ["Attempt", "Holder", "Lease", "LockInfo", "Marker", "ReapResult", "describe_holder"]


class Holder(NamedTuple):
    """Who took a lease, for people reading the table. Not used for ownership."""

    task_name: str | None = None
    task_id: str | None = None
    hostname: str | None = None
    pid: int | None = None

    def describe(self) -> str:
        """The one text naming a holder: ``task T id I on H pid P`` (what is known;
        empty when nothing is)."""
        return " ".join(
            part
            for part in (
                f"task {self.task_name}" if self.task_name else None,
                f"id {self.task_id}" if self.task_id else None,
                f"on {self.hostname}" if self.hostname else None,
                f"pid {self.pid}" if self.pid is not None else None,
            )
            if part
        )


@dataclass(slots=True)
class Lease:
    """A granted lease. Only the holder of ``owner`` can renew or release it.

    ``token`` is a fencing token: pass it to whatever the task writes to and have
    that resource reject tokens lower than the highest it has seen.
    ``expires_at`` is the database's idea of expiry and moves on renewal.
    ``min_hold`` (seconds, 0 if none) is the throttle window: the key stays taken
    until at least ``acquired_at + min_hold``, even after release.
    ``confirmed_at`` is this host's ``time.monotonic()`` when the statement that
    granted or last renewed the lease was *sent*: the database started its ttl no
    earlier, so by the local clock the lease holds at least until ``confirmed_at +
    ttl`` (``None``: not known here, e.g. a lease rebuilt from a message).
    """

    key: str
    owner: str
    token: int
    acquired_at: datetime
    expires_at: datetime
    ttl: float
    slot: int = 0
    min_hold: float = 0.0
    confirmed_at: float | None = field(default=None, compare=False, repr=False)

    def fence(self, session: Any) -> int:
        """Prove, inside ``session``'s current transaction, that this lease is still
        held (owner and expiry checked by the database clock); returns the token.

        Raises :class:`~taskguard.LeaseLost` if it is not, so the transaction's
        writes never commit. Until that transaction ends, nobody can take the
        lease over (see :func:`taskguard.fencing.fence`: a SQLAlchemy Session or
        Connection, or Django's connection inside ``transaction.atomic()``).
        """
        return fence(self, session)

    def to_dict(self) -> dict[str, object]:
        """A JSON-friendly form, e.g. to carry a lease in a Celery message header."""
        data: dict[str, object] = {
            "key": self.key,
            "owner": self.owner,
            "token": self.token,
            "acquired_at": self.acquired_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "ttl": self.ttl,
            "slot": self.slot,
        }
        if self.min_hold:
            data["min_hold"] = self.min_hold
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Lease:
        """Inverse of :meth:`to_dict`."""
        return cls(
            key=str(data["key"]),
            owner=str(data["owner"]),
            token=int(str(data["token"])),
            acquired_at=datetime.fromisoformat(str(data["acquired_at"])),
            expires_at=datetime.fromisoformat(str(data["expires_at"])),
            ttl=float(str(data["ttl"])),
            slot=int(str(data.get("slot", 0))),
            min_hold=float(str(data.get("min_hold", 0.0))),
        )


@dataclass(frozen=True, slots=True)
class LockInfo:
    """A row of ``task_locks`` as read at database time ``read_at``.

    ``phase``: the lock phase the lease is in, a :class:`taskguard.options.Phase`
    (``queue``: taken at enqueue, the job waits to run; ``run``: held by a running
    job); ``None`` for a plain :meth:`~taskguard.TaskGuard.acquire` and for rows
    written before it was recorded. ``slots``: the key's limit N as the grant asked
    for it (1: a mutex; ``None``: not recorded)."""

    key: str
    slot: int
    owner: str
    token: int
    acquired_at: datetime
    expires_at: datetime
    holder: Holder
    read_at: datetime
    phase: str | None = None
    slots: int | None = None

    @property
    def task_name(self) -> str | None:
        """The holder's task name (``holder.task_name``)."""
        return self.holder.task_name

    @property
    def task_id(self) -> str | None:
        """The holder's task id (``holder.task_id``)."""
        return self.holder.task_id

    @property
    def hostname(self) -> str | None:
        """The holder's host or worker node name (``holder.hostname``)."""
        return self.holder.hostname

    @property
    def pid(self) -> int | None:
        """The holder's process id (``holder.pid``)."""
        return self.holder.pid

    @property
    def held(self) -> bool:
        """Whether the lease was live when the row was read (database clock)."""
        return self.expires_at > self.read_at

    @property
    def held_for(self) -> timedelta:
        """How long the current (or last) holder has had it, as of ``read_at``."""
        return (min(self.read_at, self.expires_at)) - self.acquired_at

    @property
    def expires_in(self) -> timedelta:
        """Time left on the lease as of ``read_at`` (negative once expired)."""
        return self.expires_at - self.read_at

    def describe(self) -> str:
        """One line naming the holder, for logs and error messages."""
        return (
            f"owner {self.owner} ({self.holder.describe() or 'no holder details'}), "
            f"token {self.token}, "
            f"expires {self.expires_at.isoformat()}"
        )

    def to_dict(self, slots_in_use: int | None = None) -> dict[str, object]:
        """A JSON-friendly form (used by ``taskguard locks --json``); ``slots_in_use``:
        how many of the key's rows are live, where the caller read them all."""
        found: dict[str, object] = {
            "key": self.key,
            "slot": self.slot,
            "owner": self.owner,
            "token": self.token,
            "task_name": self.holder.task_name,
            "task_id": self.holder.task_id,
            "hostname": self.holder.hostname,
            "pid": self.holder.pid,
            "phase": self.phase and str(self.phase),
            "slots": self.slots,
            "acquired_at": self.acquired_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "held": self.held,
            "held_for_seconds": round(self.held_for.total_seconds(), 3),
            "expires_in_seconds": round(self.expires_in.total_seconds(), 3),
        }
        if slots_in_use is not None:
            found["slots_in_use"] = slots_in_use
        return found


def describe_holder(holder: LockInfo | None) -> str:
    """The holder a conflict found, for logs, errors and history: ``None`` (it
    released before it could be read) is :data:`HOLDER_GONE`."""
    return HOLDER_GONE if holder is None else holder.describe()


class Attempt(NamedTuple):
    """What :meth:`taskguard.TaskGuard.try_acquire` found: the granted ``lease``, or
    (``lease is None``) the ``holder`` read when the key turned out to be held.
    ``holder`` is ``None`` on a grant, and on a conflict whose holder released before
    it could be read."""

    lease: Lease | None
    holder: LockInfo | None


class Marker(NamedTuple):
    """A key taken for ``ttl`` seconds together with a release
    (:meth:`taskguard.TaskGuard.release`), e.g. a record that some work finished
    that a later :meth:`~taskguard.TaskGuard.try_acquire` (``unless=``) respects.
    Taken unless it is held already; it ends by expiry (the reaper deletes it)."""

    key: str
    ttl: float
    holder: Holder = Holder()


class ReapResult(int):
    """Number of rows a reap removed (an ``int``), plus how many batches it took."""

    batches: int

    def __new__(cls, removed: int, batches: int) -> ReapResult:
        obj = super().__new__(cls, removed)
        obj.batches = batches
        return obj
