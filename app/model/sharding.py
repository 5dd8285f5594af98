"""FSDP2: the device mesh, which modules become FSDP units, mixed precision and offload."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from app.model.hardware import torch_dtype

if TYPE_CHECKING:
    from app.config.sections import FsdpSection


def process_group_backend(use_gpu: bool, cpu_offload: bool) -> str:
    """NCCL on GPUs, gloo on CPUs. With CPU offload on GPUs both, per device type: the sharded gradients
    are CPU DTensors then, and NCCL alone cannot reduce them (grad-norm clipping, the adapter gather;
    pytorch issue 148532)."""
    if not use_gpu:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"


def init_torchrun_process_group(cpu_offload: bool = False) -> tuple[int, int, torch.device]:
    """Under torchrun (the benchmark scripts); returns (rank, world size, device)."""
    cuda = torch.cuda.is_available()
    dist.init_process_group(process_group_backend(cuda, cpu_offload))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def build_device_mesh(device_type: str, shape: tuple[int, ...] | list[int] | None = None) -> DeviceMesh:
    """A 1-D mesh over every rank (FSDP), or a 2-D [replicas, shard size] mesh (HSDP: parameters are
    sharded within a group, e.g. a node's GPUs, and replicated across groups, so the all-gathers of
    every layer stay on the fast intra-node links and only gradient all-reduces cross nodes). The shape is
    scaling.mesh_shape's (None: every rank of the process group)."""
    shape = tuple(shape or (dist.get_world_size(),))
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found without naming any architecture.

    First choice: modules whose class the model lists in `_no_split_modules` (every Hugging Face
    decoder declares its block there). Fallback: the children of the largest ModuleList whose
    members share one class.
    """
    no_split: set[str] = set()
    for module in model.modules():
        no_split.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in no_split]
    if layers:
        return layers
    lists = [m for m in model.modules()
             if isinstance(m, nn.ModuleList) and len(m) > 1 and len(Counter(type(c) for c in m)) == 1]
    if not lists:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return list(max(lists, key=len))


def shard_model(model: nn.Module, mesh: DeviceMesh, fsdp: FsdpSection, compile_layers: bool = False,
                prepare_layer: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """fully_shard each decoder layer, then the root (embeddings, final norm, LM head); `prepare_layer` runs
    on each layer just before it is sharded (app.model.quantization: NF4 weights, one layer at a time); with
    `compile_layers`, each layer's forward is torch.compile'd after its fully_shard: FSDP's hooks stay
    outside the compiled code (each layer compiles once and the others reuse its code), and what is compiled
    is the forward of the class fully_shard swapped in, the outermost one, which transformers'
    GradientCheckpointingLayer checkpoints (compiled before, the inner forward runs unchecked).

    Parameters keep their original dtypes (frozen base in bf16, LoRA in fp32: the optimizer updates
    fp32 master weights) and are all-gathered and computed in `fsdp.param_dtype`; gradients are
    reduced in `fsdp.reduce_dtype` (averaged over ranks: see app.train.loss for the matching scale).
    """
    policy = MixedPrecisionPolicy(param_dtype=torch_dtype(fsdp.param_dtype, mesh.device_type),
                                  reduce_dtype=torch_dtype(fsdp.reduce_dtype))
    kwargs = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=fsdp.reshard_after_forward)
    if fsdp.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    kept_whole: set[nn.Parameter] = set()
    for layer in decoder_layers(model):
        if prepare_layer is not None:
            prepare_layer(layer)
        kept_whole |= unshardable_on_one_rank(layer, mesh)
        fully_shard(layer, **kwargs, ignored_params=kept_whole or None)
        if compile_layers:
            layer.forward = torch.compile(layer.forward)
    # The root (embeddings, LM head) is needed again at once by backward: kept gathered, as fully_shard does by
    # default for a root; the chunked loss (app/train/loss.py) reads the LM head's gathered weight after the forward.
    fully_shard(model, **(kwargs | {"reshard_after_forward": False}), ignored_params=kept_whole or None)
    return model


def unshardable_on_one_rank(module: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Parameters FSDP2 must leave alone when each shard group is one rank: tensor subclasses with their own
    all-gather (NF4 weights, app.model.quantization), whose several all-gather inputs FSDP2's one-rank path
    does not handle (torch 2.13: it copies the first). There is nothing to shard then; they stay whole."""
    if shard_group_size(mesh) > 1:
        return set()
    return {p for p in module.parameters() if hasattr(p, "fsdp_pre_all_gather")}


def shard_group_size(mesh: DeviceMesh) -> int:
    """How many ranks each parameter of a built mesh is split over: its last (shard) dimension, as
    scaling.mesh_shape laid it out."""
    return mesh.size(mesh.ndim - 1)


def reshard(model: nn.Module) -> None:
    """Put every FSDP unit back in its sharded state.

    After a forward under no_grad (evaluation, generation), units that keep their gathered weights
    (`reshard_after_forward=False`, and always the root) still have the unsharded `param_dtype` copies
    registered: `named_parameters()` would then yield bf16 copies instead of the fp32 shards.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage of `param` and which part of the full tensor it holds."""
    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def full_grad_norm(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_ over DTensors returns a DTensor; this makes it a plain (device) tensor."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
