"""Fault-injection harness for taskguard (issue #7).

Small modules, each usable on its own from ``scripts/chaos.py`` and from the
integration tests:

* :mod:`chaoslib.cluster`  - a throwaway PostgreSQL cluster (initdb in a temp dir,
  own port) that can be crashed with ``pg_ctl stop -m immediate``;
* :mod:`chaoslib.proxy`    - a loopback TCP proxy that cuts connections around a
  statement, before or after the server saw it;
* :mod:`chaoslib.history`  - the per-worker event log (grants, renewals, releases,
  fenced writes) with database timestamps;
* :mod:`chaoslib.checker`  - verifies a history (no overlap, tokens, stale owners,
  fenced counter);
* :mod:`chaoslib.resource` - the protected resource: a counter written under a
  fencing token;
* :mod:`chaoslib.workers`  - the contender and reaper processes;
* :mod:`chaoslib.scenarios` - a checked contention run (tests and ``chaos.py``);
* :mod:`chaoslib.holders`  - single holders to SIGSTOP or SIGKILL;
* :mod:`chaoslib.durability` - grant, crash, restart, count survivors;
* :mod:`chaoslib.faults`   - one connection cut compared with the database's truth;
* :mod:`chaoslib.phases`   - the phases of ``chaos.py`` and their figures.
"""
