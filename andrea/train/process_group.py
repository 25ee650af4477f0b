"""The process group of a torchrun launch: joined within a time limit, and left.

gloo on CPU, nccl on GPU; a process that cannot meet the others within train.join_timeout stops
with one line (`join_watchdog`); the group is destroyed while Python is whole (`shutdown`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

from andrea.train.restarts import attempt
from andrea.train.torchrun import DistInfo, TorchrunEnv, torchrun_env

# Set to 1 under `torchrun --nproc-per-node 1`: a process group of one (DistInfo.group_of_one),
# so that scripts/gpu_speed.py runs the NCCL path, ddp and fsdp, on a machine with one GPU.
GROUP_OF_ONE = "ANDREA_PROCESS_GROUP_OF_ONE"


def init_distributed(device_type: str, join_timeout: float = 300.0) -> DistInfo:
    """Join the torchrun process group if there are several processes; else a single one.
    A process that cannot meet the others within join_timeout seconds stops with one line."""
    env = torchrun_env()
    group_of_one = env.world_size == 1 and os.environ.get(GROUP_OF_ONE) == "1" and bool(
        env.master_addr)
    if env.world_size <= 1 and not group_of_one:
        return DistInfo()
    info = DistInfo(env.rank, env.local_rank, env.world_size, env.local_world_size,
                    group_of_one=group_of_one)
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        with join_watchdog(join_timeout, env):
            dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                    store=attempt().store, rank=env.rank,
                                    world_size=env.world_size)
    return info


@contextlib.contextmanager
def join_watchdog(seconds: float, env: TorchrunEnv) -> Iterator[None]:
    """torch waits for the other processes in native code, silently and for half an hour by
    default; past `seconds` this ends the process with one line (exit code 2) instead."""

    def give_up() -> None:
        os.write(2, (
            f"error: rank {env.rank} of {env.world_size}: the processes did not all join "
            f"within {seconds:g} s (train.join_timeout); check "
            f"that every node runs the same command, then launch again with torchrun's static "
            f"rendezvous (--master-addr HOST --master-port PORT --node-rank I), whose "
            f"restarts always agree; --resume auto continues the run\n").encode())
        os._exit(2)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        # The DDP wrapper sits in reference cycles and holds the process group and tensors;
        # left to the interpreter's last collection, gloo's threads are torn down after Python
        # is gone, which can abort a finished run (SIGABRT). Free it while Python is whole.
        gc.collect()
        dist.destroy_process_group()
