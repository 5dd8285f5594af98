"""The training step alone, under torchrun, on synthetic tokens: benchmark mode (c).

    torchrun --nproc-per-node 8 -m benchmarks.step --model-config benchmarks/shapes/llama31_8b.json \
        --seq-len 2048 --micro-batch 1 --steps 20

Needs only torch, transformers and peft (no Ray, MLflow, datasets or pydantic): it runs on a bare GPU
box. The model is built from a config with random weights (no download) on the meta device, or
loaded from --model-path, by the same loader and sharding as the job (app.model.sharded_loading,
app.model.sharding), and trains LoRA with the job's loss. Prints one JSON line (rank 0): steady
tokens/s per worker (warm-up steps excluded), time to first step, peak memory, MFU where the device's
peak FLOP rate is known.
With --steps 0 it only loads, and reports host memory before and while loading (max over workers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist

from app.data.chat import IGNORE_INDEX
from app.model.build import build_meta_lora_model, build_training_model
from app.model.hardware import has_fast_bf16, resolve_dtype
from app.model.quantization import is_nf4, quantize_layer, stored_bytes
from app.model.sharding import (
    build_device_mesh,
    init_torchrun_process_group,
    local_region,
    shard_group_size,
    shard_model,
    trainable_parameters,
)
from app.model.slices import allocate_local_shards
from app.train.loss import scaled_micro_batch_loss
from app.train.progress import peak_memory_gb

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}  # dense, per GPU


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun ... -m benchmarks.step", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", help="a Hugging Face config.json: random weights, built on the meta device")
    src.add_argument("--model-path", help="a model directory with safetensors weights")
    p.add_argument("--load", choices=["full", "sharded"], default="sharded", help="with --model-path")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput figure")
    p.add_argument("--param-dtype", default="auto", help="compute dtype; auto: by the hardware, as the job does")
    p.add_argument("--dtype", default="auto", help="stored dtype of the frozen base")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument("--checkpoint-every-n-layers", type=int, default=1, help="model.checkpoint_every_n_layers")
    p.add_argument("--no-reshard-after-forward", action="store_true")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--quantization", choices=["none", "nf4"], default="none", help="model.quantization")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (model.compile)")
    p.add_argument("--attn-implementation", help="model.attn_implementation, e.g. flash_attention_2")
    p.add_argument("--mesh", type=int, nargs=2, metavar=("REPLICAS", "SHARD"))
    p.add_argument("--loss-chunk-tokens", type=int, default=1024, help="as train.loss_chunk_tokens; 0: plain loss")
    p.add_argument("--pack", type=int, default=1, metavar="RECORDS",
                   help="records per row, packed as data.packing does (restarting position ids)")
    return p.parse_args(argv)


def anonymous_rss_gb() -> float:
    """Private resident memory (RssAnon): without the file-backed pages of memory-mapped safetensors,
    which are page cache that every rank on a node shares."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 2**20


class PeakSampler:
    """The highest anonymous RSS seen while a block runs, sampled every 5 ms by a thread."""

    def __enter__(self):
        self.peak, self._done = anonymous_rss_gb(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.005):
            self.peak = max(self.peak, anonymous_rss_gb())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_rss_gb())


def build(args, device: torch.device):
    fast_bf16 = has_fast_bf16(device)
    args.dtype, args.param_dtype = resolve_dtype(args.dtype, fast_bf16), resolve_dtype(args.param_dtype, fast_bf16)
    model_cfg = SimpleNamespace(path=args.model_path or os.path.dirname(os.path.abspath(args.model_config)),
                                revision=None, trust_remote_code=False, dtype=args.dtype, load=args.load,
                                gradient_checkpointing=not args.no_activation_checkpointing, compile=args.compile,
                                checkpoint_every_n_layers=args.checkpoint_every_n_layers,
                                attn_implementation=args.attn_implementation, quantization=args.quantization)
    lora_cfg = SimpleNamespace(r=args.lora_r, alpha=2.0 * args.lora_r, dropout=0.0, target_modules="all-linear",
                               use_dora=False, use_rslora=False)
    fsdp_cfg = SimpleNamespace(param_dtype=args.param_dtype, reduce_dtype="float32", cpu_offload=args.cpu_offload,
                               reshard_after_forward=not args.no_reshard_after_forward)
    mesh = build_device_mesh(device.type, args.mesh)
    if args.model_path:
        return build_training_model(model_cfg, lora_cfg, fsdp_cfg, mesh, 0, device)
    random_nf4 = partial(quantize_layer, shards=shard_group_size(mesh), full_weight=lambda linear: torch.empty_like(
        linear.weight, device=device).normal_(0.0, 0.02))
    model = shard_model(build_meta_lora_model(model_cfg, lora_cfg, 0, config_file=args.model_config), mesh, fsdp_cfg,
                        args.compile, random_nf4 if args.quantization == "nf4" else None)
    init_random(model, device)
    return model


