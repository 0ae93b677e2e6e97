"""No lock call hangs (issue 13, item 4): a real primary whose synchronous standby is
stopped makes every commit wait forever (as a full disk or a stuck lock wait would
look from the client). taskguard's client-side limit (taskguard/deadline.py) must
end the call as OutcomeUnknown within the bound, never a hang and never a success.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from taskguard import (
    DatabaseUnavailable,
    LeaseLost,
    OutcomeUnknown,
    TaskGuard,
    schema,
)
from taskguard.deadline import call_limit, watchdog
from tests.harness.postgres import ReplicatedPair, ThrowawayCluster
from tests.harness.proxy import FaultProxy

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
    from taskguard.held_lease import Hold

    ttl = 3.0
    with ReplicatedPair(sync=True) as rp:
        assert rp.standby is not None
        url = rp.create_database("renewal")
        guard = TaskGuard(url)
        try:
            lease = guard.acquire("running", ttl)
            assert lease is not None
            run = Hold(guard, "running", lease, request=None)
            run.start_renewing()
            beat = run
            try:
                time.sleep(ttl / 3 + 0.2)  # one renewal went through
                assert run.lost is None
                rp.standby.stop()
                deadline = time.monotonic() + 2 * ttl
                while run.lost is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                lost_at = time.time()
            finally:
                beat.stop_renewing()
            assert run.lost is not None, "the lease was never declared lost"
            ahead = lease.expires_at.timestamp() - lost_at
            print(f"lease (ttl {ttl}s) declared lost {ahead:.2f}s before its database expiry")
            # The last successful renewal set the database expiry; the loss came first.
            assert lost_at < lease.expires_at.timestamp(), (lost_at, lease.expires_at)
        finally:
            guard.dispose()


# -- issue 28 C: the lease lives on the local clock -------------------------------------


@dataclass
class Holding:
    """When (time.monotonic()) a renewing holder learnt its lease was lost, by
    check_lease() and by stop_on_lease_loss, and when the other contender's
    successful acquire was sent."""

    checked_lost: float | None = None
    interrupted: float | None = None
    granted_sent: float | None = None
    renewed_at_freeze: bool = False


def _hold_through(
    holder: TaskGuard, other: TaskGuard, key: str, ttl: float, freeze: Any, thaw: Any
) -> Holding:
    """A guarded run on ``holder`` (renewed, stop_on_lease_loss armed, the body
    polling check_lease()); ``freeze()`` after its first renewal while ``other``
    keeps trying to take the key; ``thaw()`` once the other got it (or gave up)."""
    from taskguard.held_lease import (
        Hold,
        Interrupter,
        check_lease,
        enter_run,
        exit_run,
    )

    out = Holding()
    lease = holder.acquire(key, ttl)
    assert lease is not None
    run = Hold(holder, key, lease, request=None)
    token = enter_run(run)
    run.interrupter = Interrupter("bounded.hold").arm()
    run.start_renewing()
    beat = run
    stop = threading.Event()

    def contend() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                got = other.acquire(key, 60)
            except DatabaseUnavailable:
                got = None
            if got is not None:
                out.granted_sent = sent
                return
            time.sleep(0.02)

    contender = threading.Thread(target=contend, daemon=True)
    try:
        time.sleep(ttl / 3 + 0.4)  # one renewal went through
        out.renewed_at_freeze = lease.expires_at > run.lease.acquired_at + timedelta(seconds=ttl)
        check_lease()
        freeze()
        contender.start()
        end = time.monotonic() + 4 * ttl
        while time.monotonic() < end and (out.checked_lost is None or out.interrupted is None):
            try:
                try:
                    check_lease()
                except LeaseLost:
                    if out.checked_lost is None:
                        out.checked_lost = time.monotonic()
                time.sleep(0.005)
            except LeaseLost:  # raised by the interrupter, in the sleep
                out.interrupted = time.monotonic()
        contender.join(4 * ttl)
    finally:
        run.interrupter.disarm()
        stop.set()
        thaw()
        beat.stop_renewing()
        exit_run(token)
        contender.join(10) if contender.is_alive() else None
    return out


def test_a_partition_declares_the_loss_before_the_key_can_be_taken(pg_url: str) -> None:
    """Issue 28 C: the network between the holder and the database partitions (the
    proxy drops the open connections and leaves new ones unanswered; the database
    stays up for everyone else): the renewer's next connection waits for libpq's
    connect_timeout (10 s). check_lease() and stop_on_lease_loss must both report the
    loss before the other contender's winning acquire is even sent."""
    port = make_url(pg_url).port or 5432
    ttl = 3.0
    with FaultProxy(port) as proxy:
        holder = TaskGuard(make_url(pg_url).set(port=proxy.port))
        other = TaskGuard(pg_url)

        def partition() -> None:
            proxy.freeze()
            proxy.cut_all()

        try:
            got = _hold_through(holder, other, "partitioned", ttl, partition, proxy.thaw)
        finally:
            holder.dispose()
            other.dispose()
    print(got)
    assert got.renewed_at_freeze
    assert got.granted_sent is not None, "the other contender never got the key"
    assert got.checked_lost is not None, "check_lease() never reported the loss"
    assert got.interrupted is not None, "stop_on_lease_loss never stopped the body"
    assert got.checked_lost < got.granted_sent, got
    assert got.interrupted < got.granted_sent, got


