#!/usr/bin/env bash
# A headless Chromium for the test that opens the run report in a real browser
# (tests/track/test_report.py, marked `browser`): tests/services.py runs this when that test is the
# first to need it. Installed from Debian's packages when missing and we are root; elsewhere the
# test says why it cannot run (and fails under CI=true).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then exit 0; fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "browser: no chromium and cannot install it (needs root and apt-get)" >&2; exit 0
fi
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; }
echo "browser: chromium installed in $(( $(date +%s) - start )) s" >&2