@torch.no_grad()
def init_random(model, device: torch.device) -> None:
    """Random weights for a shape-only benchmark: the numbers do not matter, the memory and time do."""
    allocate_local_shards(model, device)
    for name, param in model.named_parameters():
        if is_nf4(param):  # quantized from random weights as its layer was sharded
            continue
        local, _ = local_region(param)
        local.zero_() if "lora_B" in name else local.normal_(0.0, 0.02)


def flops_per_token(model, seq_len: int) -> float:
    """Model FLOPs of one LoRA training token: forward 2N, backward through the activations 2N (no
    weight gradients for the frozen base), plus causal attention (fwd 2·L·s·d, bwd twice that)."""
    config = model.config
    n = sum(p.numel() for p in model.parameters())
    return 4 * n + 6 * config.num_hidden_layers * seq_len * config.hidden_size


def main(argv=None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    rank, world, device = init_torchrun_process_group(args.cpu_offload)
    rss_before_load = anonymous_rss_gb()
    with PeakSampler() as loading:
        model = build(args, device)
    load_seconds = time.perf_counter() - t_start
    result = {"world_size": world, "dtype": args.dtype, "param_dtype": args.param_dtype,
              "rss_before_load_gb": rss_before_load, "peak_anon_rss_loading_gb": loading.peak,
              "peak_rss_after_load_gb": peak_memory_gb(torch.device("cpu")),
              "load_seconds": load_seconds,
              "param_bytes_per_worker": sum(stored_bytes(p) for p in model.parameters())}
    if args.steps:
        with PeakSampler() as training:
            result |= train(model, args, device, world, t_start)
        result["peak_anon_rss_training_gb"] = training.peak
    peaks = torch.tensor([result.get("peak_memory_gb", 0.0), result["peak_rss_after_load_gb"],
                          result["peak_anon_rss_loading_gb"]], device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    result["peak_memory_gb"], result["peak_rss_after_load_gb"], result["peak_anon_rss_loading_gb"] = peaks.tolist()
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def synthetic_batch(rows: int, seq_len: int, records_per_row: int, vocab: int, generator) -> dict:
    """Random tokens; with several records per row, laid out as data.packing lays them out: position ids
    restart at each record and a record's first token is not a target (it would be predicted from the
    record before it)."""
    input_ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    batch = {"input_ids": input_ids, "labels": input_ids.clone()}
    if records_per_row > 1:
        length = -(-seq_len // records_per_row)
        batch["position_ids"] = (torch.arange(seq_len) % length).expand(rows, seq_len).contiguous()
        batch["labels"][batch["position_ids"] == 0] = IGNORE_INDEX
    return batch


def train(model, args, device: torch.device, world: int, t_start: float) -> dict:
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(dist.get_rank())
    batch = {k: v.to(device) for k, v in synthetic_batch(args.micro_batch, args.seq_len, args.pack, vocab,
                                                          generator).items()}
    tokens = torch.tensor(float(args.micro_batch * args.seq_len * args.accum * world), device=device)
    times = []
    first_step = None
    for _ in range(args.steps):
        t0 = time.perf_counter()
        for i in range(args.accum):
            model.set_requires_gradient_sync(i == args.accum - 1)
            loss, _ = scaled_micro_batch_loss(model, batch, tokens, world, args.loss_chunk_tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        last_loss = loss.item()
        first_step = first_step or time.perf_counter() - t_start
    steady = times[args.warmup:] or times
    tokens_per_worker = args.micro_batch * args.seq_len * args.accum * len(steady) / sum(steady)
    out = {"steps": args.steps, "step_seconds_median": statistics.median(steady),
           "step_seconds_mean_steady": statistics.mean(steady),
           "tokens_per_second_per_worker": tokens_per_worker, "time_to_first_step_seconds": first_step,
           "last_micro_batch_loss": last_loss,
           "peak_memory_gb": peak_memory_gb(device),
           "optimizer_bytes_per_worker": sum(local_region(t)[0].numel() * t.element_size()
                                             for s in optimizer.state.values() for t in s.values() if t.dim())}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        if peak:
            out["mfu"] = tokens_per_worker * flops_per_token(model, args.seq_len) / peak
        out["device"] = name
    return out


if __name__ == "__main__":
    main()
