#!/usr/bin/env bash
# Stop what services_up.sh started (by pid files, never by name). `--all` stops both services
# even if they were already running before services_up.sh.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${MARIN_SERVICES_DIR:-$(dirname "$here")/outputs/services}
all=${1:-}
want() { [[ $all == --all ]] || grep -qx "$1" "$dir/started" 2>/dev/null; }
if want mlflow; then bash "$here/mlflow_server_stop.sh"; fi
if want slurm; then bash "$here/slurm_stop.sh"; fi
rm -f "$dir/started"
