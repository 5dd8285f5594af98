"""The `dpo:` section: preference tuning with Direct Preference Optimization (used when train.objective=dpo)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from app.config.sections import Section


class DpoSection(Section):
    """Direct Preference Optimization (train.objective=dpo): the LoRA model against itself with its adapter disabled."""

    beta: float = Field(0.1, gt=0.0, description="strength of the pull towards the reference: the implicit "
                        "reward of an answer is beta x its log-ratio to the reference")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="with h = log-ratio to the reference of the chosen answer minus that of the "
        "rejected one (log-probs summed over each answer's tokens): sigmoid (the DPO paper's): -log sigmoid(beta h); "
        "ipo: (h - 1/(2 beta))^2; hinge (SLiC): max(0, 1 - beta h)")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="with loss_type sigmoid, the assumed share of "
                                   "pairs whose labels are flipped (conservative DPO): -(1 - e) log sigmoid(beta h) "
                                   "- e log sigmoid(-beta h)")

    @model_validator(mode="after")
    def _smoothing_is_sigmoids(self) -> DpoSection:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing} applies to dpo.loss_type=sigmoid only "
                             f"(conservative DPO); set it to 0 for dpo.loss_type={self.loss_type}")
        return self
