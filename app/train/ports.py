"""What a recipe is handed: where rank 0 logs (an MLflow run, app/tracking/logger.py; nothing on the other ranks),
where checkpoints go (Ray Train's, app/launch/rank.py; directories in the unit tests), and the rest of what it
works with, as one RecipeParts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from app.model.adapter import FrozenAdapter
from app.runs.layout import RunDir
from app.train.checkpoint import TrainerState
from app.train.progress import StartupClock
from app.train.rollouts import Rollouts, Scorer


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


@dataclass(frozen=True)
class RecipeParts:
    """What a recipe is handed beside its plan, rank and data, each part optional: where it logs (`tracker`) and
    checkpoints (`checkpoints`, `run_dir`); when the job started (wall clock: the first step reports how long the
    whole job took to reach it) and the start-up clock the worker began (its points before the recipe existed);
    the data mixture's source names (with several, the share of records each has given is logged as
    data_share/<name>); model.init_adapter's weights (where the adapter starts, and DPO's reference) and the
    teacher's adapter (train.objective=distill), both read by the driver; a hook's slower steps
    (app/launch/worker_hooks.py: the resilience tests'); an online objective's rollout side and reward scorer."""

    tracker: Tracker | None = None
    checkpoints: CheckpointStore | None = None
    run_dir: RunDir | None = None
    job_start_time: float | None = None
    startup: StartupClock | None = None
    source_names: tuple[str, ...] = ()
    init_adapter: dict[str, torch.Tensor] | None = None
    teacher: FrozenAdapter | None = None
    pace: Callable[[int], None] | None = None
    rollouts: Rollouts | None = None
    scorer: Scorer | None = None
