"""A benchmark task that raises in the worker is reported, not counted as a figure.

The worker of sections 4 and 7 (``celery -A benchlib.e2e_app worker``) counts every
finished run; a run that raised (as once with a ``ModuleNotFoundError`` in every pool process)
must also leave its error, which the section then reports instead of the row's figures.
"""

from __future__ import annotations

import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import redis
from celery import Celery
from conftest import AMQP_URL, REDIS_URL

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from benchlib import common  # noqa: E402

pytestmark = [pytest.mark.celery, pytest.mark.postgres]


@pytest.mark.timeout(120)
def test_a_task_that_raises_in_the_worker_is_recorded_with_its_error(pg_url: str) -> None:
    run = uuid.uuid4().hex[:8]
    prefix, queue = f"tgbench-test:{run}:", f"tgbench-test.{run}"
    environ = {
        "TGBENCH_BROKER": AMQP_URL,
        "TGBENCH_QUEUE": queue,
        "TGBENCH_DB_URL": pg_url,
        "TGBENCH_REDIS_URL": REDIS_URL,
        "TGBENCH_PREFIX": prefix,
    }
    client = redis.Redis.from_url(REDIS_URL)
    publisher = Celery("tgbench-test", broker=AMQP_URL)
    with tempfile.TemporaryFile() as log:
        worker = common.start_worker("e2e_app", f"tgbench-test-{run}", 1, log, environ=environ)
        try:
            publisher.send_task(f"{prefix}plain", args=(1,), queue=queue)
            publisher.send_task(f"{prefix}minimal", args=(), queue=queue)  # raises TypeError
            for kind in ("plain", "minimal"):
                common.wait_count(client, f"{prefix}done:{prefix}{kind}", 1, 90, worker)
            failed = common.failed_tasks(REDIS_URL, prefix)
        finally:
            common.stop_worker(worker)
            with publisher.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
            for key in client.scan_iter(match=f"{prefix}*"):
                client.delete(key)
            client.close()
            log.seek(0)
            output = log.read().decode(errors="replace")[-3000:]
    assert failed == {
        f"{prefix}minimal": "TypeError: minimal() missing 1 required positional argument: 'i'"
    }, output

    row = common.Row(id="e2e.minimal", section="4", label="minimal", rate=1.0, p50_ms=1.0)
    common.mark_failed([row], failed[f"{prefix}minimal"])
    assert row.status == f"failed: {failed[f'{prefix}minimal']}" and row.rate is None
