"""AdamW over the LoRA weights and its learning-rate schedule, from the config's `train` section; and the settings
a restored optimizer takes from the config rather than from its checkpoint.

Several adapters trained side by side (`adapters:`) are one AdamW with a parameter group per adapter, each with
its own learning rate and schedule: AdamW's update of a weight reads only that weight's state and its group's
settings, so each adapter steps as it would alone, and one optimizer state is checkpointed as one.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_scheduler

from app.config.sections import TrainSection

ParamGroup = tuple[list[torch.nn.Parameter], TrainSection]  # an adapter's weights and its train settings


def build_optimizer(params: list[torch.nn.Parameter], train: TrainSection) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW and transformers' schedule (warm-up, then cosine, linear or constant) over train.max_steps."""
    return build_grouped_optimizer([(params, train)])


def build_grouped_optimizer(groups: list[ParamGroup]) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """One AdamW over several parameter groups, each with its own learning rate, weight decay and schedule."""
    optimizer = torch.optim.AdamW([{"params": params, "lr": train.learning_rate, "weight_decay": train.weight_decay}
                                   for params, train in groups])
    return optimizer, LambdaLR(optimizer, [_schedule(train) for _, train in groups])


def _schedule(train: TrainSection):
    """transformers' learning-rate multiplier of the step for these settings."""
    probe = torch.optim.SGD([torch.zeros(1)], lr=1.0)  # the schedule's own optimizer is thrown away
    return get_scheduler(schedule_name(train.lr_schedule, train.warmup_steps), probe,
                         num_warmup_steps=train.warmup_steps, num_training_steps=train.max_steps).lr_lambdas[0]


def follow_config(optimizer: torch.optim.Optimizer, scheduler, train: TrainSection | list[TrainSection]) -> None:
    """The config's learning rate and weight decay over those a restored checkpoint held: a resumed run trains
    with what it is given (the same values, unless a PBT trial was handed perturbed ones), on the same schedule.
    `train`: the settings of each parameter group, or one for all."""
    trains = train if isinstance(train, list) else [train] * len(optimizer.param_groups)
    scheduler.base_lrs = [t.learning_rate for t in trains]
    for group, lr_lambda, settings in zip(optimizer.param_groups, scheduler.lr_lambdas, trains):
        group.update(initial_lr=settings.learning_rate, weight_decay=settings.weight_decay,
                     lr=settings.learning_rate * lr_lambda(scheduler.last_epoch))


def schedule_name(lr_schedule: str, warmup_steps: int) -> str:
    """transformers' name for the schedule: its plain `constant` ignores warm-up steps."""
    return "constant_with_warmup" if lr_schedule == "constant" and warmup_steps else lr_schedule
