#!/usr/bin/env bash
# A local development stack, on loopback only:
#   - a Ray head node with token authentication (Ray 2.60's default), dashboard/Jobs API on 127.0.0.1:8265
#   - an MLflow tracking server on 127.0.0.1:5000 that proxies artifact storage (--serve-artifacts)
# State (MLflow store, artifacts, logs) goes to $STACK_DIR (default: ./.stack); Ray's session files to
# $RAY_TMP (default /tmp/ray-stack-$RAY_PORT). Stop with cluster/local-down.sh (same variables).
# Secrets the jobs need (HF_TOKEN) are read from this shell's environment by the Ray processes: export
# them before running this script; jobs/runtime_env.yaml passes them to jobs without putting them in
# any job's metadata.
set -euo pipefail
STACK_DIR=${STACK_DIR:-$PWD/.stack}
BIN=${BIN:-$(dirname "$(command -v python)")}
RAY_PORT=${RAY_PORT:-6379} DASHBOARD_PORT=${DASHBOARD_PORT:-8265} MLFLOW_PORT=${MLFLOW_PORT:-5000}
AGENT_PORT=${AGENT_PORT:-52365} CLIENT_PORT=${CLIENT_PORT:-10001}
RAY_TMP=${RAY_TMP:-/tmp/ray-stack-$RAY_PORT}
mkdir -p "$STACK_DIR"
echo "$RAY_TMP" >"$STACK_DIR/ray-temp-dir"

export RAY_AUTH_MODE=token
# Jobs run `python -m jobs.finetune`: the Ray processes (and so every job) find this Python first.
export PATH="$BIN:$PATH"
# `ray job stop` sends SIGTERM, then SIGKILL after this many seconds: time to end the MLflow run as KILLED.
export RAY_JOB_STOP_WAIT_TIME_S=${RAY_JOB_STOP_WAIT_TIME_S:-30}
"$BIN/ray" start --head --node-ip-address=127.0.0.1 --port="$RAY_PORT" --temp-dir="$RAY_TMP" \
  --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
  --dashboard-agent-listen-port="$AGENT_PORT" --ray-client-server-port="$CLIENT_PORT" \
  --num-cpus="$(( $(nproc) + 2 ))" --disable-usage-stats >"$STACK_DIR/ray-start.log" 2>&1 \
  || { echo "Ray did not start: $STACK_DIR/ray-start.log" >&2; exit 1; }

"$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" \
  --backend-store-uri "sqlite:///$STACK_DIR/mlflow.db" \
  --artifacts-destination "$STACK_DIR/mlartifacts" --serve-artifacts \
  >"$STACK_DIR/mlflow.log" 2>&1 &
echo $! >"$STACK_DIR/mlflow.pid"
for _ in $(seq 90); do
  curl -sf "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null || { echo "MLflow did not start: $STACK_DIR/mlflow.log" >&2; exit 1; }

cat <<MSG
Ray head:       127.0.0.1:$RAY_PORT  (Jobs API and dashboard: http://127.0.0.1:$DASHBOARD_PORT)
MLflow server:  http://127.0.0.1:$MLFLOW_PORT
Submit the demo to it (the auth token is read from Ray's token file; it is never printed):
  export RAY_AUTH_MODE=token
  python -m jobs.submit --address http://127.0.0.1:$DASHBOARD_PORT submit --config jobs/configs/embedded.yaml \\
    --set model.path=\$PWD/.cache/embedded/model --set data.train_path=\$PWD/.cache/embedded/data/train.jsonl \\
    --set data.eval_path=\$PWD/.cache/embedded/data/eval.jsonl --set train.output_dir=$STACK_DIR/outputs --follow
(the working directory upload leaves out what .gitignore lists, so the embedded model is named by its absolute path;
 jobs/runtime_env.yaml points the jobs at MLflow on 127.0.0.1:5000)
MSG
