#!/usr/bin/env bash
# Stop the stack cluster/local-up.sh started (only that one: other Ray clusters on this machine keep
# running). Its data ($STACK_DIR) is kept.
set -uo pipefail
STACK_DIR=${STACK_DIR:-$PWD/.stack}
BIN=${BIN:-$(dirname "$(command -v python)")}
RAY_PORT=${RAY_PORT:-6379}
RAY_TMP=$(cat "$STACK_DIR/ray-temp-dir" 2>/dev/null || echo "/tmp/ray-stack-$RAY_PORT")
MLFLOW_PID=$(cat "$STACK_DIR/mlflow.pid" 2>/dev/null || echo 0)
"$BIN/python" "$(dirname "$0")/stop_processes.py" --pid "$MLFLOW_PID" --cmdline "$RAY_TMP" --cmdline ":$RAY_PORT"
rm -f "$STACK_DIR/mlflow.pid"
echo "stopped; data kept in $STACK_DIR"
