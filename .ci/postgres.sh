#!/usr/bin/env bash
# Make PostgreSQL server binaries available for the HPO storage tests.
#
# The tests start their own throwaway server (initdb + pg_ctl in a temp dir, as the
# 'postgres' user when run as root); this script only installs the Debian package when
# the binaries are missing. It never fails CI: without PostgreSQL that one test skips
# and says why.
set -u

if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then
    echo "postgres.sh: PostgreSQL binaries present"
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "postgres.sh: no PostgreSQL and cannot apt-get install it; the PostgreSQL test will skip"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if timeout 300 apt-get update -qq >/dev/null 2>&1 \
    && timeout 600 apt-get install -y -qq --no-install-recommends postgresql >/dev/null 2>&1; then
    echo "postgres.sh: installed $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | head -1)"
else
    echo "postgres.sh: apt-get install postgresql failed; the PostgreSQL test will skip"
fi
exit 0
