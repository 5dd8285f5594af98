"""Send what a run kept while its tracking server was unreachable: the run directory's journal.

Journal lines (app/tracking/logger.py, app/tracking/mlflow_run.py): {"metric", "value", "step", "timestamp"},
{"param", "value"}, {"artifacts": folder of the run directory, "artifact_path"}, {"table": file of the
run directory, "artifact_file"}, {"status"}. They are replayed in order, while holding the run (no job
may append to the journal meanwhile); once all are sent the journal is renamed
`unsent.jsonl.synced-<time>`. If the server fails midway, the lines not yet sent stay in the journal for
the next attempt. A param the server rejects (it already holds another value) is skipped; a status is
applied only if the run is still RUNNING there (a later attempt of the run may have ended it since).
"""

from __future__ import annotations

import json
import time

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from app.errors import UserInputError
from app.runs.claim import claim_is_live, this_process
from app.runs.layout import RunBusy, RunDir
from app.tracking.logger import JOURNAL, bound_http_calls

BATCH = 500


def sync_run(run_dir: RunDir, tracking_uri: str) -> dict[str, int]:
    """Replay the journal of `run_dir` into its MLflow run; returns how many records of each kind went."""
    if not run_dir.has_record():
        raise UserInputError(f"{run_dir.root}: not a run directory (no run.json)")
    if not run_dir.exists(JOURNAL):
        return {}
    bound_http_calls()
    owner = this_process()
    try:
        run_dir.claim(owner, claim_is_live)
    except RunBusy as busy:
        raise UserInputError(f"{run_dir.root}: a job ({busy.claim.get('ray_job') or busy.claim.get('pid')}) is "
                             "writing this run; sync once it has ended") from None
    try:
        return _replay(run_dir, MlflowClient(tracking_uri))
    finally:
        run_dir.release(owner)


def _replay(run_dir: RunDir, client: MlflowClient) -> dict[str, int]:
    run_id = run_dir.recorded_mlflow_run_id()
    entries = [json.loads(line) for line in run_dir.read_text(JOURNAL).splitlines() if line.strip()]
    statuses = [i for i, e in enumerate(entries) if "status" in e]
    entries = [e for i, e in enumerate(entries) if "status" not in e or i == statuses[-1]]  # the last one counts
    sent: dict[str, int] = {}
    done = 0
    try:
        while done < len(entries):
            done += _send_next(client, run_id, run_dir, entries[done:], sent)
    finally:
        rest = entries[done:]
        if rest:
            run_dir.write_text("".join(json.dumps(e) + "\n" for e in rest), JOURNAL)
    run_dir.write_text(run_dir.read_text(JOURNAL), f"{JOURNAL}.synced-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.delete(JOURNAL)
    return sent


def _send_next(client: MlflowClient, run_id: str, run_dir: RunDir, entries: list[dict], sent: dict) -> int:
    """Send the first entry, or the leading run of metrics and params as batches; returns how many went."""
    first = entries[0]
    if "metric" in first or "param" in first:
        run = []
        for entry in entries:
            if not ("metric" in entry or "param" in entry) or len(run) == BATCH:
                break
            run.append(entry)
        metrics = [Metric(e["metric"], e["value"], e["timestamp"], e["step"]) for e in run if "metric" in e]
        params = [Param(e["param"], e["value"]) for e in run if "param" in e]
        try:
            client.log_batch(run_id, metrics=metrics, params=params)
        except MlflowException as e:
            if e.error_code != "INVALID_PARAMETER_VALUE":
                raise
            client.log_batch(run_id, metrics=metrics)  # the params disagree with ones the run holds: skipped
            _count(sent, "params skipped (the run holds other values)", len(params))
            params = []
        _count(sent, "metrics and params", len(metrics) + len(params))
        return len(run)
    if "artifacts" in first:
        local, holder = run_dir.local_copy(first["artifacts"])
        try:
            client.log_artifacts(run_id, local, first["artifact_path"])
        finally:
            if holder:
                holder.cleanup()
        _count(sent, "artifact folders", 1)
    elif "table" in first:
        client.log_table(run_id, data=json.loads(run_dir.read_text(first["table"])),
                         artifact_file=first["artifact_file"])
        _count(sent, "tables", 1)
    elif "status" in first:
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status=first["status"])
            _count(sent, "statuses", 1)
    else:
        raise ValueError(f"{run_dir.path(JOURNAL)}: an entry this version cannot send: {first}")
    return 1


def _count(sent: dict, kind: str, n: int) -> None:
    sent[kind] = sent.get(kind, 0) + n
