#!/usr/bin/env bash
# The test command, all set-up included: the Debian packages the tests need (when
# missing), taskguard with its dev extras into the active Python, then pytest.
# Arguments go to pytest (e.g. `scripts/test.sh tests/integration -k pgbouncer`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
# .ci/run has just made this install itself (and builds its other venvs meanwhile);
# unset for the tests (a journey runs this script in a fresh venv: it must install).
if [ -z "${TASKGUARD_CI_INSTALLED:-}" ]; then
    python3 -m pip install -q --disable-pip-version-check -e ".[dev]"
fi
unset TASKGUARD_CI_INSTALLED
# With no arguments, the whole suite on 4 processes (most tests wait on workers and
# servers, not on the CPU): a test file per process at a time, the costliest first,
# a file with a worker per store or pool split by worker (the root conftest.py).
if [ $# -eq 0 ]; then
    set -- -n 4 --dist loadgroup
fi
exec python3 -m pytest "$@"
