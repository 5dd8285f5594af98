"""The LoRA + FSDP2 fine-tuning recipe that every worker runs, top to bottom.

Plain torch: the process group must exist, and batches arrive as iterables of
{"input_ids", "labels"} tensors. Ray (app/worker.py) provides both on a cluster; tests provide them
with torch.multiprocessing and lists.
"""

from __future__ import annotations

import itertools
import math
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import get_scheduler

from app.checkpoint import gather_trainable_state, save_adapter
from app.config import FinetuneConfig
from app.loss import global_target_tokens, scaled_micro_batch_loss, summed_token_loss, target_token_count
from app.model import build_lora_model, load_tokenizer
from app.sharding import build_device_mesh, full_grad_norm, shard_model, trainable_parameters

Batches = Callable[[], Iterable[dict]]  # each call starts one pass over this rank's data


@dataclass
class Worker:
    rank: int
    world_size: int
    device: torch.device


class NoTracking:
    """What ranks other than 0 log to: nothing."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None: ...


def finetune(cfg: FinetuneConfig, worker: Worker, train_batches: Batches, eval_batches: Batches,
             tracker=NoTracking(), adapter_dir: Path | None = None) -> dict[str, float]:
    """Train for exactly `train.max_steps` optimizer steps on every rank; returns the run's figures."""
    t_start = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.model)
    model = build_lora_model(cfg.model, cfg.lora, cfg.train.seed, worker.device)
    shard_model(model, build_device_mesh(worker.device.type), cfg.fsdp)
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
    scheduler = get_scheduler(cfg.train.lr_schedule, optimizer, num_warmup_steps=cfg.train.warmup_steps,
                              num_training_steps=cfg.train.max_steps)
    pad_id = tokenizer.pad_token_id

    eval_loss = evaluate(model, eval_batches, worker)
    tracker.log_metrics({"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50))}, step=0)
    first_eval_loss = eval_loss
    batches = _endless(train_batches, worker.device)
    progress = Progress(cfg.train.max_steps, enabled=worker.rank == 0)
    tokens_seen, steady_tokens, steady_seconds = 0, 0, 0.0
    train_loss = float("nan")
    model.train()
    for step in range(1, cfg.train.max_steps + 1):
        t0 = time.perf_counter()
        micro_batches = [next(batches) for _ in range(cfg.grad_accum_steps)]
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

        step_tokens = torch.stack([loss_sum, _real_tokens(micro_batches, pad_id)])
        dist.all_reduce(step_tokens)  # global loss sum and token count: the step's one host sync
        train_loss = (step_tokens[0] / global_tokens).item()
        seconds = time.perf_counter() - t0
        tokens_seen += int(step_tokens[1])
        if step > 1:  # the first step pays for warm-up (allocations, first all-gathers)
            steady_tokens, steady_seconds = steady_tokens + int(step_tokens[1]), steady_seconds + seconds
        metrics = {"train_loss": train_loss, "learning_rate": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                   "tokens_per_second": step_tokens[1].item() / seconds, "peak_memory_gb": peak_memory_gb(worker)}
        if step % cfg.train.eval_every == 0 or step == cfg.train.max_steps:
            eval_loss = evaluate(model, eval_batches, worker)
            metrics |= {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 50))}
        if step % cfg.train.log_every == 0 or "eval_loss" in metrics:
            tracker.log_metrics(metrics, step)
            progress.line(step, metrics)

    adapter_state = gather_trainable_state(model)  # collective: every rank
    if worker.rank == 0 and adapter_dir is not None:
        save_adapter(model, adapter_state, adapter_dir, tokenizer)
        tracker.log_artifacts(adapter_dir, "adapter")
    summary = {"steps": cfg.train.max_steps, "final_train_loss": train_loss, "final_eval_loss": eval_loss,
               "initial_eval_loss": first_eval_loss, "tokens_seen": tokens_seen,
               "tokens_per_second_steady": steady_tokens / steady_seconds if steady_seconds else float("nan"),
               "peak_memory_gb_max_over_workers": _max_over_ranks(peak_memory_gb(worker), worker),
               "worker_seconds": time.perf_counter() - t_start}
    tracker.log_metrics(summary, cfg.train.max_steps)
    return summary


@torch.no_grad()
def evaluate(model, eval_batches: Batches, worker: Worker) -> float:
    """Mean loss per target token over the whole eval set, the same for any worker count.

    Every rank reads all eval batches and scores batches rank, rank + world, ...; ranks with fewer
    batches run an extra forward with no weight, since FSDP needs every rank in every forward.
    """
    model.eval()
    batches = [_to_device(b, worker.device) for b in eval_batches()]
    mine = batches[worker.rank::worker.world_size]
    rounds = math.ceil(len(batches) / worker.world_size)
    totals = torch.zeros(2, dtype=torch.float64, device=worker.device)
    for i in range(rounds):
        batch = mine[i] if i < len(mine) else batches[0]
        token_loss = summed_token_loss(model, batch)
        if i < len(mine):
            totals += torch.stack([token_loss.double(), target_token_count(batch["labels"]).double()])
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def _endless(train_batches: Batches, device: torch.device) -> Iterator[dict]:
    """Pass after pass over this rank's shard, so every rank can take exactly max_steps steps."""
    for epoch in itertools.count():
        empty = True
        for batch in train_batches():
            empty = False
            yield _to_device(batch, device)
        if empty:
            raise RuntimeError(f"this worker's training shard is empty (epoch {epoch}); "
                               "the dataset has fewer rows than workers")


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: torch.as_tensor(batch[k]).to(device, non_blocking=True) for k in ("input_ids", "labels")}


def _real_tokens(micro_batches: list[dict], pad_id: int) -> torch.Tensor:
    """Tokens that are not right-padding: the throughput figure counts only these."""
    return sum((b["input_ids"] != pad_id).sum() for b in micro_batches).to(torch.float64)


def peak_memory_gb(worker: Worker) -> float:
    """CUDA: peak allocated by torch. CPU: peak resident set size of this worker process."""
    if worker.device.type == "cuda":
        return torch.cuda.max_memory_allocated(worker.device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def _max_over_ranks(value: float, worker: Worker) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=worker.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class Progress:
    """One line per logged step on rank 0: step/total, loss, lr, throughput, ETA.

    Written to the process's real stdout: Ray Train's patched print would tee it into the job log twice.
    """

    def __init__(self, total_steps: int, enabled: bool):
        self.total, self.enabled, self.t0 = total_steps, enabled, time.perf_counter()

    def line(self, step: int, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / step * (self.total - step)
        extra = f" | eval_loss {m['eval_loss']:.4f}" if "eval_loss" in m else ""
        print(f"step {step}/{self.total} | loss {m['train_loss']:.4f}{extra} | lr {m['learning_rate']:.2e} | "
              f"grad_norm {m['grad_norm']:.3f} | {m['tokens_per_second']:,.0f} tok/s | "
              f"eta {int(eta // 60)}m{int(eta % 60):02d}s", file=sys.__stdout__, flush=True)
