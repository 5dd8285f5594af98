"""The GPU check: one command on a machine with one NVIDIA GPU, under 8 minutes, one JSON line.

    python -m benchmarks.gpu_check [--out gpu_check.json]

Needs torch with CUDA, transformers and peft only (no Ray, MLflow or datasets): the training step runs
through torchrun (benchmarks/step.py: the job's loader, sharding, LoRA and loss, NCCL, one rank).
What it measures and checks:

- packing: a packed row's loss against its records' losses alone, through the job's loss, on a small
  Llama on the GPU, for SDPA (fp32 and bf16) and FlashAttention's varlen path where flash_attn is
  installed (bf16), beside the gap of the same row fed without position ids (what a leak looks like);
- the job's step path at the 125M shape, seq 2048, bf16, packed rows: SDPA; FlashAttention where
  installed; compile with activation checkpointing, beside eager with and without checkpointing
  (tokens/s, peak memory: checkpointing kept shows as the compiled peak near the checkpointed one);
- the 8B shape (benchmarks/shapes/llama31_8b.json, random weights) at seq 2048: tokens/s, MFU counted
  with LoRA's FLOPs (benchmarks/step.py: flops_per_token), peak memory; over an NF4 base (QLoRA, where
  torchao is installed); then with fsdp.cpu_offload.

Exit status 1 when a check fails (a packed row that is not isolated, a step that fails or whose loss is
not finite). `--smoke` runs the same sequence on the CPU with tiny shapes (gloo; no 8B, no flash): it is
how the script is tested where no GPU is.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import SHAPES, TORCHRUN
from benchmarks.step import synthetic_batch

BUDGET_SECONDS = 450  # the whole check; a step run that would start with less than its own limit left is skipped
SMALL_SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 1024, "initializer_range": 0.1}
TINY_SHAPE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 512, "tie_word_embeddings": False}


def flash_attn_version() -> str | None:
    return importlib.metadata.version("flash_attn") if importlib.util.find_spec("flash_attn") else None


def has_torchao() -> bool:
    return importlib.util.find_spec("torchao") is not None


def step_runs(smoke: bool, shape_dir: Path) -> list[tuple[str, int, list[str]]]:
    """(name, time limit in seconds, benchmarks/step.py flags) of each step measured, in order."""
    if smoke:
        tiny = ["--model-config", str(shape_dir / "config.json"), "--seq-len", "64", "--micro-batch", "2",
                "--steps", "3", "--warmup", "1", "--pack", "4", "--param-dtype", "float32", "--dtype", "float32"]
        return [("small_sdpa_packed", 120, tiny), ("small_sdpa_packed_compiled", 240, [*tiny, "--compile"]),
                *([("small_nf4_packed", 120, [*tiny, "--quantization", "nf4"])] if has_torchao() else [])]
    small = ["--model-config", str(SHAPES / "bench_125m.json"), "--seq-len", "2048", "--micro-batch", "4",
             "--steps", "10", "--warmup", "3", "--pack", "4"]
    eight_b = ["--model-config", str(SHAPES / "llama31_8b.json"), "--seq-len", "2048", "--micro-batch", "1"]
    runs = [("125m_sdpa_packed", 90, small),
            ("125m_sdpa_packed_no_checkpointing", 90, [*small, "--no-activation-checkpointing"]),
            ("125m_sdpa_packed_compiled", 150, [*small, "--compile"])]
    if flash_attn_version():
        runs.append(("125m_flash_varlen_packed", 90, [*small, "--attn-implementation", "flash_attention_2"]))
    runs.append(("8b_seq2048", 150, [*eight_b, "--steps", "8", "--warmup", "3"]))
    if has_torchao():  # QLoRA: the 8B shape over an NF4 base (model.quantization=nf4)
        runs.append(("8b_seq2048_nf4", 150, [*eight_b, "--steps", "8", "--warmup", "3", "--quantization", "nf4"]))
    return [*runs, ("8b_seq2048_cpu_offload", 180, [*eight_b, "--steps", "4", "--warmup", "1", "--cpu-offload"])]


def run_step(flags: list[str], limit: int) -> dict:
    """One torchrun of benchmarks/step.py on one rank: its JSON line, or what went wrong."""
    command = [*TORCHRUN, "--nproc-per-node=1", "-m", "benchmarks.step", *flags]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"over its {limit} s limit"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    result = json.loads(lines[-1])
    if not math.isfinite(result.get("last_micro_batch_loss", math.nan)):
        result["error"] = "the loss is not finite"
    return result


def packing_gaps(device: torch.device, smoke: bool) -> dict:
    """Relative gap between a packed row's summed loss and its records' losses alone, per kernel and dtype,
    through the job's loss; `leak` is the same row without its position ids (records see each other)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from app.train.loss import summed_token_loss

    kernels = [("sdpa", torch.float32), ("sdpa", torch.bfloat16)]
    if device.type == "cuda" and flash_attn_version():
        kernels.append(("flash_attention_2", torch.bfloat16))
    rows, seq_len, records = (2, 96, 3) if smoke else (2, 1536, 3)
    batch = synthetic_batch(rows, seq_len, records, SMALL_SIZES["vocab_size"], torch.Generator().manual_seed(0))
    length = -(-seq_len // records)
    alone = [{"input_ids": ids[start:start + length][None], "labels": ids[start:start + length][None]}
             for ids in batch["input_ids"] for start in range(0, seq_len, length)]
    gaps = {}
    for kernel, dtype in kernels:
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", **SMALL_SIZES)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=kernel).to(device).eval()
        with torch.no_grad():
            on_gpu = {k: v.to(device) for k, v in batch.items()}
            reference = sum(summed_token_loss(model, {k: v.to(device) for k, v in a.items()}).item() for a in alone)
            packed = summed_token_loss(model, on_gpu).item()
            leaked = summed_token_loss(model, {k: v for k, v in on_gpu.items() if k != "position_ids"}).item()
        name = f"{kernel}_{str(dtype).removeprefix('torch.')}"
        gaps[name] = {"gap": abs(packed - reference) / reference, "leak": abs(leaked - reference) / reference}
        gaps[name]["isolated"] = gaps[name]["gap"] < gaps[name]["leak"] / 10
    return gaps


def environment(device: torch.device) -> dict:
    versions = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "peft")}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, **versions, "flash_attn": flash_attn_version(),
            "cuda": torch.version.cuda if device.type == "cuda" else None}


