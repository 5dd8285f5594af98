"""The LoRA + FSDP2 fine-tuning recipe that every worker runs, top to bottom.

Plain torch: the process group must exist, and batches arrive as iterables of
{"input_ids", "labels"} tensors. Ray (app/worker.py) provides both on a cluster, plus a checkpoint
store; tests provide them with torch.multiprocessing and lists.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from transformers import get_scheduler

from app.checkpoint import TrainerState, gather_trainable_state, load_training_state, save_adapter, save_training_state
from app.config import FinetuneConfig
from app.generation import sample_generations
from app.loss import global_target_tokens, scaled_micro_batch_loss, summed_token_loss, target_token_count
from app.loading import build_sharded_lora_model
from app.model import load_tokenizer
from app.progress import Progress, peak_memory_gb
from app.sharding import build_device_mesh, full_grad_norm, trainable_parameters
from app.stream import PassOverShard, ShardStream, to_device


@dataclass
class Worker:
    rank: int
    world_size: int
    device: torch.device


class Tracker(Protocol):
    logged_through: int  # steps up to here were logged by an earlier attempt of this run

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None: ...
    def log_table(self, data: dict[str, list], artifact_file: str) -> None: ...


class NoTracking:
    """What ranks other than 0 log to: nothing."""

    logged_through = -1

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None: ...
    def log_table(self, data: dict[str, list], artifact_file: str) -> None: ...


class CheckpointStore(Protocol):
    def restore(self, load: Callable[[Path], TrainerState]) -> TrainerState | None: ...
    def save(self, write: Callable[[Path], None], metrics: dict[str, float]) -> None: ...


def finetune(cfg: FinetuneConfig, worker: Worker, train_pass: PassOverShard, eval_pass: Callable[[], Iterable],
             tracker: Tracker = NoTracking(), checkpoints: CheckpointStore | None = None,
             adapter_dir: Path | None = None, job_start_time: float | None = None) -> dict[str, float]:
    """Train until `train.max_steps` optimizer steps are done, the same on every rank.

    Starts from the latest checkpoint when there is one (a restarted worker group or a resumed run).
    `job_start_time` (wall clock) lets the first step report how long the whole job took to reach it.
    """
    t_start = time.perf_counter()
    job_start_time = job_start_time or time.time()
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.model)
    model = build_sharded_lora_model(cfg.model, cfg.lora, cfg.fsdp, build_device_mesh(worker.device.type, cfg.scaling.mesh),
                                     cfg.train.seed, worker.device)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
    scheduler = get_scheduler(cfg.train.lr_schedule, optimizer, num_warmup_steps=cfg.train.warmup_steps,
                              num_training_steps=cfg.train.max_steps)

    state = checkpoints.restore(lambda d: load_training_state(d, model, optimizer)) if checkpoints else None
    if state is None:
        eval_loss = evaluate(model, eval_pass, worker)
        state = TrainerState(step=0, epoch=0, rows_into_epoch=0, scheduler={}, initial_eval_loss=eval_loss)
        _log(tracker, _eval_metrics(eval_loss), step=0)
    else:
        scheduler.load_state_dict(state.scheduler)
        eval_loss = float("nan")
        tracker.log_metrics({"resumed_from_step": state.step}, step=state.step)
    batches = ShardStream(train_pass, worker.device, state.epoch, state.rows_into_epoch // worker.world_size)
    progress = Progress(state.step + 1, cfg.train.max_steps, enabled=worker.rank == 0)
    steady_tokens, steady_seconds, steady_data_wait = 0, 0.0, 0.0
    train_loss = float("nan")
    model.train()
    for step in range(state.step + 1, cfg.train.max_steps + 1):
        t0 = time.perf_counter()
        micro_batches = [next(batches) for _ in range(cfg.grad_accum_steps)]
        data_wait = time.perf_counter() - t0  # the time this step waited on the data pipeline
        global_tokens = global_target_tokens(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float64, device=worker.device)
        for i, batch in enumerate(micro_batches):
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce-scatter once per step
            loss, token_loss = scaled_micro_batch_loss(model, batch, global_tokens, worker.world_size)
            loss.backward()
            loss_sum += token_loss
        grad_norm = full_grad_norm(torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        step_totals = torch.stack([loss_sum, _real_tokens(micro_batches, tokenizer.pad_token_id)])
        dist.all_reduce(step_totals)  # global loss sum and non-pad token count
        loss_total, tokens, target_tokens, grad_norm = torch.cat(  # the step's one device-to-host sync
            [step_totals, global_tokens.reshape(1), grad_norm.reshape(1).double()]).tolist()
        train_loss = loss_total / target_tokens
        seconds = time.perf_counter() - t0
        if step > state.step + 1:  # the first step of an attempt pays for warm-up
            steady_tokens, steady_seconds = steady_tokens + tokens, steady_seconds + seconds
            steady_data_wait += data_wait
        metrics = {"train_loss": train_loss, "learning_rate": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                   "tokens_per_second": tokens / seconds, "peak_memory_gb": peak_memory_gb(worker.device),
                   "data_wait_seconds": data_wait}
        if step == state.step + 1:
            metrics["time_to_first_step_seconds"] = time.time() - job_start_time
        if step % cfg.train.eval_every == 0 or step == cfg.train.max_steps:
            eval_loss = evaluate(model, eval_pass, worker)
            metrics |= _eval_metrics(eval_loss)
        if step % cfg.train.log_every == 0 or "eval_loss" in metrics or step == state.step + 1:
            _log(tracker, metrics, step)
            progress.line(step, metrics)
        if checkpoints and (step % cfg.train.checkpoint_every == 0 or step == cfg.train.max_steps):
            position = TrainerState(step, batches.epoch, batches.rows_into_epoch * worker.world_size,
                                    scheduler.state_dict(), state.initial_eval_loss)
            t_save = time.perf_counter()
            checkpoints.save(lambda d: save_training_state(d, model, optimizer, position),
                             {"step": step, "train_loss": train_loss})
            _log(tracker, {"checkpoint_save_seconds": time.perf_counter() - t_save}, step)

    if math.isnan(eval_loss):  # resumed from the final checkpoint: nothing trained in this attempt
        eval_loss = evaluate(model, eval_pass, worker)
    if cfg.train.sample_prompts:  # every rank decodes in lockstep; rank 0 logs the table
        tracker.log_table(sample_generations(model, eval_pass(), tokenizer, cfg.train.sample_prompts,
                                             cfg.train.sample_max_new_tokens, worker.device),
                          "eval/sample_generations.json")
    adapter_state = gather_trainable_state(model)  # collective: every rank
    if worker.rank == 0 and adapter_dir is not None:
        save_adapter(model, adapter_state, adapter_dir, tokenizer, cfg.to_yaml())
        tracker.log_artifacts(adapter_dir, "adapter")
    summary = {"steps": cfg.train.max_steps, "final_train_loss": train_loss, "final_eval_loss": eval_loss,
               "initial_eval_loss": state.initial_eval_loss,
               "tokens_per_second_steady": steady_tokens / steady_seconds if steady_seconds else float("nan"),
               "data_wait_fraction": steady_data_wait / steady_seconds if steady_seconds else float("nan"),
               "step_seconds_mean_steady": steady_seconds / max(1, cfg.train.max_steps - state.step - 1),
               "peak_memory_gb_max_over_workers": _max_over_ranks(peak_memory_gb(worker.device), worker),
               "worker_seconds": time.perf_counter() - t_start}
    tracker.log_metrics(summary, cfg.train.max_steps)
    return summary


@torch.no_grad()
def evaluate(model, eval_pass: Callable[[], Iterable], worker: Worker) -> float:
    """Mean loss per target token over the whole eval set, the same for any worker count.

    Every rank reads all eval batches and scores batches rank, rank + world, ...; ranks with fewer
    batches run an extra forward with no weight, since FSDP needs every rank in every forward.
    """
    model.eval()
    batches = [to_device(b, worker.device) for b in eval_pass()]
    mine = batches[worker.rank::worker.world_size]
    totals = torch.zeros(2, dtype=torch.float64, device=worker.device)
    for i in range(math.ceil(len(batches) / worker.world_size)):
        batch = mine[i] if i < len(mine) else batches[0]
        token_loss = summed_token_loss(model, batch)
        if i < len(mine):
            totals += torch.stack([token_loss.double(), target_token_count(batch["labels"]).double()])
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def _eval_metrics(eval_loss: float) -> dict[str, float]:
    return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50))}


def _log(tracker: Tracker, metrics: dict[str, float], step: int) -> None:
    """Steps an earlier attempt already logged are not logged again: one value per step in MLflow."""
    if step > tracker.logged_through:
        tracker.log_metrics(metrics, step)


def _real_tokens(micro_batches: list[dict], pad_id: int) -> torch.Tensor:
    """Tokens that are not right-padding: the throughput figure counts only these."""
    return sum((b["input_ids"] != pad_id).sum() for b in micro_batches).to(torch.float64)


def _max_over_ranks(value: float, worker: Worker) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=worker.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
