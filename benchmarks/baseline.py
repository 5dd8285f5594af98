"""The plain torchrun baseline of the benchmark, mode (b): what the seed blog does, nothing more.

    torchrun --nproc-per-node 2 -m benchmarks.baseline --model-path M --data train.jsonl --seq-len 32 \
        --micro-batch 16 --global-batch 32 --steps 60

Every rank loads the whole model, wraps it in PEFT LoRA, casts everything to bf16 (`--dtype`), applies
fully_shard to each decoder layer and the root with bf16 compute and bf16 gradient reduction, and
trains on tensors tokenized up front (the same records and chat template as the job), with the
model's own mean loss per micro-batch. No Ray, no Ray Data, no MLflow, no checkpoints. Prints one
JSON line (rank 0) with the same figures as the job reports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from app.model.sharding import init_torchrun_process_group
from app.train.progress import peak_memory_gb, private_memory_gb, resident_memory_gb


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun ... -m benchmarks.baseline", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--data", required=True, help="JSONL records (chat, instruction or prompt/completion)")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput figure")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the seed casts to bf16; float32 shows the loop itself on hardware without bf16 units")
    return p.parse_args(argv)


def pretokenized(path: str, tokenizer, seq_len: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    from app.data.formatting import tokenize_rows

    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    rows = tokenize_rows(records[rank::world], tokenizer, "auto", seq_len)
    return {k: torch.from_numpy(v).long() for k, v in rows.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rank, world, device = init_torchrun_process_group()
    rss, private = {"imports": resident_memory_gb()}, {"imports": private_memory_gb()}
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model_path).to(device)
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    dtype = getattr(torch, args.dtype)
    model.to(dtype)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    rss["model_built"], private["model_built"] = resident_memory_gb(), private_memory_gb()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    data = pretokenized(args.data, tokenizer, args.seq_len, rank, world)
    accum = args.global_batch // (args.micro_batch * world)

    times, tokens, first_step, row = [], [], None, 0
    for _ in range(args.steps):
        t0, step_tokens = time.perf_counter(), 0
        for _ in range(accum):
            if row + args.micro_batch > len(data["input_ids"]):
                row = 0
            ids = data["input_ids"][row:row + args.micro_batch].to(device)
            labels = data["labels"][row:row + args.micro_batch].to(device)
            row += args.micro_batch
            (model(input_ids=ids, labels=labels).loss / accum).backward()
            step_tokens += int(data["length"][row - args.micro_batch:row].sum())
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens.append(step_tokens)
        if first_step is None:
            first_step, first_step_at = time.perf_counter() - t_start, time.time()
            rss["first_step_done"], private["first_step_done"] = resident_memory_gb(), private_memory_gb()
    steady = slice(args.warmup, None)
    peak = torch.tensor(peak_memory_gb(device), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({"world_size": world, "steps": args.steps, "time_to_first_step_seconds": first_step,
                          "first_step_seconds": times[0],
                          "first_step_at": first_step_at,
                          "tokens_per_second_per_worker": sum(tokens[steady]) / sum(times[steady]),
                          "peak_memory_gb": peak.item(), "step_seconds_median": statistics.median(times[steady]),
                          "step_seconds_mean_steady": statistics.mean(times[steady]),
                          "rss_gb_rank0": {k: round(v, 2) for k, v in rss.items()},
                          "private_gb_rank0": {k: round(v, 3) for k, v in private.items()}}),
              flush=True)
    dist.barrier()  # both ranks end the group together (gloo can abort a rank that leaves first)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
