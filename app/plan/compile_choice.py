"""`model.compile: auto`: whether torch.compile'd decoder layers make this hardware's step faster, measured once
and remembered; and the directory inductor keeps its compiled code in, shared by ranks, attempts and jobs.

The measurement: a one-layer copy of the model's architecture (random weights, the run's LoRA, compute dtype,
micro-batch and sequence length) steps forward and backward eager, then with its layer compiled the way
app/model/sharding.py compiles it; compiled wins when it is at least `MIN_GAIN` faster. Packed rows on a CPU
without checkpointing are not measured: they train with per-record attention (app/model/segment_attention.py),
which compiled layers give up, and which gained more there (1.14x) than compiling ever measured (0.96-1.09x,
within the noise of this measurement; docs/performance.md). The verdict is kept in
`compile_choices.json` of the cache directory under a key of the hardware, torch version and shape, so the next
run of the same shape (any job on that storage) reads it instead of measuring.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from app.config.schema import FinetuneConfig
from app.model.adapter import apply_lora
from app.model.hardware import cpu_flags, torch_dtype
from app.model.segment_attention import attends_per_record
from app.model.sharding import decoder_layers

MIN_GAIN = 1.10  # eager / compiled step time at least this: compile's start-up cost and the timing's noise
REPEATS, WARMUP = 5, 2
CHOICES_FILE = "compile_choices.json"


def compile_cache_dir(output_dir: str, storage: str | None) -> Path:
    """Where inductor's caches go: the storage every node shares ($FINETUNE_STORAGE), else the runs' local
    directory, else (runs in a bucket) this user's cache; a run of the same shape reuses what an earlier one
    compiled."""
    local_output = None if "://" in output_dir else output_dir
    root = storage or local_output or str(Path.home() / ".cache" / "ray-lora-fsdp")
    return Path(root) / ".cache" / "torch-compile"


def use_compile_cache(cache_dir: Path) -> None:
    """Point inductor (FX graph and AOTAutograd caches, kernels) at `cache_dir` before anything compiles."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)


def decide_compile(cfg: FinetuneConfig, device: torch.device, cache_dir: Path) -> tuple[bool, str]:
    """(compile, why) for model.compile=auto on `device`: refused cases first, then the remembered or measured
    step times."""
    if cfg.model.quantization == "nf4":
        return False, "NF4 layers are not compiled"
    if device.type == "cpu" and not shutil.which("c++") and not shutil.which("g++"):
        return False, "no C++ compiler on this host for inductor's CPU kernels"
    if cfg.data.packing and attends_per_record(cfg.model, device) and not cfg.model.gradient_checkpointing:
        return False, "packed rows on a CPU train with per-record attention, which compiled layers give up"
    key = _shape_key(cfg, device)
    remembered = _read_choices(cache_dir).get(key)
    if remembered is None:
        eager, compiled = measure_layer_step(cfg, device)
        remembered = {"eager_ms": round(eager * 1e3, 2), "compiled_ms": round(compiled * 1e3, 2)}
        _write_choice(cache_dir, key, remembered)
        source = "measured"
    else:
        source = "remembered"
    gain = remembered["eager_ms"] / remembered["compiled_ms"]
    return gain >= MIN_GAIN, (f"a layer's step {remembered['eager_ms']:.1f} ms eager, {remembered['compiled_ms']:.1f} "
                              f"ms compiled ({gain:.2f}x); {source}")


def measure_layer_step(cfg: FinetuneConfig, device: torch.device) -> tuple[float, float]:
    """Median seconds of a one-layer model's forward and backward, eager and with its layer compiled."""
    from transformers import AutoConfig, AutoModelForCausalLM  # start-up: loaded only where a probe runs

    config = AutoConfig.from_pretrained(cfg.model.path, revision=cfg.model.revision,
                                        trust_remote_code=cfg.model.trust_remote_code)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    dtype = torch_dtype(cfg.fsdp.param_dtype, device)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code,
                                            attn_implementation=cfg.model.attn_implementation)
    model = apply_lora(base, cfg.lora, seed=0).to(device=device, dtype=dtype)
    backbone = model.get_base_model().base_model  # the decoder without its LM head: what compiling changes
    ids = torch.randint(0, config.vocab_size, (cfg.train.micro_batch_size, cfg.data.max_seq_len), device=device)
    eager = _median_step(backbone, ids, device)
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward)
    return eager, _median_step(backbone, ids, device)


def _median_step(backbone, ids: torch.Tensor, device: torch.device) -> float:
    times = []
    for _ in range(WARMUP + REPEATS):
        start = time.perf_counter()
        backbone(input_ids=ids).last_hidden_state.float().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def _shape_key(cfg: FinetuneConfig, device: torch.device) -> str:
    hardware = (f"{torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}"
                if device.type == "cuda" else " ".join(sorted(cpu_flags())))
    shape = [torch.__version__, hardware, cfg.model.path, cfg.model.attn_implementation, cfg.fsdp.param_dtype,
             cfg.train.micro_batch_size, cfg.data.max_seq_len, cfg.lora.r, str(cfg.lora.target_modules)]
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]


def _read_choices(cache_dir: Path) -> dict:
    try:
        return json.loads((cache_dir / CHOICES_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_choice(cache_dir: Path, key: str, choice: dict) -> None:
    """Merged into the file and replaced whole: a reader never sees half of it."""
    choices = _read_choices(cache_dir) | {key: choice}
    partial = cache_dir / f"{CHOICES_FILE}.{os.getpid()}"
    partial.write_text(json.dumps(choices, indent=1))
    partial.replace(cache_dir / CHOICES_FILE)
