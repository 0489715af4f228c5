#!/usr/bin/env bash
# The whole test suite, as CI runs it: the environment (scripts/setup.sh), a headless browser
# (scripts/browser_install.sh), the local Slurm cluster and MLflow server (scripts/services_up.sh),
# pytest, then the services it started are stopped again. Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/launch -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -f scripts/setup.sh ]]; then bash scripts/setup.sh; fi
bash scripts/browser_install.sh
bash scripts/services_up.sh
trap 'bash scripts/services_down.sh' EXIT
.venv/bin/python -m pytest "$@"
