"""AdamW over the LoRA weights and its learning-rate schedule, from the config's `train` section; and the settings
a restored optimizer takes from the config rather than from its checkpoint."""

from __future__ import annotations

import torch
from transformers import get_scheduler

from app.config.sections import TrainSection


def build_optimizer(params: list[torch.nn.Parameter], train: TrainSection) -> tuple[torch.optim.Optimizer, object]:
    """AdamW and transformers' schedule (warm-up, then cosine, linear or constant) over train.max_steps."""
    optimizer = torch.optim.AdamW(params, lr=train.learning_rate, weight_decay=train.weight_decay)
    scheduler = get_scheduler(schedule_name(train.lr_schedule, train.warmup_steps), optimizer,
                              num_warmup_steps=train.warmup_steps, num_training_steps=train.max_steps)
    return optimizer, scheduler


def follow_config(optimizer: torch.optim.Optimizer, scheduler, train: TrainSection) -> None:
    """The config's learning rate and weight decay over those a restored checkpoint held: a resumed run trains
    with what it is given (the same values, unless a PBT trial was handed perturbed ones), on the same schedule."""
    scheduler.base_lrs = [train.learning_rate] * len(optimizer.param_groups)
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(initial_lr=train.learning_rate, weight_decay=train.weight_decay,
                     lr=train.learning_rate * lr_lambda(scheduler.last_epoch))


def schedule_name(lr_schedule: str, warmup_steps: int) -> str:
    """transformers' name for the schedule: its plain `constant` ignores warm-up steps."""
    return "constant_with_warmup" if lr_schedule == "constant" and warmup_steps else lr_schedule