def test_a_frozen_database_declares_the_loss_before_its_expiry() -> None:
    """The same with the database itself SIGSTOPped (a private cluster) right after the
    holder's connection broke (its backend terminated): nobody can be granted while it
    is frozen; once thawed the key goes to the other contender, and the holder must
    have declared the loss before the lease's database expiry."""
    ttl = 3.0
    with ThrowawayCluster() as cluster:
        url = cluster.create_database("frozen")
        schema.upgrade(url)
        holder, other = TaskGuard(url), TaskGuard(url, call_timeout=1.0)
        thaw_at: list[float] = []

        def thaw() -> None:
            if cluster.frozen:
                cluster.thaw()
                thaw_at.append(time.monotonic())

        def freeze() -> None:
            with psycopg.connect(cluster.dsn("frozen"), autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = 'frozen' AND pid <> pg_backend_pid()"
                )
            cluster.freeze()
            # Thaw after the lease ran out by any clock, so the other can be granted.
            threading.Timer(1.5 * ttl, thaw).start()

        try:
            got = _hold_through(holder, other, "frozen", ttl, freeze, thaw)
        finally:
            thaw()
            holder.dispose()
            other.dispose()
    print(got)
    assert got.granted_sent is not None and got.checked_lost is not None, got
    assert got.interrupted is not None, got
    assert got.checked_lost < thaw_at[0] and got.interrupted < thaw_at[0], (got, thaw_at)
    assert got.checked_lost < got.granted_sent and got.interrupted < got.granted_sent


@pytest.mark.parametrize(
    ("database", "default_port", "call_timeout"),
    # mysqlclient's connect_timeout is whole seconds; libpq's has a 2 s floor.
    [("pg_url", 5432, 1.0), ("maria_url", 3306, 0.5)],
)
def test_opening_a_connection_ends_by_the_call_timeout(
    request: pytest.FixtureRequest, database: str, default_port: int, call_timeout: float
) -> None:
    """A host that accepts connections and never answers (the proxy frozen): opening
    a connection for a lease operation ends by its call_timeout, not by the driver's
    connect_timeout (libpq: 10 s); and a call_timeout under the driver's floor still
    connects to a database that answers."""
    url = make_url(request.getfixturevalue(database))
    with FaultProxy(url.port or default_port) as proxy:
        proxy.freeze()
        guard = TaskGuard(url.set(port=proxy.port), call_timeout=call_timeout)
        try:
            t0 = time.monotonic()
            with pytest.raises(DatabaseUnavailable) as info:
                guard.acquire("unanswered", 30)
            took = time.monotonic() - t0
            assert not info.value.statement_sent
            assert took < call_timeout + SLACK, took
            proxy.thaw()
            with call_limit(5.0):
                assert guard.acquire("unanswered", 30) is not None
        finally:
            guard.dispose()


@pytest.mark.postgres
def test_a_finished_threads_pinned_connection_leaves_the_watchdog(pg_url: str) -> None:
    """Each thread that pins a connection keeps one unarmed watch on its socket; when
    the thread ends (its pin is garbage-collected) the watch leaves the watchdog
    before the socket closes, so no dead entry (and no fd that may be reused) stays."""
    guard = TaskGuard(pg_url, pool_size=4)
    try:
        before = len(watchdog._active)

        def work(i: int) -> None:
            lease = guard.acquire(f"watchdog:{i}", 30)
            assert lease is not None and guard.release(lease)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        del threads
        gc.collect()
        assert len(watchdog._active) == before
        assert all(w.deadline == float("inf") for w in watchdog._active.values())
    finally:
        guard.dispose()
