"""Quick variants of the chaos checks (issue #7, items 1-6); the full run is
``python scripts/chaos.py`` (docs/evidence/reliability-runs.md).

Real OS processes, real PostgreSQL (the shared server, plus a throwaway cluster
created with initdb for the crash tests) and SQLite where it applies. Every
history is checked by scripts/chaoslib/history.py; a violation prints examples.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from scripts.chaoslib.contention import Plan, contention
from scripts.chaoslib.durability import durability_round
from scripts.chaoslib.history import Report
from scripts.chaoslib.holders import killed_holder_round, paused_holder_round
from scripts.chaoslib.lease_clock import cut_off_round
from scripts.chaoslib.resource import Resource
from taskguard import TaskGuard, schema
from tests.harness.postgres import ThrowawayCluster

pytestmark = pytest.mark.slow


def _assert_clean(rep: Report) -> None:
    assert rep.total_violations == 0, "history violations:\n" + rep.summary()


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThrowawayCluster]:
    """A private PostgreSQL cluster these tests may crash (never the shared one)."""
    with ThrowawayCluster() as c:
        yield c


@pytest.fixture
def cluster_url(cluster: ThrowawayCluster) -> str:
    url = cluster.create_database(f"chaos_{uuid.uuid4().hex[:10]}")
    schema.upgrade(url)
    return url


# -- 1. no overlap under contention ---------------------------------------------------


@pytest.mark.parametrize("db", ["postgresql", "sqlite"])
def test_contended_grants_never_overlap(db: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("pg_url" if db == "postgresql" else "sqlite_url")
    plan = Plan(
        url=url,
        keys=("a", "b", "c", "d"),
        grants=250 if db == "postgresql" else 100,
        seconds=60,
        ttls=(0.002, 0.005, 0.01, 0.02) if db == "postgresql" else (0.005, 0.01, 0.02),
    )
    rep = contention(plan, workers=8)
    _assert_clean(rep)
    assert rep.counts["grants"] == 8 * plan.grants
    assert rep.counts["pairs_checked"] >= 8 * plan.grants - len(plan.keys)
    # The mix exercised every path the checker accounts for.
    assert rep.counts["events.N"] and rep.counts["events.R"] and rep.counts["stale_release.checked"]


def test_concurrency_limit_slots_never_overlap(pg_url: str) -> None:
    """limit=3: each slot is a mutex of its own (at most 3 holders per key)."""
    plan = Plan(url=pg_url, keys=("a", "b"), grants=60, seconds=60, limit=3)
    rep = contention(plan, workers=8)
    _assert_clean(rep)
    assert rep.counts["keys"] == 6


@pytest.mark.parametrize("db", ["postgresql", "sqlite"])
def test_waiting_acquirers_never_overlap(db: str, request: pytest.FixtureRequest) -> None:
    """acquire(wait=...): waiters woken by releases (PostgreSQL NOTIFY, SQLite polling)
    and the longest-waiter reservation must not open a gap in exclusion."""
    url = request.getfixturevalue("pg_url" if db == "postgresql" else "sqlite_url")
    plan = Plan(url=url, keys=("a", "b"), grants=40, seconds=60, wait=0.05)
    rep = contention(plan, workers=8)
    _assert_clean(rep)


@pytest.mark.parametrize("db", ["postgresql", "sqlite"])
def test_fenced_read_modify_write_loses_no_update(db: str, request: pytest.FixtureRequest) -> None:
    """The resource is written as read-modify-write (not an atomic increment) in a
    transaction that first calls guard.fence(): only exclusion keeps the counter
    exact, and accepted writes must carry increasing tokens in commit order."""
    url = request.getfixturevalue("pg_url" if db == "postgresql" else "sqlite_url")
    plan = Plan(url=url, keys=("a", "b"), grants=60, seconds=60, fenced=True)
    rep = contention(plan, workers=8)
    _assert_clean(rep)
    assert rep.counts["writes.acknowledged"] > 0


# -- 2. tokens with the reaper in a tight loop, and across crash-restarts ---------------


def test_tokens_increase_with_reaper_in_tight_loop(pg_url: str) -> None:
    plan = Plan(url=pg_url, keys=tuple(f"k{i}" for i in range(32)), grants=250, seconds=60)
    rep = contention(plan, workers=8, reaper_grace=0.05)
    _assert_clean(rep)
    assert rep.counts["faults.reaped_rows"] > 0, "the reaper never deleted a row"


def test_tokens_and_exclusion_across_crash_restarts(
    cluster: ThrowawayCluster, cluster_url: str
) -> None:
    # Enough grants that crashes land mid-run however fast the machine is.
    plan = Plan(url=cluster_url, keys=tuple(f"k{i}" for i in range(8)), grants=400, seconds=90)
    rep = contention(plan, workers=8, cluster=cluster, crash_every=0.7)
    _assert_clean(rep)
    assert rep.counts["faults.crash_restarts"] >= 1


# -- 3. fencing: a paused holder's late write is refused ---------------------------------


@pytest.mark.parametrize("db", ["postgresql", "sqlite"])
def test_paused_holder_late_write_is_rejected(db: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("pg_url" if db == "postgresql" else "sqlite_url")
    resource = Resource(url)
    resource.setup(["shared"])
    rnd = paused_holder_round(url, "shared", ttl=0.5)
    counters = resource.counters()
    resource.dispose()
    assert rnd.second_token > rnd.first_token
    assert rnd.second_write_accepted
    # Thawed, the first holder writes after its lease ended and after a newer holder
    # wrote: the lock alone cannot stop it, the fencing token does.
    assert rnd.late["late_by_us"] > 0
    assert rnd.late["write_accepted"] is False
    assert rnd.late["released"] is False and rnd.late["renewed"] is False
    assert counters == {"shared": 1}


# -- 4. stale owners -------------------------------------------------------------------------


def _row(guard: TaskGuard, key: str) -> tuple[object, ...]:
    info = guard.get(key)
    assert info is not None
    return (info.owner, info.token, info.acquired_at, info.expires_at)


def test_stale_owner_release_and_renew_affect_no_rows(guard: TaskGuard) -> None:
    # Expired, nobody took over: the row must stay exactly as it was.
    lapsed = guard.acquire("stale:lapsed", 0.05)
    assert lapsed is not None
    time.sleep(0.15)
    before = _row(guard, "stale:lapsed")
    assert guard.release(lapsed) is False
    assert guard.renew(lapsed, 60) is False
    assert _row(guard, "stale:lapsed") == before
    # Expired and taken over: the new holder's row must not move either.
    old = guard.acquire("stale:taken", 0.05)
    assert old is not None
    time.sleep(0.15)
    new = guard.acquire("stale:taken", 60)
    assert new is not None and new.token > old.token
    before = _row(guard, "stale:taken")
    assert guard.release(old) is False
    assert guard.renew(old, 600) is False
    assert guard.adopt("stale:taken", old.owner, 600) is None
    assert _row(guard, "stale:taken") == before
    assert guard.is_held_by(new)


# -- 5. a SIGKILLed holder's key comes back within TTL + 1 s ------------------------------


@pytest.mark.parametrize("db", ["postgresql", "sqlite"])
def test_killed_holder_key_granted_again_within_ttl_plus_1s(
    db: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("pg_url" if db == "postgresql" else "sqlite_url")
    rnd = killed_holder_round(url, "killed", ttl=1.0)
    assert rnd.second_token > rnd.first_token
    assert rnd.regranted_after <= rnd.ttl + 1.0


# -- 6. durability -----------------------------------------------------------------------


def test_acknowledged_grants_survive_crash_restart(
    cluster: ThrowawayCluster, cluster_url: str
) -> None:
    rnd = durability_round(cluster, cluster_url, durable=True, grants=50)
    assert rnd.acknowledged == 50
    assert rnd.survived == rnd.acknowledged
    assert rnd.tokens_reissued == 0


def test_relaxed_durability_loses_grants_negative_control(
    cluster: ThrowawayCluster, cluster_url: str
) -> None:
    """durable=False (synchronous_commit=off) is documented to lose the last
    acknowledged grants in a crash; this shows the harness can see such a loss."""
    rnd = durability_round(cluster, cluster_url, durable=False, grants=50)
    assert rnd.acknowledged == 50
    assert rnd.survived < rnd.acknowledged


# -- 11, 12. the lease on the local clock: partition, frozen database ---------------------


@pytest.mark.parametrize("mode", ["partition", "frozen"])
def test_a_cut_off_holder_declares_the_loss_before_the_new_grant(
    cluster: ThrowawayCluster, mode: str
) -> None:
    """Issue 28: a renewing holder whose connections were reset and whose network
    (or database) then stops answering must declare its lease lost before the
    database grants the key to anyone else, and no stale fenced write may commit."""
    name = f"cut_{mode}_{uuid.uuid4().hex[:8]}"
    url = cluster.create_database(name)
    schema.upgrade(url)
    res = Resource(url)
    res.setup(["k"])
    res.dispose()
    rnd = cut_off_round(cluster, name, "k", mode=mode, reset=True)
    print(f"{mode}: loss declared {rnd.margin:.3f}s before the new grant; writes {rnd.writes}")
    assert rnd.margin > 0, rnd
    assert rnd.stale_committed == 0, rnd
    assert rnd.late_write == "refused", rnd
