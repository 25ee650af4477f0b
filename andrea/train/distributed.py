"""Process-group setup for torchrun: DistributedDataParallel over gloo (CPU) or nccl (GPU).

One machine: `torchrun --nproc_per_node=K -m andrea train ...`. Several machines: the same command
on each with `--nnodes=N --node_rank=i --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT`; nothing in
the trainer changes, since ranks, the global batch and the data streams derive from WORLD_SIZE and
RANK. See docs/training.md for where FSDP2 would plug in.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistInfo:
    """Join the torchrun process group if WORLD_SIZE > 1; else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world)
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return info


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_bytes(data: torch.Tensor, info: DistInfo) -> list[torch.Tensor]:
    """Gather an equal-length uint8 tensor from every rank (RNG states for checkpoints)."""
    if not info.enabled:
        return [data]
    device = torch.device("cuda", info.local_rank) if dist.get_backend() == "nccl" else "cpu"
    local = data.to(device)
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local)
    return [p.cpu() for p in parts]


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        # The DDP wrapper sits in reference cycles and holds the process group and tensors;
        # left to the interpreter's last collection, gloo's threads are torn down after Python
        # is gone, which can abort a finished run (SIGABRT). Free it while Python is whole.
        gc.collect()
        dist.destroy_process_group()
