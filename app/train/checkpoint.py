"""Checkpoints: the sharded training state (DCP) and the exported PEFT adapter.

A training checkpoint holds only what the base model cannot give back: the LoRA weights and their
AdamW state (each rank writes its own shard with torch.distributed.checkpoint), plus a small JSON of
the step, LR-scheduler state and data position, and each rank's RNG states (the CPU's and its
accelerator's). The frozen base weights are never written. DCP reshards on load, so a run saved by N
workers resumes on M.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from app.model.sharding import reshard
from app.runs.layout import ADAPTER_RUN_CONFIG

TRAINER_STATE = "trainer_state.json"
BEST_ADAPTER = "best_adapter.safetensors"  # train.export=best: the LoRA weights of the best evaluation
# strict=False: the frozen base is not in the checkpoint; dcp.load already fails on a missing LoRA key
_TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)


@dataclass
class TrainerState:
    step: int  # optimizer steps completed
    pass_index: int  # passes over the training data started
    rows_into_pass: int  # global rows of the current pass already trained on
    scheduler: dict
    initial_eval_loss: float  # of the untrained model, kept for the run's summary
    train_loss: float = float("nan")  # of the step saved: the summary of an attempt that trains no more steps
    best: dict = field(default_factory=dict)  # app.eval_tasks.BestEvaluation.state()
    stopped_early: bool = False  # train.early_stopping_patience ended the run at `step`
    initial_eval: dict = field(default_factory=dict)  # the untrained model's other eval figures (task metrics)
    adapters: dict = field(default_factory=dict)  # adapters trained side by side: each one's own (side_by_side.py)


# checkpoints written before "pass" named what they called "epoch": still resumed
_RENAMED = {"epoch": "pass_index", "rows_into_epoch": "rows_into_pass"}


def trainer_state(text: str) -> TrainerState:
    """TrainerState from its JSON in a checkpoint (of this version or an earlier one)."""
    return TrainerState(**{_RENAMED.get(key, key): value for key, value in json.loads(text).items()})


def save_training_state(directory: Path, model: nn.Module, optimizer, state: TrainerState, device: torch.device,
                        best_adapter: dict[str, torch.Tensor] | None = None, stream_state: dict | None = None) -> None:
    """A collective: every rank writes its shard of the LoRA weights and optimizer state to `directory`
    (rank 0 also the whole `best_adapter`, which every rank holds), its RNG states on the CPU and on
    `device`, the rank's accelerator (LoRA dropout draws there), and what its data stream holds that the data
    position does not give back (GRPO's rollouts still to train)."""
    reshard(model)  # the fp32 shards, not gathered copies an eval forward left behind
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_ONLY)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))
    rank = dist.get_rank()
    torch.save(rng_states(device), directory / f"rng-rank{rank}.pt")
    if stream_state:
        torch.save(stream_state, directory / f"stream-rank{rank}.pt")
    if rank == 0:
        (directory / TRAINER_STATE).write_text(json.dumps(asdict(state)))
        if best_adapter is not None:
            save_file({k: v.contiguous() for k, v in best_adapter.items()}, str(directory / BEST_ADAPTER))


def load_training_state(directory: Path, model: nn.Module, optimizer, device: torch.device) -> TrainerState:
    """Restore into an already sharded model and its optimizer, resharding to this world size, and the rank's
    RNG states on the CPU and on `device`."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE_ONLY)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],
                   options=_TRAINABLE_ONLY)
    rng = directory / f"rng-rank{dist.get_rank()}.pt"
    if rng.exists():  # absent when resuming on more ranks than saved: the seed set at start stands
        restore_rng_states(torch.load(rng), device)
    return trainer_state((directory / TRAINER_STATE).read_text())


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random number generator states: the CPU's, and `device`'s when it is an accelerator."""
    states = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        states[device.type] = torch.get_device_module(device).get_rng_state(device)
    return states


def restore_rng_states(states: dict[str, torch.Tensor] | torch.Tensor, device: torch.device) -> None:
    """Set what rng_states saved; a device state is set only on that kind of device (a run may resume on
    another). A bare tensor is the CPU state alone, as checkpoints written before device states held it."""
    if isinstance(states, torch.Tensor):
        states = {"cpu": states}
    torch.set_rng_state(states["cpu"])
    if device.type != "cpu" and device.type in states:
        torch.get_device_module(device).set_rng_state(states[device.type], device)


def load_stream_state(directory: Path) -> dict:
    """This rank's stream state (see save_training_state); empty where the checkpoint has none for it (another
    worker count saved it: the stream starts afresh from the data position)."""
    file = directory / f"stream-rank{dist.get_rank()}.pt"
    return torch.load(file, weights_only=False) if file.exists() else {}


def load_best_adapter(directory: Path) -> dict[str, torch.Tensor] | None:
    return load_file(str(directory / BEST_ADAPTER)) if (directory / BEST_ADAPTER).exists() else None


def gather_trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FULL tensor of every trainable (LoRA) parameter, on the CPU, on every rank.

    A collective: every rank must call it. Gathering only what trains avoids all-gathering the frozen
    base, and gathering every shard (not rank 0's slice) is what makes the saved lora_B whole. The
    shards are the fp32 master weights: units still holding gathered compute-dtype copies (after an
    eval forward) are resharded first.
    """
    reshard(model)
    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            state[name] = full.detach().to("cpu", copy=True)
    return state


def save_adapter(peft_model, trainable_state: dict[str, torch.Tensor], out_dir: Path, tokenizer,
                 run_config_yaml: str = "", adapter_name: str = "default") -> Path:
    """A PEFT adapter directory that `PeftModel.from_pretrained(base, folder)` loads as it is, with the
    tokenizer files and the config of the run that trained it (ADAPTER_RUN_CONFIG); returns the folder:
    `out_dir` for the one adapter of a run, `out_dir/<adapter_name>` for one of several (PEFT's layout)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out_dir, state_dict=trainable_state, safe_serialization=True,
                               selected_adapters=[adapter_name])  # not DPO's frozen reference, nor other adapters
    folder = out_dir if adapter_name == "default" else out_dir / adapter_name
    tokenizer.save_pretrained(folder)
    if run_config_yaml:
        (folder / ADAPTER_RUN_CONFIG).write_text(run_config_yaml)
    return folder
