"""Failover to a synchronous standby while 8 processes contend: the short version of
``scripts/chaos.py``'s ``10_failover`` phase (one failover; the full run and the
asynchronous negative control are in docs/evidence/reliability-runs.md).

A throwaway primary and a standby (initdb, ``pg_basebackup -R``,
``synchronous_standby_names = '*'``) on free ports; the contenders use a multi-host
URL with ``target_session_attrs=read-write``; the primary is SIGKILLed mid-run with
replication paused, the standby promoted. See scripts/chaoslib/failover.py.
"""

from __future__ import annotations

import pytest

from scripts.chaoslib.failover import failover_round

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.mark.timeout(240)
def test_failover_to_a_synchronous_standby_loses_no_acknowledged_grant() -> None:
    res = failover_round(sync=True, workers=8, before=2.0, after=2.0)
    detail = f"{dict(res.counts)}\n{dict(res.violations)}"
    assert res.total_violations == 0, detail
    assert res.counts["lost_acknowledged_grants"] == 0, detail
    # The run really crossed the failover: grants on both sides of it...
    assert res.counts["grants_before_promotion"] > 0, detail
    assert res.counts["grants_after_promotion"] > 0, detail
    # ...and calls were in flight at the kill (their commits waited for the paused
    # standby); every one ended as OutcomeUnknown or DatabaseUnavailable.
    in_flight = {k: v for k, v in res.counts.items() if k.startswith("in_flight.")}
    assert in_flight, detail
    assert set(in_flight) <= {"in_flight.U", "in_flight.E"}, detail
