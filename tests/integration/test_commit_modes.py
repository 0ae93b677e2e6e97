"""Which lock statements wait for the WAL flush (PostgreSQL).

Grants and renewals must survive a database crash, so they commit durably. A
release only ends a lease early (lost in a crash, the key stays taken until the
lease's expiry) and a reap batch only deletes rows that had expired, so both
commit without waiting (docs/reliability.md), and so do a waiter's announcements of
its place in line (renewed every 0.5 s). A release that also takes a marker
(a Celery run's finished record) commits like a release. Counted with pg_stat_wal: a backend
reports its WAL syncs when it exits, and the WAL writer flushes the asynchronous
commits in a few syncs of its own. A refused acquire never waits either (the lean
one locks the live row to be refused, so it commits; the full one only reads).
"""

from __future__ import annotations

import time

import psycopg
import pytest

from taskguard import Lease, Marker, TaskGuard
from tests.services import libpq as _libpq

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


#: pg_stat_wal counts the whole server's syncs, so durable commits of tests running
#: beside this one add to a phase's count: a phase that must not flush is measured
#: up to this many times and its fewest syncs count (noise only ever adds).
TRIES = 4


def _fewest_syncs(url: str, prepare: object, work: object, enough: float) -> int:
    counts: list[int] = []
    for _ in range(TRIES):
        prepare()  # type: ignore[operator]
        counts.append(_syncs_during(url, work))
        if counts[-1] < enough:
            break
    return min(counts)


def test_grants_and_renewals_wait_for_the_flush_releases_and_reaps_do_not(pg_url: str) -> None:
    leases: list[Lease] = []

    def acquire(guard: TaskGuard) -> None:
        leases[:] = [lease for i in range(N) if (lease := guard.acquire(f"wal:{i}", 60))]

    def renew(guard: TaskGuard) -> None:
        assert all(guard.renew(lease) for lease in leases)

    def release(guard: TaskGuard) -> None:
        assert all(guard.release(lease) for lease in leases)

    def reap(guard: TaskGuard) -> None:
        assert guard.reap(grace=0, batch_size=1) == N  # one batch (one commit) per row

    tries = iter(range(TRIES))

    def release_marking(guard: TaskGuard) -> None:
        attempt = next(tries)
        for i, lease in enumerate(leases):
            assert guard.release(lease, marker=Marker(f"done:{attempt}:{i}", 60))

    def refusals(guard: TaskGuard) -> None:
        # Each key's first attempt: the lean acquire, which locks the live row to be
        # refused (a write transaction that must not wait), then the full one (a read).
        assert not any(guard.acquire(f"wal:{i}", 60) for i in range(N))

    def places_in_line(guard: TaskGuard) -> None:
        # A waiter's place in line, taken and given up: renewed every 0.5 s while it
        # waits, so one lost in a crash is announced again at once.
        for i in range(N):
            rows, _ = guard._store.waiters.announce(f"wal:{i}", range(1), "waiter", None, 2.0)
            assert rows
            guard._store.waiters.withdraw(f"wal:{i}", "waiter")

    def free_keys() -> None:
        helper = TaskGuard(pg_url)
        for lease in leases:
            helper.release(lease)
        leases.clear()
        helper.reap(grace=0)
        helper.dispose()

    def fresh_leases() -> None:
        free_keys()
        helper = TaskGuard(pg_url)
        acquire(helper)
        helper.dispose()
        assert len(leases) == N

    def expired_rows() -> None:
        fresh_leases()
        helper = TaskGuard(pg_url)
        release(helper)
        helper.dispose()

    grants = _syncs_during(pg_url, acquire)
    renewals = _syncs_during(pg_url, renew)
    releases = _fewest_syncs(pg_url, fresh_leases, release, N * 0.25)
    reaps = _fewest_syncs(pg_url, expired_rows, reap, N * 0.25)
    places = _fewest_syncs(pg_url, fresh_leases, places_in_line, N * 0.5)
    refused = _fewest_syncs(pg_url, fresh_leases, refusals, N * 0.25)
    # Measured apart from the grants (which wait): a phase that must not flush is
    # told apart from durable commits of tests running beside it by its fewest syncs.
    marking = _fewest_syncs(pg_url, fresh_leases, release_marking, N * 0.25)
    print(
        f"WAL syncs: grants {grants}, renewals {renewals}, releases {releases}, "
        f"reaps {reaps}, releases with a marker {marking}, places in line {places}, "
        f"refusals {refused}"
    )
    # Each durable commit flushes (a concurrent commit may share a flush).
    assert grants >= N * 0.8 and renewals >= N * 0.8, (grants, renewals)
    assert marking < N * 0.25, marking
    # Only the WAL writer's periodic flushes (every wal_writer_delay, 200 ms by default).
    assert releases < N * 0.25 and reaps < N * 0.25, (releases, reaps)
    assert places < N * 0.5, places  # 2 N statements, none waiting for the flush
    assert refused < N * 0.25, refused
