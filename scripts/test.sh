#!/usr/bin/env bash
# The test command, all set-up included: the Debian packages the tests need (when
# missing), taskguard with its dev extras into the active Python, then pytest.
# Arguments go to pytest (e.g. `scripts/test.sh tests/integration -k pgbouncer`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/services.sh
# The dev install, once per Python and pyproject.toml: a stamp in the environment
# records it (the install is editable, so code changes need none), and a run finds
# it done when the stamp matches and taskguard is this checkout's.
stamp="$(python3 -c 'import sys; print(sys.prefix)')/.taskguard-dev-install"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $PWD"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
    || ! python3 -I -c "import sys, taskguard; sys.exit(taskguard.__file__ != '$PWD/taskguard/__init__.py')" 2>/dev/null; then
    python3 -m pip install -q --disable-pip-version-check -e ".[dev]"
    echo "$want" > "$stamp" 2>/dev/null || true
fi
# With no arguments, the whole suite on 4 processes, one test file per process at a
# time (most tests wait on workers and servers, not on the CPU), the longest files
# first (the root conftest.py orders them; xdist's own reordering off).
if [ $# -eq 0 ]; then
    set -- -n 4 --dist loadfile --no-loadscope-reorder
fi
exec python3 -m pytest "$@"
