"""Do acknowledged grants survive a database crash? (issue #7, item 6)

Take ``grants`` long leases, crash the cluster (``pg_ctl stop -m immediate``)
right after the last acknowledgement, restart it, and count the leases whose row
is still there with the same owner and token. Then take fresh grants and check
their tokens are above every token handed out before the crash.

In the default (durable) mode every grant must survive. With ``durable=False``
(``synchronous_commit=off``) the last grants before the crash are expected to be
lost - the negative control; the cluster is given a long ``wal_writer_delay``
for that round so the loss does not depend on luck.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import psycopg

from taskguard import TaskGuard
from tests.harness.postgres import ThrowawayCluster


@dataclass
class DurabilityRound:
    durable: bool
    acknowledged: int
    survived: int
    tokens_reissued: int  # fresh grants after restart whose token was handed out before


def _set(cluster: ThrowawayCluster, name: str, value: str | None) -> None:
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        if value is None:
            conn.execute(f"ALTER SYSTEM RESET {name}")
        else:
            conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        conn.execute("SELECT pg_reload_conf()")


def durability_round(
    cluster: ThrowawayCluster, url: str, *, durable: bool = True, grants: int = 50
) -> DurabilityRound:
    """One grant-crash-restart-count round on ``url`` (a database of ``cluster``)."""
    if not durable:
        _set(cluster, "wal_writer_delay", "10s")
    prefix = f"dur:{uuid.uuid4().hex[:8]}:"
    guard = TaskGuard(url, durable=durable)
    try:
        guard.db_now()  # connect first: the crash should follow the last grant at once
        leases = [guard.acquire(f"{prefix}{i}", 600) for i in range(grants)]
        cluster.crash()
    finally:
        guard.dispose()
    cluster.start()
    if not durable:
        _set(cluster, "wal_writer_delay", None)
    acked = [lease for lease in leases if lease is not None]
    check = TaskGuard(url)
    try:
        survived = 0
        for lease in acked:
            info = check.get(lease.key)
            if info is not None and info.owner == lease.owner and info.token == lease.token:
                survived += 1
        top = max(lease.token for lease in acked)
        issued = {lease.token for lease in acked}
        fresh = [check.acquire(f"{prefix}after:{i}", 60) for i in range(grants)]
        reissued = sum(1 for f in fresh if f is not None and (f.token in issued or f.token <= top))
    finally:
        check.dispose()
    return DurabilityRound(durable, len(acked), survived, reissued)
