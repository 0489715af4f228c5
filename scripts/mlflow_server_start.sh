#!/usr/bin/env bash
# Start a real MLflow tracking server on loopback, in the background.
#
#   MLFLOW_BIN   mlflow executable              (default: the project's .venv/bin/mlflow, else mlflow on PATH)
#   MLFLOW_DIR   db + artifacts + log + pid     (default ${TMPDIR:-/tmp}/marin-mlflow; wiped on start)
#   MLFLOW_PORT  port                           (default 5055)
#   MLFLOW_ARTIFACT_MODE proxy | direct         (default proxy)
#      proxy : --artifacts-destination DIR; clients upload/download over HTTP (mlflow-artifacts:/)
#      direct: --default-artifact-root DIR --no-serve-artifacts; clients write DIR themselves
#              (works only because client and server share this filesystem)
#   MLFLOW_SERVER_ENABLE_JOB_EXECUTION  (default false here; MLflow's default true starts a job
#      runner + 7 huey consumer processes: ~2.2 GB RSS instead of ~0.4 GB, slower start)
#
# Prints the tracking URI; stop with mlflow_server_stop.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z ${MLFLOW_BIN:-} ]]; then
  if [[ -x $root/.venv/bin/mlflow ]]; then MLFLOW_BIN=$root/.venv/bin/mlflow; else MLFLOW_BIN=mlflow; fi
fi
MLFLOW_DIR=${MLFLOW_DIR:-${TMPDIR:-/tmp}/marin-mlflow}
MLFLOW_PORT=${MLFLOW_PORT:-5055}
MLFLOW_ARTIFACT_MODE=${MLFLOW_ARTIFACT_MODE:-proxy}
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}
# no usage telemetry to the internet from the server or its UI (marin.track does the same for runs)
export MLFLOW_DISABLE_TELEMETRY=${MLFLOW_DISABLE_TELEMETRY:-true}

if [[ -s $MLFLOW_DIR/server.pid ]]; then bash "$(dirname "$0")/mlflow_server_stop.sh" || true; fi
rm -rf "$MLFLOW_DIR"; mkdir -p "$MLFLOW_DIR/artifacts"
if [[ $MLFLOW_ARTIFACT_MODE == proxy ]]; then
  art=(--artifacts-destination "$MLFLOW_DIR/artifacts")
else
  art=(--default-artifact-root "$MLFLOW_DIR/artifacts" --no-serve-artifacts)
fi
t0=$(date +%s%N)
# setsid: own process group, so the stop script can end the server and its workers together
setsid "$MLFLOW_BIN" server \
  --backend-store-uri "sqlite:///$MLFLOW_DIR/mlflow.db" "${art[@]}" \
  --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
  >"$MLFLOW_DIR/server.log" 2>&1 < /dev/null &
echo $! > "$MLFLOW_DIR/server.pid"
for _ in $(seq 600); do
  if curl -fsS "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$(cat "$MLFLOW_DIR/server.pid")" 2>/dev/null; then
    echo "mlflow server died"; cat "$MLFLOW_DIR/server.log"; exit 1
  fi
  sleep 0.1
done
curl -fsS "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null || { echo "mlflow server not healthy"; tail -30 "$MLFLOW_DIR/server.log"; exit 1; }
printf 'mlflow server up in %d ms: http://127.0.0.1:%s (pid %s, dir %s, artifacts %s)\n' \
  "$(( ($(date +%s%N) - t0) / 1000000 ))" "$MLFLOW_PORT" "$(cat "$MLFLOW_DIR/server.pid")" "$MLFLOW_DIR" "$MLFLOW_ARTIFACT_MODE"
