"""FSDP2 sharding (`train.parallel: fsdp`): the model sharded, and its tensors whole again.

Parameters, gradients and optimizer state are sharded over the processes (`shard_model`);
checkpoints gather them into whole tensors (`full_tensor`) and scatter them back on load
(`shard_like`), so a checkpoint does not depend on the number of processes or the mode; the
global gradient norm over every shard (`clip_grad_norm`).
"""

from __future__ import annotations

import sys

import torch

from andrea.train.torchrun import DistInfo


def shard_model(model: torch.nn.Module, info: DistInfo, device: torch.device,
                bf16_params: bool) -> None:
    """FSDP2 in place: each block its own unit (gathered just for its forward and backward),
    then the root, which holds the embeddings, the final norm and the tied LM head together (a
    shared parameter must live in one unit). bf16_params: gather the weights in bfloat16 and
    reduce the gradients in float32 (for a GPU; on the CPU autocast does the casting, so fsdp
    computes exactly what ddp does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (info.world_size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16_params else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def is_dtensor(value: object) -> bool:
    """Whether `value` is a sharded (FSDP2) tensor. Importing torch.distributed.tensor costs about
    a second of every process's start-up, so it is left to fully_shard: until something has
    imported it, no tensor can be a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a collective: every rank calls it, in the same order);
    a plain tensor as it is."""
    return value.full_tensor() if is_dtensor(value) else value


def shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`whole` laid out as `like` is: this rank's shard if `like` is sharded. Every rank holds
    the whole tensor already (read from the checkpoint), so nothing is sent."""
    if not is_dtensor(like):
        return whole.to(like.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements,
                             src_data_rank=None)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global gradient norm (over every shard when sharded), then clip to max_norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = full_tensor(torch.nn.utils.get_total_norm(grads))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
