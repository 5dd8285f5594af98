"""Where a run's files live: the one definition of the output and run directory layout.

    <train.output_dir>/
        mlflow.db               the local MLflow store (when no tracking server is configured)
        mlartifacts/            its artifacts
        <run_name>/             one run: Ray Train's run folder (RunConfig(name, storage_path))
            run.json            which MLflow run this directory belongs to (what --resume continues)
            checkpoint_*/       sharded training checkpoints, written and pruned by Ray Train
            adapter/            the exported PEFT adapter (the run's result)
            unsent_metrics.jsonl  metrics the tracking server did not take
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OutputDir:
    root: Path

    @property
    def mlflow_store(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

    def run(self, name: str) -> RunDir:
        return RunDir(self.root / name)


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def record(self) -> Path:
        return self.root / "run.json"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def unsent_metrics(self) -> Path:
        return self.root / "unsent_metrics.jsonl"

    def checkpoints(self) -> list[Path]:
        return sorted(p for p in self.root.glob("checkpoint_*") if p.is_dir())

    def write_record(self, mlflow_run_id: str) -> None:
        self.root.mkdir(parents=True)
        self.record.write_text(json.dumps({"mlflow_run_id": mlflow_run_id}))

    def recorded_mlflow_run_id(self) -> str:
        return json.loads(self.record.read_text())["mlflow_run_id"]
