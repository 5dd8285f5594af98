"""The `grpo:` section: online RL with verifiable rewards (used when train.objective=grpo). Names follow TRL's
GRPOConfig where it has the setting."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from app.config.sections import Section

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
