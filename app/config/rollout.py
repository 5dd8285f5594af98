"""The `rollout:` section: how answers are sampled online, for every objective that samples them
(train.objective grpo or distill): how many per prompt and how, by which engine on which Ray actors, how far
ahead of the trainers. What each objective then makes of the sampled answers is its own section's (grpo:
rewards into advantages; distill: the teacher's log-probs)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from app.config.sections import LoraSection, ModelSection, Section

# keys this section took over from grpo: (a config that still sets one is told the new key in one line)
MOVED_FROM_GRPO = {"num_generations": "num_generations", "max_completion_tokens": "max_completion_tokens",
                   "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "max_staleness": "max_staleness", "importance_correction": "importance_correction",
                   "importance_cap": "importance_cap", "rollout_workers": "workers", "rollout_batch_rows": "batch_rows",
                   "rollout_engine": "engine", "rollout_policy": "policy", "rollout_cpus": "cpus",
                   "rollout_gpus": "gpus"}


class RolloutSection(Section):
    """Answers sampled from the current policy (the LoRA adapter being trained) to each step's prompts, by Ray
    actors beside the trainers that hold the frozen base and receive the adapter after every optimizer step.
    train.global_batch_size counts answers (prompts x num_generations)."""

    num_generations: int = Field(8, ge=1, description="answers sampled per prompt (GRPO: the group whose rewards "
                                 "are compared, 2 or more)")
    max_completion_tokens: int = Field(64, gt=0, description="tokens an answer may have at most")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature (the loss's log-probs use it too)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: the smallest set of tokens with this "
                         "much probability")
    top_k: int = Field(0, ge=0, description="sample among this many most likely tokens only (0: all); a small "
                       "model's long tail of unlikely tokens otherwise derails many answers")
    max_staleness: int = Field(0, ge=0, description="optimizer steps a batch of answers may lag the policy it trains: "
                               "with k > 0 the rollout side samples the next k steps' prompts with the current "
                               "adapter while the trainers train (the two overlap); a batch sampled more than k "
                               "steps ago is never trained on; 0: sampled with the very adapter it trains (on-policy)")
    importance_correction: Literal["none", "tis"] = Field(
        "none", description="weighting of each token's loss by how likely the trainer finds it over how likely the "
        "sampler did: tis, truncated importance sampling (min(ratio, importance_cap)), for answers a stale adapter "
        "or another numeric path sampled; none: no weight")
    importance_cap: float = Field(2.0, gt=1.0, description="the truncation of tis: a token's weight is at most this")
    workers: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto", description="Ray actors that generate the answers, each holding the frozen base once, and every "
        "rank's prompts shared out over them; auto: one beside CPU workers (it shares their cores), with GPU workers "
        "one per GPU the cluster has beyond theirs, at most one per worker (app/plan/rollout_sizing.py)")
    batch_rows: int | None = Field(None, gt=0, description="answers a rollout actor decodes at once, from "
                                           "every rank's requests of the same adapter (continuous batching: an "
                                           "answer that ends frees its row for the next waiting one); None: every "
                                           "answer it has been asked for")
    engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto", description="what decodes the rollouts: transformers, this project's engine (app/engine/) over the "
        "transformers model; vllm, vLLM in each actor (the policy as LoRA requests on GPUs, merged into its weights "
        "on CPUs: rollout.policy); auto: vllm on GPU actors where it is installed and runs the model, else "
        "transformers (on CPUs it samples 1.4-1.7x vLLM with the adapter merged, on an AVX2 EPYC in fp32)")
    policy: Literal["auto", "merged", "lora"] = Field(
        "auto", description="how the policy reaches a rollout actor's engine: merged, the adapter merged into the "
        "actor's copy of the base at each sync, this project's engine's or vLLM's on CPU actors (its steps run the "
        "base's products alone; the adapted base weights kept once more in host memory); lora, the adapter applied "
        "beside the base at every step (vLLM: a LoRA request per sync); auto: merged unless the adapter cannot merge "
        "(DoRA, LoRA on embeddings, an nf4 base) or vLLM samples on GPUs (its batched LoRA kernels)")
    cpus: float = Field(1.0, ge=0.0, description="logical CPUs Ray reserves for each rollout actor")
    gpus: Annotated[float, Field(ge=0.0)] | Literal["auto"] = Field(
        "auto", description="GPUs of each rollout actor; auto: 1 with scaling.use_gpu (a GPU of its own), else 0")


def unmergeable_lora(model: ModelSection, lora: LoraSection) -> str | None:
    """Why the LoRA adapter of `lora` cannot be merged into a base `model` loads, or None."""
    if lora.use_dora:
        return "lora.use_dora=true (DoRA's magnitudes scale every step's output)"
    if model.quantization == "nf4":
        return "model.quantization=nf4 (a 4-bit base has no room for the adapter's product)"
    if isinstance(lora.target_modules, list) and any("embed" in name for name in lora.target_modules):
        return "lora.target_modules names an embedding (its LoRA is looked up, not multiplied)"
    return None


def vllm_refuses(model: ModelSection, lora: LoraSection) -> str | None:
    """Why vLLM would sample another policy than the one trained, or None."""
    if lora.use_dora:
        return "lora.use_dora=true (vLLM has no DoRA)"
    if model.quantization == "nf4":
        return "model.quantization=nf4 (vLLM would load the base unquantized)"
    return None


MERGED_WHY = ("merged (the adapter merged into each actor's copy of the base at every sync: its steps run the base's "
              "products alone; 1.3x LoRA's answers/s beside the base on 1 and 2 CPU cores: benchmarks/rollouts.py)")


VLLM_MERGED_WHY = ("merged (the adapter merged into vLLM's weights at every sync: on CPUs vLLM samples 5-6x its LoRA "
                   "requests' answers/s that way; benchmarks/rollouts.py)")


def rollout_policy_of(model: ModelSection, lora: LoraSection, rollout: RolloutSection, engine: str,
                      on_gpu: bool = False) -> tuple[str, str]:
    """rollout.policy as a run takes it with rollout engine `engine`, and why where it was `auto`: the adapter
    merged where it can merge, else LoRA beside the base; but LoRA requests for vLLM on GPU actors (its batched
    LoRA kernels are its fast path there)."""
    if rollout.policy != "auto":
        return rollout.policy, ""
    if engine == "vllm" and on_gpu:
        return "lora", "lora (vLLM on GPUs takes the adapter as a LoRA request at each sync)"
    why = unmergeable_lora(model, lora)
    if why:
        return "lora", f"lora (the adapter beside the base at every step: {why} cannot merge)"
    return "merged", VLLM_MERGED_WHY if engine == "vllm" else MERGED_WHY
