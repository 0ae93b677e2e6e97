"""The checks of ``scripts/chaos.py`` (issue #7), on the private servers of
:mod:`tests.harness`; the integration tests run their short versions:

* :mod:`scripts.chaoslib.history`    - the per-worker event log (grants, renewals,
  releases, fenced writes) with database timestamps, and its checker (no overlap,
  tokens, stale owners, fenced counter);
* :mod:`scripts.chaoslib.resource`   - the protected resource: a counter written
  under a fencing token;
* :mod:`scripts.chaoslib.contention` - contender and reaper processes, and a
  checked contention run;
* :mod:`scripts.chaoslib.holders`    - single holders to SIGSTOP or SIGKILL;
* :mod:`scripts.chaoslib.durability` - grant, crash, restart, count survivors;
* :mod:`scripts.chaoslib.faults`     - one connection cut compared with the
  database's truth;
* :mod:`scripts.chaoslib.lease_clock` - a renewing holder cut off from the database;
* :mod:`scripts.chaoslib.failover`   - failover to a standby under contention;
* :mod:`scripts.chaoslib.phases`     - the phases of ``chaos.py`` and their figures.
"""
