"""Successive halving of adapters trained side by side (`tune.in_one_job` with `tune.scheduler: asha`): Ray Tune's
ASHA rule, applied to every adapter at once since all of them reach a rung at the same step.

Rungs are at grace_period x reduction_factor^k steps (k = 0, 1, ...), decided at the first evaluation at or after
each one; there an adapter goes on when its figure is not behind ASHA's cutoff, the (1 - 1/reduction_factor)
quantile of the figures of the adapters that reached the rung (the best 1 in reduction_factor go on, at least
one). Nothing is kept between steps: a resumed run decides each rung where the uninterrupted run did.
"""

from __future__ import annotations

import math

import numpy as np

from app.config.schema import FinetuneConfig
from app.config.tune import sweep_metric, sweep_mode


def rung_at(cfg: FinetuneConfig, step: int) -> int | None:
    """The rung an evaluation at `step` decides, if any."""
    tune, every = cfg.tune, cfg.train.eval_every
    if not (tune.in_one_job and tune.scheduler == "asha") or step == 0:
        return None
    grace, k = tune.grace_period or every, 0
    while (milestone := grace * tune.reduction_factor ** k) < cfg.train.max_steps:
        if step - every < milestone <= step:
            return k
        k += 1
    return None


def rung_metric(cfg: FinetuneConfig) -> str:
    return sweep_metric(cfg.tune, cfg.train)


def behind(cfg: FinetuneConfig, figures: dict[str, float]) -> dict[str, str]:
    """The adapters (name -> why) whose figure (rung_metric) at a rung is behind ASHA's cutoff; a figure that is
    not a number always is."""
    metric = rung_metric(cfg)
    sign = -1.0 if sweep_mode(cfg.tune, cfg.train) == "min" else 1.0
    higher = {name: sign * value for name, value in figures.items() if math.isfinite(value)}
    cutoff = float(np.percentile(list(higher.values()), (1 - 1 / cfg.tune.reduction_factor) * 100)) if higher else 0
    return {name: f"asha: {metric} {figures[name]:.6g} behind the cutoff {sign * cutoff:.6g} of {len(figures)}"
            for name in figures if name not in higher or higher[name] < cutoff}
