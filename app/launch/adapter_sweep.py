"""A sweep's trials as the adapters of one job (`python -m jobs.tune --in-one-job`): the base loaded and sharded
once, one worker group, one start-up, instead of one of each per trial.

The trials are drawn from tune.space by Ray Tune's own variant generator (grid values expanded, the other
distributions sampled, tune.num_samples times, seeded by tune.seed), as a sweep of separate trials draws them;
each becomes an adapter (`trial_000`, ...). Only the keys an adapter may set can be swept this way
(app/config/adapters.py); the job's rungs stop adapters as ASHA stops trials (app/train/halving.py).
"""

from __future__ import annotations

from numpy.random import RandomState
from pydantic import ValidationError
from ray.tune.search.variant_generator import generate_variants

from app.config.adapters import LORA_KEYS, TRAIN_KEYS
from app.config.schema import FinetuneConfig
from app.config.sweep_space import with_values
from app.config.tune import sweep_metric, sweep_mode
from app.errors import UserInputError
from app.launch.driver import run_finetune
from app.launch.tune_sweep import search_space

ADAPTER_KEYS = {f"lora.{key}": key for key in LORA_KEYS} | {f"train.{key}": key for key in TRAIN_KEYS}


def trial_adapters(cfg: FinetuneConfig) -> list[dict]:
    """tune.space's trials as `adapters:` entries; a key an adapter cannot set is one line naming it."""
    if shared := [key for key in cfg.tune.space if key not in ADAPTER_KEYS]:
        raise UserInputError(f"--in-one-job: tune.space {shared[0]} is the job's, shared by every adapter (one job "
                             f"sweeps {', '.join(ADAPTER_KEYS)}); sweep it without --in-one-job")
    random_state = RandomState(cfg.tune.seed) if cfg.tune.seed is not None else None
    points = [values for _ in range(cfg.tune.num_samples)
              for _, values in generate_variants(search_space(cfg), random_state=random_state)]
    for values in points:
        with_values(cfg, values)  # each trial is a valid run alone
    return [{"name": f"trial_{i:03d}"} | {ADAPTER_KEYS[key]: value for key, value in values.items()}
            for i, values in enumerate(points)]


def sweep_in_one_job(cfg: FinetuneConfig, name: str) -> dict:
    """Train the sweep's trials as adapters of one job named `name`; its summary, with the best adapter's name and
    figure by tune.metric (else train.best_metric) at its best evaluation."""
    adapters, metric = trial_adapters(cfg), sweep_metric(cfg.tune, cfg.train)
    try:
        job = cfg.with_set({"adapters": adapters, "tune.in_one_job": True, "train.run_name": name,
                            "train.best_metric": metric})  # each adapter's best by the sweep's figure
    except ValidationError as e:
        raise UserInputError(f"--in-one-job: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    summary = run_finetune(job)
    ranked = {adapter: figures["best_value"] for adapter, figures in summary["adapters"].items()
              if figures["best_value"] is not None}
    best = (min if sweep_mode(cfg.tune, cfg.train) == "min" else max)(ranked, key=ranked.get) if ranked else None
    trials = {adapter["name"]: {k: v for k, v in adapter.items() if k != "name"} for adapter in adapters}
    return summary | {"sweep": name, "metric": metric, "best_adapter": best, "best_config": trials.get(best),
                      "trials": trials}
