"""FSDP2 on a real 2-process gloo group (no Ray): decoder layers found generically, adapter gathered whole."""

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.checkpoint import gather_trainable_state, save_adapter
from app.config import load_config
from app.model import build_lora_model, load_tokenizer
from app.sharding import build_device_mesh, decoder_layers, shard_model, trainable_parameters


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_and_export(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={model_path}", "fsdp.param_dtype=float32", "lora.dropout=0"])
    model = build_lora_model(cfg.model, cfg.lora, seed=0)
    shard_model(model, build_device_mesh("cpu"), cfg.fsdp)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    ids = torch.randint(4, 300, (2, 16), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # lora_B starts at zero: two steps make every element non-zero
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    local = {n: p.to_local().detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.save(local, f"{out}/rank{rank}.pt")
    state = gather_trainable_state(model)
    if rank == 0:
        save_adapter(model, state, Path(out) / "adapter", load_tokenizer(cfg.model))
    dist.destroy_process_group()


def test_decoder_layers_are_found_from_the_model_not_its_class_name(embedded):
    cfg = load_config(None, [f"model.path={embedded['model']}"])
    model = build_lora_model(cfg.model, cfg.lora, seed=0)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    assert {type(layer).__name__ for layer in layers} == {"LlamaDecoderLayer"}


def test_adapter_is_gathered_from_every_shard_and_reloads_with_peft(embedded, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    mp.spawn(_train_and_export, args=(2, _free_port(), str(embedded["model"]), str(tmp_path)), nprocs=2)
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(embedded["model"]),
                                         tmp_path / "adapter")
    params = dict(reloaded.named_parameters())
    lora_b = [n for n in shards[0] if "lora_B" in n]
    assert lora_b, "no LoRA B matrices were trained"
    for name in shards[0]:
        whole = torch.cat([shards[0][name], shards[1][name]])  # FSDP2 shards dim 0 across ranks
        assert torch.equal(params[name].detach(), whole), name
    # the second rank's half of lora_B is what a rank-0-only save would have lost
    assert all(shards[1][n].abs().sum() > 0 for n in lora_b)
