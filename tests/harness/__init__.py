"""Private servers and network faults for the integration tests, ``scripts/chaos.py``
and ``scripts/bench.py``; each started on a free loopback port in a temp dir and
deleted afterwards, never touching the shared services:

* :mod:`tests.harness.servers`   - what every private server shares; Redis, memcached;
* :mod:`tests.harness.postgres`  - a PostgreSQL cluster to crash or freeze, and a
  primary with a streaming standby to fail over to;
* :mod:`tests.harness.mariadb`   - a MariaDB server to crash;
* :mod:`tests.harness.pgbouncer` - a PgBouncer in front of a PostgreSQL server;
* :mod:`tests.harness.proxy`     - a TCP proxy that cuts a connection around a
  statement, or partitions it.
"""
