"""What importing taskguard costs and wires up, each case in a fresh interpreter.

The command line and callers of the lock API alone import neither Celery's task
machinery nor Alembic (they cost more than the rest of the package); a Celery
process still gets the whole integration from ``import taskguard``, as
``imports = ["taskguard"]`` and the ``taskguard_reaper_interval`` setting expect."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_command_line_imports_neither_celery_tasks_nor_alembic() -> None:
    out = _run(
        "import sys, taskguard.cli\n"
        "heavy = ('alembic', 'taskguard.celery', 'celery.app.task', 'celery.schedules',\n"
        "         'starlette', 'jinja2', 'uvicorn')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    assert out.strip() == "[]"


def test_the_celery_names_import_on_first_use() -> None:
    out = _run(
        "import taskguard\n"
        "from taskguard import guarded_task, schedule_reaper, GuardedTask\n"
        "from taskguard.celery import GuardedTask as direct\n"
        "assert GuardedTask is direct and callable(guarded_task) and callable(schedule_reaper)\n"
        "assert set(taskguard.__all__) <= set(dir(taskguard))\n"
        "try:\n"
        "    taskguard.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    assert "no attribute 'no_such_name'" in out


def test_imported_inside_a_celery_process_the_integration_is_wired_at_once() -> None:
    out = _run(
        "import sys, celery, taskguard\n"
        "print('taskguard.celery.worker' in sys.modules, 'taskguard.celery.reaper' in sys.modules)\n"
    )
    assert out.split() == ["True", "True"]


def test_imported_before_celery_the_reaper_setting_still_schedules_the_reaper() -> None:
    out = _run(
        "import sys, taskguard\n"
        "from celery import Celery\n"
        "assert 'taskguard.celery.reaper' not in sys.modules\n"
        "app = Celery('late', broker='memory://', set_as_current=False)\n"
        "app.conf.taskguard_reaper_interval = 45\n"
        "app.finalize()\n"
        "print('taskguard.reap_expired_locks' in app.tasks,\n"
        "      app.conf.beat_schedule['taskguard-reaper']['schedule'],\n"
        "      'taskguard.celery.worker' in sys.modules)\n"
    )
    assert out.split() == ["True", "45.0", "True"]
