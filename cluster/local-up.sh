#!/usr/bin/env bash
# A local development stack, on loopback only:
#   - a Ray head node with token authentication (Ray 2.60's default), dashboard/Jobs API on 127.0.0.1:8265
#   - an MLflow tracking server on 127.0.0.1:5000 that proxies artifact storage (--serve-artifacts)
# State (MLflow store, artifacts, logs) goes to $STACK_DIR (default: ./.stack). Stop with cluster/local-down.sh.
set -euo pipefail
STACK_DIR=${STACK_DIR:-$PWD/.stack}
BIN=${BIN:-$(dirname "$(command -v python)")}
RAY_PORT=${RAY_PORT:-6379} DASHBOARD_PORT=${DASHBOARD_PORT:-8265} MLFLOW_PORT=${MLFLOW_PORT:-5000}
mkdir -p "$STACK_DIR"

export RAY_AUTH_MODE=token
"$BIN/ray" start --head --node-ip-address=127.0.0.1 --port="$RAY_PORT" \
  --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
  --num-cpus="$(( $(nproc) + 2 ))" --disable-usage-stats >"$STACK_DIR/ray-start.log" 2>&1

"$BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" \
  --backend-store-uri "sqlite:///$STACK_DIR/mlflow.db" \
  --artifacts-destination "$STACK_DIR/mlartifacts" --serve-artifacts \
  >"$STACK_DIR/mlflow.log" 2>&1 &
echo $! >"$STACK_DIR/mlflow.pid"
for _ in $(seq 60); do
  curl -sf "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null || { echo "MLflow did not start: $STACK_DIR/mlflow.log" >&2; exit 1; }

cat <<MSG
Ray head:       127.0.0.1:$RAY_PORT  (Jobs API and dashboard: http://127.0.0.1:$DASHBOARD_PORT)
MLflow server:  http://127.0.0.1:$MLFLOW_PORT
Submit the demo to it (the auth token is read from Ray's token file; it is never printed):
  export RAY_AUTH_MODE=token
  ray job submit --address http://127.0.0.1:$DASHBOARD_PORT --working-dir . -- \\
    python -m jobs.finetune --config jobs/configs/embedded.yaml --set mlflow.tracking_uri=http://127.0.0.1:$MLFLOW_PORT \\
      --set model.path=\$PWD/.cache/embedded/model --set data.train_path=\$PWD/.cache/embedded/data/train.jsonl \\
      --set data.eval_path=\$PWD/.cache/embedded/data/eval.jsonl --set train.output_dir=$STACK_DIR/outputs
(--working-dir uploads the repo without what .gitignore lists, so the embedded model is named by its absolute path.)
MSG
