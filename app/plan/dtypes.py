"""`auto` in model.dtype and fsdp.param_dtype: bf16 where the hardware computes it natively, fp32 elsewhere
(app/model/hardware.py detects which). Decided by the workers, on their own hardware, all ranks agreeing
(app/train/measured.py); GRPO's rollout actors decide for theirs; the memory plan predicts it for the driver's."""

from __future__ import annotations

from app.config.schema import FinetuneConfig
from app.model.hardware import resolve_dtype
from app.plan.plan import Decision

DTYPE_KEYS = ("model.dtype", "fsdp.param_dtype")


def dtype_decisions(cfg: FinetuneConfig, fast_bf16: bool) -> tuple[Decision, ...]:
    """The `auto` dtypes of `cfg` made concrete for hardware that does (or does not) compute bf16 natively."""
    why = "this hardware computes bf16 natively" if fast_bf16 else "no native bf16 here: emulated bf16 is slower"
    return tuple(Decision(key, resolve_dtype("auto", fast_bf16), f"{resolve_dtype('auto', fast_bf16)} ({why})")
                 for key, value in zip(DTYPE_KEYS, (cfg.model.dtype, cfg.fsdp.param_dtype)) if value == "auto")


def planned_dtypes(cfg: FinetuneConfig, fast_bf16: bool) -> tuple[str, str]:
    """(stored, compute) dtype names the workers will take, for hardware with (or without) native bf16."""
    return resolve_dtype(cfg.model.dtype, fast_bf16), resolve_dtype(cfg.fsdp.param_dtype, fast_bf16)
