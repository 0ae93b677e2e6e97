#!/usr/bin/env bash
# The test command, all set-up included: the Debian packages the tests need (when
# missing), taskguard with its dev extras into the active Python, then pytest.
# Arguments go to pytest (e.g. `scripts/test.sh tests/integration -k pgbouncer`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
python3 -m pip install -q --disable-pip-version-check -e ".[dev]"
# With no arguments, the whole suite on 4 processes, one test file per process at a
# time (most tests wait on workers and servers, not on the CPU), the longest files
# first (the root conftest.py orders them; xdist's own reordering off).
if [ $# -eq 0 ]; then
    set -- -n 4 --dist loadfile --no-loadscope-reorder
fi
exec python3 -m pytest "$@"
