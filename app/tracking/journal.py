"""The run's journal (`unsent.jsonl`): what the tracking server did not take, kept in the run directory
until `python -m jobs.sync` replays it into the MLflow run.

Entries, one JSON object a line: {"metric", "value", "step", "timestamp"}, {"param", "value"},
{"artifacts": folder of the run directory, "artifact_path"}, {"table": file of the run directory,
"artifact_file"}, {"status"}. They are replayed in order, while holding the run (no job may append to
the journal meanwhile); once all are sent the journal is renamed `unsent.jsonl.synced-<time>`. If the
server fails midway, the lines not yet sent stay in the journal for the next attempt. A param the server
rejects (it already holds another value) is skipped; a status is applied only if the run is still RUNNING
there (a later attempt of the run may have ended it since). Lines that are no entry (half-written by a
crash, edited by hand) and entries naming a path outside the run directory are counted and not sent;
they stay in the journal (and so in its synced copy), and nothing outside the run directory is read.
"""

from __future__ import annotations

import json
import time

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils import validation

from app.errors import UserInputError, warn
from app.runs.claim import RunBusy, claim_of, describe_owner, this_process
from app.runs.layout import JOURNAL, RUN_RECORD, RunDir

BATCH = 500
FIELDS = {"metric": {"metric", "value", "step", "timestamp"}, "param": {"param", "value"},
          "artifacts": {"artifacts", "artifact_path"}, "table": {"table", "artifact_file"}, "status": {"status"}}
NOT_AN_ENTRY = "lines skipped (not a journal entry)"
OUTSIDE = "entries refused (a path outside the run directory)"


class Journal:
    """The journal of one run directory: its writers, and its replay."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    @property
    def location(self) -> str:
        return self.run_dir.path(JOURNAL)

    # -- what rank 0's logger and the driver keep --------------------------------------------------------

    def add_metrics_and_params(self, metrics: list[Metric], params: list[Param]) -> None:
        self._append([{"metric": m.key, "value": m.value, "step": m.step, "timestamp": m.timestamp} for m in metrics]
                     + [{"param": p.key, "value": p.value} for p in params])

    def add_artifacts(self, folder: str, artifact_path: str) -> None:
        """A folder of the run directory to upload as the run's artifacts under `artifact_path`."""
        self._append([{"artifacts": folder, "artifact_path": artifact_path}])

    def add_table(self, file: str, artifact_file: str) -> None:
        """A JSON file of the run directory to log as the run's table `artifact_file`."""
        self._append([{"table": file, "artifact_file": artifact_file}])

    def add_status(self, status: str) -> None:
        self._append([{"status": status}])

    def _append(self, entries: list[dict]) -> None:
        self.run_dir.append_lines([json.dumps(e) for e in entries], JOURNAL)

    # -- the replay ------------------------------------------------------------------------------------------

    def sync(self, tracking_uri: str) -> dict[str, int]:
        """Replay the journal into the run's MLflow run; returns how many records of each kind went, and
        how many lines were skipped."""
        if not self.run_dir.has_record():
            raise UserInputError(f"{self.run_dir.root}: not a run directory (no {RUN_RECORD}); check the run name "
                                 "and train.output_dir")
        if not self.run_dir.exists(JOURNAL):
            return {}
        claim, owner = claim_of(self.run_dir), this_process()
        try:
            claim.take(owner)
        except RunBusy as busy:
            raise UserInputError(f"{self.run_dir.root}: a job ({describe_owner(busy.owner)}) is writing this run; sync "
                                 "once it has ended") from None
        with claim.lease(owner):
            return self._replay(MlflowClient(tracking_uri))

    def _replay(self, client: MlflowClient) -> dict[str, int]:
        run_id = self.run_dir.recorded_mlflow_run_id()
        counts: dict[str, int] = {}
        entries, skipped = self._read(counts)
        statuses = [i for i, (e, _) in enumerate(entries) if "status" in e]
        entries = [(e, line) for i, (e, line) in enumerate(entries) if "status" not in e or i == statuses[-1]]
        sendable, done = [e for e, _ in entries], 0
        try:
            while done < len(sendable):
                done += self._send_next(client, run_id, sendable[done:], counts)
        finally:
            rest = skipped + [line for _, line in entries[done:]]
            if done < len(sendable):  # beside it, then renamed: a full disk keeps the journal as it was
                self.run_dir.replace_text("".join(line + "\n" for line in rest), JOURNAL)
        kept = f"{JOURNAL}.synced-{time.strftime('%Y%m%d-%H%M%S')}"
        self.run_dir.write_text(self.run_dir.read_text(JOURNAL), kept)
        self.run_dir.delete(JOURNAL)
        if skipped:
            warn(f"{self.location}: {len(skipped)} lines were not sent (no journal entry, or a path outside the run "
                 f"directory); they are kept in {self.run_dir.path(kept)}")
        return counts

    def _read(self, counts: dict[str, int]) -> tuple[list[tuple[dict, str]], list[str]]:
        """The journal's entries (each with its line), and the lines not to send."""
        entries, skipped = [], []
        for line in self.run_dir.read_text(JOURNAL).splitlines():
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                entry = None
            kind = next((k for k in FIELDS if isinstance(entry, dict) and k in entry), None)
            if kind is None or not FIELDS[kind] <= entry.keys():
                _count(counts, NOT_AN_ENTRY, 1)
                skipped.append(line)
            elif kind in ("artifacts", "table") and not (isinstance(entry[kind], str)
                                                          and self.run_dir.holds(entry[kind])):
                _count(counts, OUTSIDE, 1)
                skipped.append(line)
            else:
                entries.append((entry, line))
        return entries, skipped

    def _send_next(self, client: MlflowClient, run_id: str, entries: list[dict], sent: dict) -> int:
        """Send the first entry, or the leading run of metrics and params as batches; returns how many went."""
        first = entries[0]
        if "metric" in first or "param" in first:
            run = []
            for entry in entries:
                if not ("metric" in entry or "param" in entry) or len(run) == BATCH:
                    break
                run.append(entry)
            metrics = [Metric(e["metric"], e["value"], e["timestamp"], e["step"]) for e in run
                       if "metric" in e and is_valid_name(e["metric"])]
            params = [Param(e["param"], e["value"]) for e in run if "param" in e and is_valid_name(e["param"])]
            if refused := len(run) - len(metrics) - len(params):
                _count(sent, "names MLflow refuses, skipped", refused)
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
            local, holder = self.run_dir.local_copy(first["artifacts"])
            try:
                client.log_artifacts(run_id, local, first["artifact_path"])
            finally:
                if holder:
                    holder.cleanup()
            _count(sent, "artifact folders", 1)
        elif "table" in first:
            client.log_table(run_id, data=json.loads(self.run_dir.read_text(first["table"])),
                             artifact_file=first["artifact_file"])
            _count(sent, "tables", 1)
        elif client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status=first["status"])
            _count(sent, "statuses", 1)
        return 1


def is_valid_name(name: str) -> bool:
    """Whether MLflow takes `name` as a metric or param name (its own rule)."""
    try:
        validation._validate_metric_name(name)
    except MlflowException:
        return False
    return True


def _count(counts: dict, kind: str, n: int) -> None:
    counts[kind] = counts.get(kind, 0) + n
