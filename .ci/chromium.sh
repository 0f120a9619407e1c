#!/usr/bin/env bash
# Make a headless Chromium available for the jobs page's real-browser test
# (tests/service/test_page_browser.py drives it over the DevTools protocol).
#
# Installs Debian's chromium package only when no browser is on PATH. It never fails CI:
# without a browser that one test skips and says why.
set -u

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
    || command -v google-chrome >/dev/null 2>&1; then
    echo "chromium.sh: a browser is present"
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium.sh: no chromium and cannot apt-get install it; the browser test will skip"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if timeout 300 apt-get update -qq >/dev/null 2>&1 \
    && timeout 600 apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; then
    echo "chromium.sh: installed $(command -v chromium)"
else
    echo "chromium.sh: apt-get install chromium failed; the browser test will skip"
fi
exit 0
