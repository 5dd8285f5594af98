"""What a recipe is handed to record a run: where rank 0 logs (an MLflow run, app/tracking/logger.py; nothing
on the other ranks) and where checkpoints go (Ray Train's, app/launch/rank.py; directories in the unit tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from app.train.checkpoint import TrainerState


class Tracker(Protocol):
    """Rank 0's MLflow run (app/tracking/logger.py). `once_per_step` metrics of a step an earlier attempt of
    the run already logged are dropped, so a restarted run keeps one value per step."""

    def log_metrics(self, metrics: dict[str, float], step: int, once_per_step: bool = True) -> None: ...
    def log_params(self, params: dict[str, object]) -> None: ...
    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None: ...
    def log_table(self, data: dict[str, list], artifact_file: str) -> None: ...


class NoTracking:
    """What ranks other than 0 log to: nothing."""

    def log_metrics(self, metrics: dict[str, float], step: int, once_per_step: bool = True) -> None: ...
    def log_params(self, params: dict[str, object]) -> None: ...
    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None: ...
    def log_table(self, data: dict[str, list], artifact_file: str) -> None: ...


class CheckpointStore(Protocol):
    def restore(self, load: Callable[[Path], TrainerState]) -> TrainerState | None: ...
    def save(self, write: Callable[[Path], None], metrics: dict[str, float]) -> None: ...

    def preemption_deadline(self) -> float | None:
        """When a node of this group will be reclaimed (wall-clock seconds); None: no notice. Every rank sees
        the notice at the same step. Asked once per step by every rank."""

    def registration_seconds(self) -> float:
        """How long a saved checkpoint may take to count as the latest (for a drain's last save)."""
