"""`adapters:`: several named LoRA adapters trained side by side over one base in one job.

Each adapter may set its own LoRA shape, its own learning rate and schedule, and its own data (train sources,
mixture shares, eval set); every key it leaves unset is the job's (`lora.*`, `train.*`, `data.*`). What it
cannot set is what the adapters share: the base and its loading, the record format and sequence length, the
batch, the objective, the steps. Without the section a run trains one adapter from `lora:` as it always has.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, model_validator

from app.config.objectives import objective_of
from app.config.sections import DataSection, LoraSection, ModelSection, Section, TrainSection
from app.config.tune import TuneSection

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a torch module name: no "."
RESERVED_NAMES = ("default", "reference")  # PEFT's and DPO's adapter names in a single-adapter run
LORA_KEYS = ("r", "alpha", "dropout", "target_modules", "use_rslora")
TRAIN_KEYS = ("learning_rate", "lr_schedule", "warmup_steps")
DATA_KEYS = ("train_path", "mixture_weights", "eval_path")


class AdapterSection(Section):
    """One adapter of `adapters:`: a name, and the LoRA and optimizer keys it sets (the rest are the job's)."""

    name: str = Field(description="the adapter's name: its folder under the run's adapter/ and its MLflow figures' "
                      "prefix (letters, digits, _ and -)")
    r: int | None = Field(None, gt=0, description="LoRA rank (unset: lora.r)")
    alpha: float | None = Field(None, gt=0, description="LoRA scaling numerator (unset: lora.alpha)")
    dropout: float | None = Field(None, ge=0.0, lt=1.0, description="dropout on the LoRA input (unset: lora.dropout)")
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None, description="module names to adapt (unset: lora.target_modules)")
    use_rslora: bool | None = Field(None, description="rank-stabilised scaling (unset: lora.use_rslora)")
    learning_rate: float | None = Field(None, gt=0.0, description="peak AdamW learning rate (unset: "
                                        "train.learning_rate)")
    lr_schedule: Literal["cosine", "linear", "constant"] | None = Field(None, description="decay after warm-up "
                                                                          "(unset: train.lr_schedule)")
    warmup_steps: int | None = Field(None, ge=0, description="linear warm-up steps (unset: train.warmup_steps)")
    train_path: str | list[str] | None = Field(None, description="its own training data, as data.train_path (a "
                                               "list: a mixture); unset: the job's")
    mixture_weights: list[float] | None = Field(None, description="its own shares of its train sources, as "
                                                "data.mixture_weights (unset: data.mixture_weights)")
    eval_path: str | None = Field(None, description="its own held-out data, as data.eval_path; unset with its own "
                                  "train_path: data.eval_fraction of it held out; unset otherwise: the job's")

    @model_validator(mode="before")
    @classmethod
    def _only_its_own_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    raise ValueError(f"{key!r} is the job's, shared by every adapter (an adapter sets only "
                                     f"{', '.join(LORA_KEYS + TRAIN_KEYS + DATA_KEYS)}); set it outside "
                                     "adapters:")
        return data

    def lora_of(self, job: LoraSection) -> LoraSection:
        """The job's LoRA section with this adapter's keys."""
        return LoraSection(**(job.model_dump() | self._set(LORA_KEYS)))

    def train_of(self, job: TrainSection) -> TrainSection:
        """The job's train section with this adapter's learning rate and schedule."""
        return TrainSection(**(job.model_dump() | self._set(TRAIN_KEYS)))

    def data_of(self, job: DataSection) -> DataSection:
        """The job's data section with this adapter's sources; its own train sources without an eval set of its own
        hold out data.eval_fraction of them, not the job's eval set."""
        own = self._set(DATA_KEYS)
        if "train_path" in own:
            own.setdefault("eval_path", None)
            own.setdefault("mixture_weights", None)
        return DataSection(**(job.model_dump() | own))

    def alone_values(self, job_data: DataSection) -> dict[str, Any]:
        """What `FinetuneConfig.with_set` takes to make the job's config this adapter's alone: no adapters: (nor a
        sweep in one job, nor adapters sharing micro-batches), its keys in lora:, train: and data:."""
        data = self.data_of(job_data)
        return ({"adapters": [], "tune.in_one_job": False, "train.adapters_per_micro_batch": 1}
                | {f"lora.{key}": value for key, value in self._set(LORA_KEYS).items()}
                | {f"train.{key}": value for key, value in self._set(TRAIN_KEYS).items()}
                | ({f"data.{key}": getattr(data, key) for key in DATA_KEYS} if self._set(DATA_KEYS) else {}))

    def with_paths(self, resolve: Callable[[str | None], str | None]) -> AdapterSection:
        """This adapter with its data locations passed through `resolve` (made absolute where they are read)."""
        paths = self.train_path if isinstance(self.train_path, list) else [self.train_path]
        train = [resolve(path) for path in paths]
        return AdapterSection(**(self.model_dump() | {"train_path": train if isinstance(self.train_path, list)
                                                      else train[0], "eval_path": resolve(self.eval_path)}))

    def _set(self, keys: tuple[str, ...]) -> dict[str, Any]:
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}


