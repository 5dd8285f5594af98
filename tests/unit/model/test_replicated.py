"""scaling.mesh=replicate on a real 2-process gloo group (no Ray): every worker holding the whole model trains
the same adapter as the parameters sharded over both, and a checkpoint of one layout resumes in the other (a
rerun may resolve scaling.mesh=auto the other way, on a cluster with less memory)."""

from pathlib import Path

import pytest
import torch

from app.config.loading import load_config
from app.model.build import build_lora_model
from app.model.sharding import build_device_mesh, shard_group_size, shard_model, trainable_parameters
from app.train.checkpoint import TrainerState, gather_trainable_state, load_training_state, save_training_state
from tests.helpers import run_ranks

CPU = torch.device("cpu")


def _train_two_steps(rank: int, world: int, model_path: str, mesh: str, out: str, resume: str) -> None:
    cfg = load_config(None, [f"model.path={model_path}", "fsdp.param_dtype=float32", "lora.dropout=0",
                             f"scaling.mesh={mesh}"])
    device_mesh = build_device_mesh("cpu", cfg.scaling.mesh_shape(world))
    model = shard_model(build_lora_model(cfg.model, cfg.lora, seed=0), device_mesh, cfg.fsdp)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    if resume:
        load_training_state(Path(resume), model, optimizer, CPU)
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(rank + 10 * bool(resume)))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = gather_trainable_state(model)
    save_training_state(Path(out), model, optimizer, TrainerState(2, 0, 0, {}, 1.0), CPU)
    if rank == 0:
        torch.save({"adapter": state, "shards": shard_group_size(device_mesh)}, Path(out) / "adapter.pt")


def _run(model: Path, mesh: str, out: Path, resume: Path | None = None) -> dict:
    out.mkdir()
    run_ranks(_train_two_steps, 2, str(model), mesh, str(out), str(resume or ""))
    return torch.load(out / "adapter.pt")


def _assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and any("lora_B" in name for name in a)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_replicated_trains_the_sharded_adapter_and_their_checkpoints_resume_in_each_other(embedded, tmp_path):
    sharded = _run(embedded["model"], "null", tmp_path / "sharded")
    replicated = _run(embedded["model"], "replicate", tmp_path / "replicated")
    assert (sharded["shards"], replicated["shards"]) == (2, 1)
    assert any(t.abs().sum() > 0 for n, t in replicated["adapter"].items() if "lora_B" in n)  # it trained
    _assert_same_adapter(replicated["adapter"], sharded["adapter"])

    on_sharded = _run(embedded["model"], "null", tmp_path / "sharded-again", resume=tmp_path / "sharded")
    from_sharded = _run(embedded["model"], "replicate", tmp_path / "replicated-from-sharded", tmp_path / "sharded")
    from_replicated = _run(embedded["model"], "null", tmp_path / "sharded-from-replicated", tmp_path / "replicated")
    _assert_same_adapter(from_sharded["adapter"], on_sharded["adapter"])
    _assert_same_adapter(from_replicated["adapter"], on_sharded["adapter"])
