#!/usr/bin/env bash
# Stop the stack cluster/local-up.sh started. Its data ($STACK_DIR) is kept.
set -uo pipefail
STACK_DIR=${STACK_DIR:-$PWD/.stack}
BIN=${BIN:-$(dirname "$(command -v python)")}
if [ -f "$STACK_DIR/mlflow.pid" ]; then
  kill "$(cat "$STACK_DIR/mlflow.pid")" 2>/dev/null
  rm -f "$STACK_DIR/mlflow.pid"
fi
"$BIN/ray" stop --force >/dev/null 2>&1
echo "stopped; data kept in $STACK_DIR"
