"""A restored optimizer trains at the config's learning rate and weight decay, on the schedule's step it was
saved at: what a PBT trial given another trial's checkpoint and a perturbed learning rate relies on."""

from __future__ import annotations

import pytest
import torch

from app.config.sections import TrainSection
from app.train.optimizer import build_optimizer, follow_config


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_a_restored_optimizer_takes_the_configs_learning_rate_at_the_saved_step(schedule):
    weight = torch.nn.Parameter(torch.ones(3))
    saved = TrainSection(learning_rate=1e-3, weight_decay=0.0, lr_schedule=schedule, warmup_steps=2, max_steps=10)
    optimizer, scheduler = build_optimizer([weight], saved)
    for _ in range(5):
        weight.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
    at_step_5 = optimizer.param_groups[0]["lr"] / 1e-3

    perturbed = saved.model_copy(update={"learning_rate": 1.2e-3, "weight_decay": 0.01})
    restored, restored_schedule = build_optimizer([weight], perturbed)
    restored.load_state_dict(optimizer.state_dict())
    restored_schedule.load_state_dict(scheduler.state_dict())
    assert restored.param_groups[0]["lr"] == pytest.approx(1e-3 * at_step_5)  # the checkpoint's, before
    follow_config(restored, restored_schedule, perturbed)
    assert restored.param_groups[0]["lr"] == pytest.approx(1.2e-3 * at_step_5)
    assert restored.param_groups[0]["weight_decay"] == 0.01
    restored_schedule.step()
    optimizer.step()
    scheduler.step()
    assert restored.param_groups[0]["lr"] == pytest.approx(1.2 * optimizer.param_groups[0]["lr"])  # the same schedule