def adapters_are_named_once(adapters: list[AdapterSection]) -> str | None:
    names = [adapter.name for adapter in adapters]
    for name in names:
        if not ADAPTER_NAME.fullmatch(name) or name in RESERVED_NAMES or name in "lora_":
            return (f"adapters: name {name!r} must be 1-64 letters, digits, '_' or '-' (starting with a letter "
                    f"or digit), not {' or '.join(RESERVED_NAMES)} and not part of 'lora_' (PEFT's weight names)")
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        return f"adapters: {', '.join(repeated)} named more than once; each adapter needs its own name"
    return None


def one_job_sweeps_have_adapters(adapters: list[AdapterSection], tune: TuneSection) -> str | None:
    if tune.in_one_job and not adapters:
        return "tune.in_one_job: the trials of a sweep in one job are its adapters; give adapters: (jobs.tune does)"
    if tune.in_one_job and tune.scheduler == "pbt":
        return ("tune.in_one_job with tune.scheduler=pbt: adapters in one job are halved (asha) or all trained (fifo); "
                "run a PBT sweep without --in-one-job")
    return None


def adapters_train_what_one_job_can(adapters: list[AdapterSection], train: TrainSection,
                                    model: ModelSection) -> str | None:
    """What several adapters in one job do not do yet, refused before anything starts."""
    if not adapters:
        return None
    unsupported = {f"train.objective={train.objective}": not objective_of(train).side_by_side,
                   "model.init_adapter": model.init_adapter is not None,
                   "model.compile=true": model.compile is True,
                   "train.checkpoint_adapter=true": train.checkpoint_adapter,
                   "train.eval_tasks": bool(train.eval_tasks)}
    if found := [key for key, present in unsupported.items() if present]:
        return (f"adapters: {found[0]} is for a job of one adapter (several adapters train with sft, from the seed, "
                "exported to adapter/<name>/); unset it, or train that adapter in a job of its own")
    return None


def adapters_share_what_they_can(adapters: list[AdapterSection], train: TrainSection, lora: LoraSection) -> str | None:
    shared = train.adapters_per_micro_batch
    if shared == "auto" or shared == 1:
        return None
    if not adapters:
        return (f"train.adapters_per_micro_batch={shared} is for a job of several adapters (adapters:); set it to auto "
                "or 1")
    if shared > len(adapters):
        return (f"train.adapters_per_micro_batch={shared} is more than the job's {len(adapters)} adapters; set at most "
                f"{len(adapters)}, or auto")
    if lora.use_dora:
        return ("train.adapters_per_micro_batch>1 with lora.use_dora: DoRA adapters take a pass each; set "
                "train.adapters_per_micro_batch to 1 or auto")
    return None


def data_streams(adapters: list[AdapterSection], job: DataSection) -> dict[str, str]:
    """The stream of rows each adapter trains on, by adapter name: "" for the job's data, else the name of the first
    adapter with the same data (adapters with the same data share one stream: its rows built, held and read
    once)."""
    first: dict[str, str] = {job.model_dump_json(): ""}
    return {adapter.name: first.setdefault(adapter.data_of(job).model_dump_json(), adapter.name)
            for adapter in adapters}


def adapter_data_is_whole(adapters: list[AdapterSection], data: DataSection) -> str | None:
    """An adapter's own data, checked as the job's is: a share per source."""
    for adapter in adapters:
        own = adapter.data_of(data)
        weights = own.mixture_weights
        if weights is not None and (len(weights) != len(own.train_paths) or min(weights) <= 0):
            return (f"adapters: {adapter.name}'s mixture_weights={weights} must give one positive weight for each of "
                    f"the {len(own.train_paths)} sources in its train_path (unset: the job's data.train_path)")
    return None
