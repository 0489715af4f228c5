#!/usr/bin/env bash
# Stop the server started by mlflow_server_start.sh: SIGTERM to its process group (by pid file).
set -uo pipefail
MLFLOW_DIR=${MLFLOW_DIR:-${TMPDIR:-/tmp}/marin-mlflow}
[[ -s $MLFLOW_DIR/server.pid ]] || { echo "no pid file"; exit 0; }
pid=$(cat "$MLFLOW_DIR/server.pid")
kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
for _ in $(seq 100); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done
kill -KILL -- "-$pid" 2>/dev/null || true
rm -f "$MLFLOW_DIR/server.pid"
echo "mlflow server stopped"
