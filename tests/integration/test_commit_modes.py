"""Which lock statements wait for the WAL flush (PostgreSQL).

Grants and renewals must survive a database crash, so they commit durably. A
release only ends a lease early (lost in a crash, the key stays taken until the
lease's expiry) and a reap batch only deletes rows that had expired, so both
commit without waiting (docs/reliability.md). A release that also takes a marker
(a Celery run's finished record) commits like a release. Counted with pg_stat_wal: a backend
reports its WAL syncs when it exits, and the WAL writer flushes the asynchronous
commits in a few syncs of its own.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from conftest import _libpq

from taskguard import Lease, Marker, TaskGuard

pytestmark = pytest.mark.postgres

N = 200


def _wal_syncs(url: str) -> int:
    time.sleep(0.3)  # the exited backend's statistics reach the shared counters
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        row = conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()
    assert row is not None
    return int(row[0])


def _syncs_during(url: str, work: object) -> int:
    guard = TaskGuard(url)
    before = _wal_syncs(url)
    work(guard)  # type: ignore[operator]
    guard.dispose()  # its backend exits and reports
    return _wal_syncs(url) - before


def test_grants_and_renewals_wait_for_the_flush_releases_and_reaps_do_not(pg_url: str) -> None:
    leases: list[Lease] = []

    def acquire(guard: TaskGuard) -> None:
        leases.extend(lease for i in range(N) if (lease := guard.acquire(f"wal:{i}", 60)))

    def renew(guard: TaskGuard) -> None:
        assert all(guard.renew(lease) for lease in leases)

    def release(guard: TaskGuard) -> None:
        assert all(guard.release(lease) for lease in leases)

    def reap(guard: TaskGuard) -> None:
        assert guard.reap(grace=0, batch_size=1) == N  # one batch (one commit) per row

    def release_marking(guard: TaskGuard) -> None:
        for i in range(N):
            lease = guard.acquire(f"wal:{i}", 60)
            assert lease is not None
            assert guard.release(lease, marker=Marker(f"done:{i}", 60))

    grants = _syncs_during(pg_url, acquire)
    renewals = _syncs_during(pg_url, renew)
    releases = _syncs_during(pg_url, release)
    reaps = _syncs_during(pg_url, reap)
    # Each pair's grant waits; the release with its marker does not.
    pairs = _syncs_during(pg_url, release_marking)
    assert len(leases) == N
    print(
        f"WAL syncs: grants {grants}, renewals {renewals}, releases {releases}, "
        f"reaps {reaps}, grant + marking release pairs {pairs}"
    )
    assert N * 0.8 <= pairs < N * 1.25, pairs
    # Each durable commit flushes (a concurrent commit may share a flush: allow a few).
    assert grants >= N * 0.8 and renewals >= N * 0.8, (grants, renewals)
    # Only the WAL writer's periodic flushes (every wal_writer_delay, 200 ms by default).
    assert releases < N * 0.25 and reaps < N * 0.25, (releases, reaps)
