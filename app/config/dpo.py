"""The `dpo:` section: preference tuning with Direct Preference Optimization (used when train.objective=dpo)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from app.config.section import Section


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


def objective_data_problem(objective: str, data) -> str | None:
    """Why the data section cannot feed train.objective (the data section is read, not typed, to keep this
    module below the schema)."""
    pairs = objective == "dpo"
    if pairs and data.format not in ("auto", "preference"):
        return (f"data.format={data.format} holds no preference pairs; train.objective=dpo reads "
                "data.format=preference (or auto): records with prompt, chosen and rejected")
    if not pairs and data.format == "preference":
        return "data.format=preference holds pairs to prefer one answer of: set train.objective=dpo"
    if pairs and data.packing and "packing" in data.model_fields_set:
        return ("data.packing=true: preference pairs are not packed (chosen and rejected go through one forward "
                "side by side); remove the key or set it false for train.objective=dpo")
    if pairs and data.long_records == "split" and "long_records" in data.model_fields_set:
        return ("data.long_records=split: a preference pair is truncated to data.max_seq_len (the prompt's end, "
                "the answers' starts), never split; remove the key for train.objective=dpo")
    return None
