#!/usr/bin/env python3
"""Does a MariaDB reap block acquires of other keys? (docs/mariadb.md)

    python scripts/mariadb_reap_probe.py [ROWS] [BATCH]

Fills ROWS long-expired rows into a scratch database on the local MariaDB, then
reaps them in batches of BATCH with taskguard's reap statement while a thread
acquires and releases 50 live keys interleaved with them (taskguard's own SQL,
hand-issued). Prints the reap rate, the pair latency before and during the reap,
and the server's row-lock waits during the reap (0 = nothing ever waited on a lock).
"""

import statistics
import sys
import threading
import time
import uuid

import MySQLdb
from sqlalchemy import create_engine

from taskguard import schema
from taskguard.dialects import lock_sql_for
from taskguard.dialects import mysql as m

_sql = lock_sql_for(create_engine("mysql+mysqldb://").dialect)
ACQ, REL, REAP = _sql.acquire, _sql.release, _sql.reap_batch
DB = "tg_maria_reap"
N = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
BATCH = int(sys.argv[2]) if len(sys.argv) > 2 else 5000


def conn():
    c = MySQLdb.connect(
        host="127.0.0.1", user="root", database=DB, charset="utf8mb4", autocommit=True
    )
    cur = c.cursor()
    for s in m.SESSION_SETUP:
        cur.execute(s)
    return c, cur


a = MySQLdb.connect(host="127.0.0.1", user="root", autocommit=True).cursor()
a.execute(f"DROP DATABASE IF EXISTS {DB}")
a.execute(f"CREATE DATABASE {DB}")
schema.upgrade(f"mysql+mysqldb://root@127.0.0.1/{DB}?charset=utf8mb4")
_, cur = conn()
t = time.perf_counter()
cur.execute(f"""INSERT INTO task_locks (`key`, slot, owner, token, acquired_at, expires_at)
 SELECT CONCAT('old:', LPAD(seq, 8, '0')), 0, 'x', seq, UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR FROM seq_1_to_{N}""")
print(f"filled {N} expired rows in {time.perf_counter() - t:.1f}s")
lat = {"idle": [], "reap": []}
phase = ["idle"]
stop = [False]


def acquirer():
    _, c = conn()
    i = 0
    while not stop[0]:
        key = f"old:{(i % 50) * (N // 50):08d}-live"
        i += 1  # interleaved with the rows being reaped
        owner = uuid.uuid4().hex
        t0 = time.perf_counter()
        c.execute(
            ACQ.sql,
            ACQ.params(
                {
                    "key": key,
                    "slot": 0,
                    "owner": owner,
                    "ttl": 60_000_000,
                    "task_name": None,
                    "task_id": None,
                    "hostname": "h",
                    "pid": 1,
                }
            ),
        )
        row = c.fetchone()
        assert row[0] == owner
        c.execute(REL.sql, REL.params({"key": key, "slot": 0, "owner": owner}))
        lat[phase[0]].append((time.perf_counter() - t0) * 1000)


def waits():
    cur.execute(
        "SHOW GLOBAL STATUS WHERE Variable_name IN ('Innodb_row_lock_waits', 'Innodb_row_lock_time')"
    )
    return dict(cur.fetchall())


th = threading.Thread(target=acquirer)
th.start()
time.sleep(3)
w0 = waits()
phase[0] = "reap"
t = time.perf_counter()
after = {"after_key": "", "after_slot": -1}
removed = batches = 0
while True:
    cur.execute(REAP.sql, REAP.params({**after, "grace": -3600_000_000 // 2, "batch_size": BATCH}))
    rows = cur.fetchall()
    batches += 1
    removed += len(rows)
    if len(rows) < BATCH:
        break
    after = {"after_key": rows[-1][0], "after_slot": rows[-1][1]}
el = time.perf_counter() - t
w1 = waits()
stop[0] = True
th.join()
print("row lock waits during reap (server-wide):", {k: int(w1[k]) - int(w0[k]) for k in w0})
print(f"reaped {removed} rows in {batches} batches, {el:.1f}s = {removed / el:,.0f} rows/s")
for k, v in lat.items():
    v.sort()
    q = statistics.quantiles(v, n=100)
    print(
        f"acquire+release of other keys while {k}: n={len(v)} p50={q[49]:.2f} ms p99={q[98]:.2f} ms max={v[-1]:.1f} ms"
    )
a.execute(f"DROP DATABASE {DB}")
