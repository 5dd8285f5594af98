#!/usr/bin/env bash
# A local development stack, on loopback only:
#   - a Ray head node with token authentication (Ray 2.60's default), dashboard/Jobs API on 127.0.0.1:8265
#   - an MLflow tracking server on 127.0.0.1:5000 that proxies artifact storage (--serve-artifacts)
# State (runs, the embedded demo model, the MLflow store, logs) goes to $STACK_DIR (default: ./.stack);
# Ray's session files to $RAY_TMP (default /tmp/ray-stack-$RAY_PORT). Stop with cluster/local-down.sh
# (same variables): it stops the processes recorded in $STACK_DIR/processes.json and nothing else.
#
# What the jobs of this stack see (the Ray processes pass their environment on to every job):
#   FINETUNE_STORAGE=$STACK_DIR   relative train.output_dir and the embedded demo resolve there, so
#                                 `ray job submit ... -- python -m jobs.finetune --config jobs/configs/embedded.yaml`
#                                 works with no override, and runs outlive Ray's copy of the upload
#   MLFLOW_TRACKING_URI           this stack's server (or yours, if exported before: credentials in it
#                                 stay in this environment, never in a job's metadata)
#   HF_TOKEN                      if exported before: jobs/runtime_env.yaml passes it by reference
set -euo pipefail
STACK_DIR=$(mkdir -p "${STACK_DIR:-$PWD/.stack}" && cd "${STACK_DIR:-$PWD/.stack}" && pwd)
BIN=${BIN:-$(dirname "$(command -v python)")}
RAY_PORT=${RAY_PORT:-6379} DASHBOARD_PORT=${DASHBOARD_PORT:-8265} MLFLOW_PORT=${MLFLOW_PORT:-5000}
AGENT_PORT=${AGENT_PORT:-52365} CLIENT_PORT=${CLIENT_PORT:-10001}
RAY_TMP=${RAY_TMP:-/tmp/ray-stack-$RAY_PORT}
echo "$RAY_TMP" >"$STACK_DIR/ray-temp-dir"

# Token authentication needs a token: make one on a fresh machine, readable by this user only.
export RAY_AUTH_MODE=token
export HOME=${HOME:-$STACK_DIR}  # an empty HOME (a bare container) keeps the token with the stack
TOKEN_FILE=$HOME/.ray/auth_token
if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ ! -s "$TOKEN_FILE" ]; then
  (umask 077 && mkdir -p "$HOME/.ray" && "$BIN/ray" get-auth-token --generate >/dev/null)
fi
[ -f "$TOKEN_FILE" ] && chmod 600 "$TOKEN_FILE"

export FINETUNE_STORAGE=${FINETUNE_STORAGE:-$STACK_DIR}
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-http://127.0.0.1:$MLFLOW_PORT}
# Jobs run `python -m jobs.finetune`: the Ray processes (and so every job) find this Python first.
export PATH="$BIN:$PATH"
# `ray job stop` sends SIGTERM, then SIGKILL after this many seconds: time to end the MLflow run as KILLED.
export RAY_JOB_STOP_WAIT_TIME_S=${RAY_JOB_STOP_WAIT_TIME_S:-30}
# Ray Train asks the state API (this dashboard) whether a run's controller lives; named here, it never has
# to guess among several Ray clusters on one machine (it prints a traceback every few seconds when it does).
export RAY_API_SERVER_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT
# Ray Serve's fast request path (gRPC from proxy to replica, request logs buffered, user code on the replica's
# loop): jobs.serve's engines keep their own threads, so nothing of ours blocks that loop.
export RAY_SERVE_THROUGHPUT_OPTIMIZED=${RAY_SERVE_THROUGHPUT_OPTIMIZED:-1}
# Every process of this stack carries this id (Ray passes its environment on): local-down.sh finds by it
# what the stack started and left without a parent, and nothing else.
FINETUNE_STACK_ID=$("$BIN/python" -c 'import uuid; print(uuid.uuid4().hex)')
export FINETUNE_STACK_ID
"$BIN/ray" start --head --node-ip-address=127.0.0.1 --port="$RAY_PORT" --temp-dir="$RAY_TMP" \
  --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
  --dashboard-agent-listen-port="$AGENT_PORT" --ray-client-server-port="$CLIENT_PORT" \
  --num-cpus="$(( $(nproc) + 2 ))" --disable-usage-stats >"$STACK_DIR/ray-start.log" 2>&1 \
  || { echo "Ray did not start: $STACK_DIR/ray-start.log" >&2; exit 1; }

# One request worker (uvicorn's default is 4 processes, ~230 MB each) and no job runner (MLflow 3 starts
# five more processes for GenAI jobs this product never submits): a laptop's stack, one user.
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false "$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
  --backend-store-uri "sqlite:///$STACK_DIR/mlflow.db" \
  --artifacts-destination "$STACK_DIR/mlartifacts" --serve-artifacts \
  >"$STACK_DIR/mlflow.log" 2>&1 &
MLFLOW_PID=$!
for _ in $(seq 90); do
  curl -sf "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null || { echo "MLflow did not start: $STACK_DIR/mlflow.log" >&2; exit 1; }

# What local-down.sh may stop: these processes (pid and start time, so a reused pid is never hit) and
# the processes they start later (by the stack's id). Ray's client server names no temp dir: it is found by its port.
"$BIN/python" "$(dirname "$0")/stop_processes.py" record --out "$STACK_DIR/processes.json" \
  --stack-id "$FINETUNE_STACK_ID" --pid "$MLFLOW_PID" --cmdline "$RAY_TMP" --cmdline="--port=$CLIENT_PORT --mode=proxy"

cat <<MSG
Ray head:       127.0.0.1:$RAY_PORT  (Jobs API and dashboard: http://127.0.0.1:$DASHBOARD_PORT; token in $TOKEN_FILE)
MLflow server:  http://127.0.0.1:$MLFLOW_PORT
Runs are stored under $FINETUNE_STORAGE/outputs. Submit the demo to the stack:
  export RAY_AUTH_MODE=token RAY_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT
  ray job submit --working-dir . -- python -m jobs.finetune --config jobs/configs/embedded.yaml
MSG
