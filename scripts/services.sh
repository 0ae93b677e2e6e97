#!/usr/bin/env bash
# Install the Debian packages the tests need when they are missing: pgbouncer and
# memcached (the tests start private copies), chromium (the web page's browser test, driven by Playwright),
# and what the mysql extra (mysqlclient) compiles against. Quick and silent when they
# are already there: `.ci/run` and scripts/test.sh both call it. Never starts or
# configures a system service: the tests run their own processes from these binaries
# with their own config files.
set -euo pipefail

missing=()
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
command -v memcached >/dev/null 2>&1 || [ -x /usr/bin/memcached ] || missing+=(memcached)
# tests/integration/test_web.py's one real-browser test (screenshots of each page).
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if ! pkg-config --exists mysqlclient 2>/dev/null && ! pkg-config --exists libmariadb 2>/dev/null; then
    missing+=(pkg-config default-libmysqlclient-dev build-essential)
fi
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
else
    SUDO=
fi
echo "installing ${missing[*]} (apt-get)"
# policy-rc.d keeps the packages' own services from starting where it is set up;
# either way the tests never use those services.
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
for bin in pgbouncer memcached chromium; do
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || [ -x "/usr/bin/$bin" ] || {
        echo "$bin still missing after apt-get install" >&2
        exit 1
    }
done
