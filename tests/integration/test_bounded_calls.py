"""No lock call hangs (issue 13, item 4): a real primary whose synchronous standby is
stopped makes every commit wait forever (as a full disk or a stuck lock wait would
look from the client). taskguard's client-side limit (taskguard/deadline.py) must
end the call as OutcomeUnknown within the bound, never a hang and never a success.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from chaoslib.failover import ReplicatedPair  # noqa: E402

from taskguard import DatabaseUnavailable, OutcomeUnknown, TaskGuard  # noqa: E402
from taskguard.deadline import call_limit  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

BOUND = 2.0
#: Scheduling slack on a loaded 2-core machine.
SLACK = 1.5


@pytest.fixture(scope="module")
def stalled() -> Iterator[tuple[ReplicatedPair, str]]:
    """A primary with ``synchronous_standby_names = '*'`` whose standby is stopped."""
    with ReplicatedPair(sync=True) as rp:
        assert rp.standby is not None
        url = rp.create_database("bounded")
        guard = TaskGuard(url)
        held = guard.acquire("held", 600)  # taken while the standby still answers
        assert held is not None
        guard.dispose()
        rp.standby.stop()
        yield rp, url


def test_acquire_ends_as_outcome_unknown_within_the_bound(
    stalled: tuple[ReplicatedPair, str],
) -> None:
    rp, url = stalled
    guard = TaskGuard(url, call_timeout=BOUND)
    try:
        t0 = time.monotonic()
        with pytest.raises(OutcomeUnknown) as info:
            guard.acquire("new-key", 60)
        took = time.monotonic() - t0
    finally:
        guard.dispose()
    print(f"acquire ended as OutcomeUnknown after {took:.2f}s (call_timeout={BOUND})")
    assert took < BOUND + SLACK, took
    assert info.value.key == "new-key"
    # The commit is still waiting for the standby on the server: not visible, and so
    # not granted to anyone as far as the database is concerned.
    with psycopg.connect(rp.primary.dsn("bounded"), autocommit=True) as conn:
        waiting = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
        ).fetchone()
    assert waiting is not None and waiting[0] >= 1


def test_renew_and_release_end_within_the_bound(stalled: tuple[ReplicatedPair, str]) -> None:
    _rp, url = stalled
    guard = TaskGuard(url, call_timeout=BOUND)
    try:
        lease = guard.get("held")
        assert lease is not None
        for op in ("renew", "release"):
            t0 = time.monotonic()
            with pytest.raises(DatabaseUnavailable):
                from taskguard.lease import Lease

                mine = Lease(
                    "held", lease.owner, lease.token, lease.acquired_at, lease.expires_at, 600.0, 0
                )
                getattr(guard, op)(mine)
            assert time.monotonic() - t0 < BOUND + SLACK, op
    finally:
        guard.dispose()


def test_call_limit_narrows_the_bound(stalled: tuple[ReplicatedPair, str]) -> None:
    """What the renewer uses: a tighter limit for one call, e.g. the time left
    before the lease would expire by the local clock."""
    _rp, url = stalled
    guard = TaskGuard(url)  # default call_timeout (10 s)
    try:
        t0 = time.monotonic()
        with pytest.raises(OutcomeUnknown), call_limit(1.0):
            guard.acquire("third-key", 60)
        assert time.monotonic() - t0 < 1.0 + SLACK
    finally:
        guard.dispose()


def test_a_hung_statement_is_cut_by_the_default_limit_too(
    stalled: tuple[ReplicatedPair, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without call_limit(): the per-statement default bounds each statement."""
    from taskguard import deadline

    monkeypatch.setattr(deadline, "DEFAULT_STATEMENT_LIMIT", 1.0)
    _rp, url = stalled
    guard = TaskGuard(url)
    try:
        t0 = time.monotonic()
        with pytest.raises(OutcomeUnknown):
            guard.acquire("another-key", 60)
        # First statement cut at 1 s, the read-back answers, the retry is cut at 1 s.
        assert time.monotonic() - t0 < 2 * 1.0 + SLACK
    finally:
        guard.dispose()


def test_a_renewal_that_hangs_loses_the_lease_before_its_database_expiry() -> None:
    """A running task's lease: the standby stops while the body runs; the renewal's
    commit waits for it forever, and the renewer declares the lease lost by the local
    clock while the database still has it live."""
    from taskguard.celery.renewal import ActiveRun, Heartbeat

    ttl = 3.0
    with ReplicatedPair(sync=True) as rp:
        assert rp.standby is not None
        url = rp.create_database("renewal")
        guard = TaskGuard(url)
        try:
            lease = guard.acquire("running", ttl)
            assert lease is not None
            run = ActiveRun(guard, "running", lease, request=None)
            beat = Heartbeat(run, None, "tid").start()
            try:
                time.sleep(ttl / 3 + 0.2)  # one renewal went through
                assert run.lost is None
                rp.standby.stop()
                deadline = time.monotonic() + 2 * ttl
                while run.lost is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                lost_at = time.time()
            finally:
                beat.stop()
            assert run.lost is not None, "the lease was never declared lost"
            ahead = lease.expires_at.timestamp() - lost_at
            print(f"lease (ttl {ttl}s) declared lost {ahead:.2f}s before its database expiry")
            # The last successful renewal set the database expiry; the loss came first.
            assert lost_at < lease.expires_at.timestamp(), (lost_at, lease.expires_at)
        finally:
            guard.dispose()
