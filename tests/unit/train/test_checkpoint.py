"""The training checkpoint's RNG states, on a real gloo group: a restored rank draws what it would have drawn."""

from pathlib import Path

import pytest
import torch

from app.config.loading import load_config
from app.model.build import build_lora_model
from app.model.sharding import build_device_mesh, shard_model, trainable_parameters
from app.train.checkpoint import TrainerState, load_training_state, save_training_state
from tests.helpers import run_ranks


class StandInDeviceRng:
    """torch.cuda's RNG functions on a machine without a GPU: a generator of their own. (Where a GPU is
    there, the checkpoint calls torch.cuda's, with the same signatures.)"""

    def __init__(self):
        self.generator = torch.Generator()

    def get_rng_state(self, device=None) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        self.generator.set_state(state)


def _draws(device_rng: StandInDeviceRng) -> list[float]:
    """What dropout would draw next on the CPU and on the GPU."""
    return torch.cat([torch.rand(3), torch.rand(3, generator=device_rng.generator)]).tolist()


def _save_draw_restore_draw(rank: int, world: int, model_path: str, out: str) -> None:
    device_rng = StandInDeviceRng()
    torch.cuda.get_rng_state, torch.cuda.set_rng_state = device_rng.get_rng_state, device_rng.set_rng_state
    cfg = load_config(None, [f"model.path={model_path}", "fsdp.param_dtype=float32"])
    model = shard_model(build_lora_model(cfg.model, cfg.lora, seed=0), build_device_mesh("cpu"), cfg.fsdp)
    optimizer = torch.optim.AdamW(trainable_parameters(model))
    directory = Path(out) / "checkpoint"
    directory.mkdir(exist_ok=True)
    torch.manual_seed(10 + rank), device_rng.generator.manual_seed(20 + rank)
    save_training_state(directory, model, optimizer, TrainerState(1, 0, 0, {}, 1.0), torch.device("cuda", 0))
    expected = _draws(device_rng)
    torch.manual_seed(0), device_rng.generator.manual_seed(0)  # a new process seeds alike on every rank
    load_training_state(directory, model, optimizer, torch.device("cuda", 0))
    torch.save({"expected": expected, "restored": _draws(device_rng)}, f"{out}/draws-{rank}.pt")


@pytest.mark.slow
def test_a_restored_rank_continues_its_cpu_and_device_random_streams(embedded, tmp_path):
    run_ranks(_save_draw_restore_draw, 2, str(embedded["model"]), str(tmp_path))
    draws = [torch.load(tmp_path / f"draws-{rank}.pt") for rank in range(2)]
    assert all(d["restored"] == d["expected"] for d in draws)
    assert draws[0]["expected"] != draws[1]["expected"]  # each rank's own streams
