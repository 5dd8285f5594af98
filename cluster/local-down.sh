#!/usr/bin/env bash
# Stop the stack cluster/local-up.sh started, and only that: the processes it recorded in
# $STACK_DIR/processes.json (matched by pid and start time) and what they started. Other Ray clusters
# on this machine keep running. Its data ($STACK_DIR: runs, the MLflow store) is kept.
set -uo pipefail
STACK_DIR=${STACK_DIR:-$PWD/.stack}
BIN=${BIN:-$(dirname "$(command -v python)")}
if "$BIN/python" "$(dirname "$0")/stop_processes.py" stop "$STACK_DIR/processes.json"; then
  rm -f "$STACK_DIR/processes.json"
  echo "stopped; data kept in $STACK_DIR"
else
  echo "not everything could be stopped (see above); data kept in $STACK_DIR" >&2
  exit 1
fi
