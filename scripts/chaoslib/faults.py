"""Connection cut around COMMIT: does the client report the true outcome? (item 7)

One round: a fresh key, one operation (acquire, release, renew, or an exclusive
adopt of a handed-over lease) through a
:class:`~chaoslib.proxy.FaultProxy`, cut ``before`` the server saw it, ``after``
it committed, or ``partition`` (after, and the client cannot reconnect to read
back). The operation's answer is then compared with the database's truth, read
on a direct connection.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from taskguard import DatabaseUnavailable, Lease, OutcomeUnknown, TaskGuard
from tests.harness.proxy import FaultProxy

OPS = ("acquire", "release", "renew", "adopt")
MODES = ("before", "after", "partition")


@dataclass
class FaultOutcome:
    op: str
    mode: str
    reported: str  # what the client said
    truth: str  # what the database says
    correct: bool


def _report(call: object) -> str:
    if isinstance(call, Lease):
        return "lease"
    return repr(call)


def fault_round(
    proxied: TaskGuard, direct: TaskGuard, proxy: FaultProxy, op: str, mode: str
) -> FaultOutcome:
    """Run one cut operation; ``proxied`` talks through ``proxy``, ``direct`` does not."""
    key = f"fault:{op}:{mode}:{uuid.uuid4().hex[:10]}"
    lease: Lease | None = None
    if op != "acquire":
        lease = proxied.acquire(key, 30)
        assert lease is not None
    proxy.arm(mode, (key if lease is None else lease.owner).encode())
    unknown_owner = None
    try:
        if op == "acquire":
            result: object = proxied.acquire(key, 30)
        elif op == "release":
            assert lease is not None
            result = proxied.release(lease)
        elif op == "renew":
            assert lease is not None
            result = proxied.renew(lease, 120)
        else:
            assert lease is not None
            result = proxied.adopt(key, lease.owner, 120, exclusive=True)
        reported = _report(result)
    except OutcomeUnknown as exc:
        result, reported, unknown_owner = None, "OutcomeUnknown", exc.owner
    except DatabaseUnavailable as exc:
        result, reported = None, f"DatabaseUnavailable({exc})"
    finally:
        proxy.disarm()
        proxy.refuse = False
    info = direct.get(key)
    try:
        if op == "acquire":
            truth = f"held by {info.owner}" if info is not None and info.held else "free"
            if isinstance(result, Lease):
                ok = (
                    info is not None
                    and info.held
                    and (info.owner, info.token)
                    == (
                        result.owner,
                        result.token,
                    )
                )
            else:
                # Unknown is honest only when the client really could not read back.
                ok = reported == "OutcomeUnknown" and mode == "partition"
                ok = ok and info is not None and info.owner == unknown_owner
        elif op == "release":
            truth = "released" if info is not None and not info.held else "still held"
            ok = (result is True and truth == "released") or (
                reported == "OutcomeUnknown" and mode == "partition"
            )
        elif op == "adopt":
            # Adopted: the row is under the returned lease's new owner id, token kept.
            assert lease is not None and info is not None
            truth = f"owner {'publisher' if info.owner == lease.owner else info.owner}"
            if isinstance(result, Lease):
                ok = (info.owner, info.token) == (result.owner, lease.token) and info.held
            else:
                ok = reported == "OutcomeUnknown" and mode == "partition"
                ok = ok and info.owner in (lease.owner, unknown_owner)
        else:
            assert lease is not None and info is not None
            truth = f"expires {info.expires_at.isoformat()}"
            ok = (result is True and info.expires_at == lease.expires_at) or (
                reported == "OutcomeUnknown" and mode == "partition"
            )
    finally:
        direct.force_release(key)
    return FaultOutcome(op, mode, reported, truth, ok)
