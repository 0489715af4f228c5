#!/usr/bin/env bash
# Set up (first time only), then run the default job or any overrides: scripts/run.sh [overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python launch.py "$@"
