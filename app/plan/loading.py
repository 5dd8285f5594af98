"""How the workers load the model, decided by the driver once the model stack is loaded (while Ray starts)."""

from __future__ import annotations

from app.config.schema import FinetuneConfig
from app.model.slices import slice_loading_problem
from app.plan.plan import Decision


def loading_decision(cfg: FinetuneConfig) -> tuple[Decision, ...]:
    """`model.load: sharded` reads each rank's slices of the checkpoint; where transformers must convert
    tensors to build a parameter (fused experts, ...), the model loads whole instead, and the plan says why."""
    if cfg.model.load != "sharded":
        return ()
    problem = slice_loading_problem(cfg.model)
    if problem is None:
        return ()
    return (Decision("model.load", "full", f"full ({problem}: every worker loads the whole model)"),)
