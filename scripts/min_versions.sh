#!/usr/bin/env bash
# Run the tests against the LOWEST versions pyproject.toml allows.
#
# The pins are derived from pyproject.toml's own lower bounds (`name>=X` becomes
# `name==X`), so raising a minimum there is the whole change: nothing else to keep
# in step. Test tools (pytest, ...) come at their latest versions; only the runtime
# dependencies are held down. Tests marked `slow` (minutes of real workers) run in
# the latest-versions pass of .ci/run only, and so do the docs' code blocks (`docs`)
# and the newcomer journeys (`journey`: they install taskguard into fresh
# virtualenvs at the versions pip picks, so here they would only repeat that pass).
#
# What the latest-versions pass proved does not depend on these versions, it is not
# repeated here (the default selection below): Celery-level scenarios run with their
# locks in PostgreSQL only, plus one worker scenario each on MariaDB and SQLite (the
# stores' SQL at the lowest SQLAlchemy is the store tests', run here on all three), and
# tests/integration/test_web.py not at all (Starlette, Jinja2 and httpx are not held
# down; what the page reads goes through the store). Nor where Celery features meet
# each other (celery/test_combinations.py: the pending runs at the lowest Celery are
# test_coalesce.py's, canvases test_celery_correctness.py's), the command line on
# MariaDB (click's use is the same on every database; the statements are the store
# tests'), nor the history's 800-grant hand-over race (the story test records every
# event kind on each database).
#
# Usage: scripts/min_versions.sh [extra pytest args]
#   MIN_VENV=dir     where to build the venv (default: .venv-min, rebuilt each run)
#   MIN_STEP=build   only build the venv and check its pins; MIN_STEP=test: only the
#                    tests, in the venv a build step made (.ci/run builds it while the
#                    main run's tests run)
#   MIN_PYTEST_ARGS  replaces the default selection (below, on 4 processes)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MIN_VENV:-.venv-min}
PYTHON=${PYTHON:-python3}
started=$(date +%s)
# Tests that depend on a newer broker library than the lowest say so with this.
export TASKGUARD_TEST_LOWEST_VERSIONS=1

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT

"$PYTHON" - "$constraints" <<'EOF'
"""Write one `name==lowest` line per runtime dependency with a lower bound."""
import re
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
requirements = list(project["dependencies"])
# The runtime extras too (not test/dev/bench: tools run at their latest versions).
for extra in ("redis", "prometheus", "django", "dramatiq", "taskiq"):
    requirements += project["optional-dependencies"][extra]
pins = {}
for req in requirements:
    m = re.match(r"^\s*([A-Za-z0-9_.-]+)(\[([^\]]+)\])?\s*([^;]*)", req)
    if not m:
        sys.exit(f"cannot read requirement {req!r}")
    name, extras, spec = m.group(1).lower(), m.group(3) or "", m.group(4)
    low = re.search(r">=\s*([0-9][^,\s]*)", spec)
    if not low:
        continue  # no lower bound: nothing to hold down
    pins[name] = low.group(1)
    # psycopg's "binary" extra is the same release of psycopg-binary.
    if name == "psycopg" and "binary" in extras.split(","):
        pins["psycopg-binary"] = low.group(1)
with open(sys.argv[1], "w") as out:
    for name, version in sorted(pins.items()):
        out.write(f"{name}=={version}\n")
EOF

echo "== lowest allowed versions (from pyproject.toml)"
cat "$constraints"

if [ "${MIN_STEP:-}" != test ]; then
    "$PYTHON" -m venv --clear "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints" \
        -e ".[test,redis,prometheus,django]"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

echo "== installed"
python -m pip list --disable-pip-version-check 2>/dev/null \
    | grep -iE '^(sqlalchemy|alembic|psycopg|psycopg-binary|celery|kombu|click|redis|prometheus.client|django|dramatiq) ' || true
# Every pin must hold: a resolver that quietly picked a newer release would make
# this run prove nothing.
python - "$constraints" <<'EOF'
import sys
from importlib.metadata import version

def norm(v: str) -> tuple[int, ...]:
    parts = [int(p) for p in v.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


wrong = []
for line in open(sys.argv[1]):
    name, want = line.strip().split("==")
    have = version(name)
    if norm(have) != norm(want):
        wrong.append(f"{name} {have} (wanted {want})")
if wrong:
    sys.exit("not the lowest versions: " + ", ".join(wrong))
EOF

if [ "${MIN_STEP:-}" = build ]; then
    echo "min-versions venv took $(( $(date +%s) - started )) s"
    exit 0
fi
echo "== tests (lowest versions)"
# shellcheck disable=SC2086
if [ -n "${MIN_PYTEST_ARGS:-}" ]; then
    python -m pytest ${MIN_PYTEST_ARGS} "$@"
else
    # Deselected here only (it runs in the latest-versions pass): the Redis killed-worker
    # test needs Redis to hand a SIGKILLed worker's message to the next worker within the test, which the lowest
    # kombu does not do in time (the worker app's unacked_restore_interval is newer).
    # The Django Tasks tests run on Django 5.2+ only (django-tasks-db needs it; the lowest
    # Django here is 4.2): the latest-versions pass and .ci/run's Django 6 step run them.
    # Version-independent here (see the top): Celery-level tests on SQLite/MariaDB but
    # for one each (-k), the operators' page (test_web*.py: Starlette, Jinja2, httpx and
    # Playwright are not held down), and what the top of this file says.
    # tests/integration/taskiq needs taskiq-redis (dev), which needs a newer redis than
    # the lowest here: the lowest taskiq runs the unit tests (test_option_table.py).
    python -m pytest -m "not slow and not docs and not journey and not django_tasks" \
        -n 4 --dist loadfile --no-loadscope-reorder \
        -k "(not (celery and (sqlite or mariadb)) or workers_mariadb or fifty_submissions_during) and not (test_cli and mariadb) and not hand_overs_are_never_recorded" \
        --deselect tests/integration/test_web.py --deselect tests/integration/test_web_browser.py \
        --ignore tests/integration/taskiq --ignore tests/integration/celery/test_combinations.py \
        --deselect tests/integration/celery/test_celery_correctness.py::test_redis_killed_worker_reruns_once \
        "$@"
fi
echo "min-versions run took $(( $(date +%s) - started )) s"