def gpu_check(smoke: bool) -> dict:
    t0 = time.perf_counter()
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; on a machine without one, `--smoke` runs the check on the CPU")
    device = torch.device("cpu" if smoke else "cuda")
    report = {**environment(device), "smoke": smoke, "packing": packing_gaps(device, smoke), "steps": {}}
    with tempfile.TemporaryDirectory() as shape_dir:
        (Path(shape_dir) / "config.json").write_text(json.dumps(TINY_SHAPE))
        for name, limit, flags in step_runs(smoke, Path(shape_dir)):
            if time.perf_counter() - t0 + limit > BUDGET_SECONDS:
                report["steps"][name] = {"skipped": f"less than its {limit} s limit left of the check's budget"}
                continue
            report["steps"][name] = run_step(flags, limit)
    failed = [f"packing:{k}" for k, v in report["packing"].items() if not v["isolated"]]
    failed += [f"step:{k}" for k, v in report["steps"].items() if "error" in v]
    return report | {"failed": failed, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script itself")
    parser.add_argument("--out", type=Path, help="also write the JSON line to this file")
    args = parser.parse_args(argv)
    report = gpu_check(args.smoke)
    line = json.dumps(report)
    if args.out:
        args.out.write_text(line + "\n")
    print(line, flush=True)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
