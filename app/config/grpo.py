"""The `grpo:` section: online RL with verifiable rewards (used when train.objective=grpo). Names follow TRL's
GRPOConfig where it has the setting."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from app.config.sections import LoraSection, ModelSection, Section

# a reward function: `path/to/file.py:function` (a file, absolute or relative to the job's working directory)
# or `package.module:function` (a module on the path)
REWARD_FUNC = re.compile(r"(?P<where>[^:\s]+(\.py)?):(?P<name>[A-Za-z_]\w*)")


def reward_name(spec: str) -> str:
    """The name a reward function's metrics carry (rewards/<name>/mean): its function's name."""
    return spec.rsplit(":", 1)[-1]


class GrpoSection(Section):
    """Group Relative Policy Optimization (train.objective=grpo): sample num_generations answers per prompt from
    the current policy, score them with the reward functions, and push the policy toward the better answers of
    each group. train.global_batch_size counts completions (prompts x num_generations)."""

    reward_funcs: list[str] = Field([], description="the reward functions, TRL's signature: `file.py:function` (a "
                                    "path absolute or relative to the job's working directory) or "
                                    "`package.module:function`, each called as f(prompts=, completions=, "
                                    "completion_ids=, **the record's other columns) -> list[float | None]")
    reward_weights: list[float] | None = Field(None, description="each reward function's weight in the reward "
                                               "(None: 1 each)")
    num_generations: int = Field(8, ge=2, description="answers sampled per prompt: the group whose rewards are "
                                 "compared")
    max_completion_tokens: int = Field(64, gt=0, description="tokens an answer may have at most")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature (the loss's log-probs use it too)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: the smallest set of tokens with this "
                         "much probability")
    top_k: int = Field(0, ge=0, description="sample among this many most likely tokens only (0: all); a small "
                       "model's long tail of unlikely tokens otherwise derails many answers")
    beta: float = Field(0.0, ge=0.0, description="weight of the KL to the reference (the base with LoRA off, or the "
                        "frozen model.init_adapter); 0: no reference forward at all")
    epsilon: float = Field(0.2, gt=0.0, lt=1.0, description="clip range of the importance ratio: [1 - epsilon, "
                           "1 + epsilon_high]")
    epsilon_high: float | None = Field(None, gt=0.0, description="upper clip range (DAPO's clip-higher); None: "
                                       "epsilon")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="normalisation of the token losses: grpo, each answer's mean then the mean over answers; "
        "dr_grpo, the sum over the global batch / (answers x max_completion_tokens); dapo, the sum / the global "
        "batch's completion tokens")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantages are rewards minus their group's mean, divided by the std of the group, of "
        "the whole batch, or by nothing (Dr. GRPO)")
    num_iterations: int = Field(1, gt=0, description="optimizer steps on each batch of rollouts (the importance "
                                "ratio is taken against the policy that sampled them)")
    mask_truncated_completions: bool = Field(False, description="answers cut off at max_completion_tokens carry no "
                                             "loss (DAPO)")
    max_staleness: int = Field(0, ge=0, description="optimizer steps a batch of answers may lag the policy it trains: "
                               "with k > 0 the rollout side samples the next k steps' prompts with the current "
                               "adapter while the trainers train (the two overlap); a batch sampled more than k "
                               "steps ago is never trained on; 0: sampled with the very adapter it trains (on-policy)")
    importance_correction: Literal["none", "tis"] = Field(
        "none", description="weighting of each token's loss by how likely the trainer finds it over how likely the "
        "sampler did: tis, truncated importance sampling (min(ratio, importance_cap)), for answers a stale adapter "
        "or another numeric path sampled; none: no weight")
    importance_cap: float = Field(2.0, gt=1.0, description="the truncation of tis: a token's weight is at most this")
    rollout_workers: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto", description="Ray actors that generate the answers, each holding the frozen base once, and every "
        "rank's prompts shared out over them; auto: one beside CPU workers (it shares their cores), with GPU workers "
        "one per GPU the cluster has beyond theirs, at most one per worker (app/plan/rollout_sizing.py)")
    rollout_batch_rows: int | None = Field(None, gt=0, description="answers a rollout actor decodes at once, from "
                                           "every rank's requests of the same adapter (continuous batching: an "
                                           "answer that ends frees its row for the next waiting one); None: every "
                                           "answer it has been asked for")
    rollout_engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto", description="what decodes the rollouts: transformers, this project's engine (app/engine/) over the "
        "transformers model; vllm, vLLM in each actor, the policy as LoRA requests; auto: vllm on GPU actors where it "
        "is installed and runs the model, else transformers (on CPUs it samples 12x vLLM's LoRA path)")
    rollout_policy: Literal["auto", "merged", "lora"] = Field(
        "auto", description="how the policy reaches a rollout actor's engine: merged, the adapter merged into the "
        "actor's copy of the base at each sync (its steps run the base's products alone; the adapted base weights "
        "kept once more in host memory); lora, the adapter applied beside the base at every step; auto: merged "
        "unless the adapter cannot merge (DoRA, LoRA on embeddings, an nf4 base)")
    rollout_cpus: float = Field(1.0, ge=0.0, description="logical CPUs Ray reserves for each rollout actor")
    rollout_gpus: Annotated[float, Field(ge=0.0)] | Literal["auto"] = Field(
        "auto", description="GPUs of each rollout actor; auto: 1 with scaling.use_gpu (a GPU of its own), else 0")
    reward_workers: int = Field(0, ge=0, description="score answers with this many Ray tasks at a time beside the "
                                "workers (slow rewards: a sandbox, a judge); 0: in the training worker")

    @field_validator("reward_funcs")
    @classmethod
    def _specs(cls, funcs: list[str]) -> list[str]:
        for spec in funcs:
            if not REWARD_FUNC.fullmatch(spec):
                raise ValueError(f"grpo.reward_funcs: {spec!r}: name a function as `file.py:function` or "
                                 "`package.module:function`")
        names = [reward_name(spec) for spec in funcs]
        twice = sorted(name for name in names if names.count(name) > 1)
        if twice:
            raise ValueError(f"grpo.reward_funcs: two functions are named {twice[0]}; their metrics would mix: rename "
                             "one")
        return funcs

    @model_validator(mode="after")
    def _weights_match(self) -> GrpoSection:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"grpo.reward_weights has {len(self.reward_weights)} weights for "
                             f"{len(self.reward_funcs)} grpo.reward_funcs: give one each")
        return self

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.reward_funcs)


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


def rollout_policy_of(model: ModelSection, lora: LoraSection, grpo: GrpoSection, engine: str) -> tuple[str, str]:
    """grpo.rollout_policy as a run takes it with rollout engine `engine`, and why where it was `auto`: vLLM takes
    LoRA requests; this project's engine the adapter merged where it can merge, else LoRA beside the base."""
    if grpo.rollout_policy != "auto":
        return grpo.rollout_policy, ""
    if engine == "vllm":
        return "lora", "lora (vLLM takes the adapter as a LoRA request at each sync)"
    why = unmergeable_lora(model, lora)
    return ("lora", f"lora (the adapter beside the base at every step: {why} cannot merge)") if why else \
        ("merged", MERGED_WHY)
