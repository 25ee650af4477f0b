"""Process-group setup for torchrun (gloo on CPU, nccl on GPU), and FSDP2 sharding.

One machine: `torchrun --nproc_per_node=K -m andrea train ...`. Several machines: the same command
on each with `--nnodes=N --node_rank=i --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT`; nothing in
the trainer changes, since ranks, the global batch and the data streams derive from WORLD_SIZE and
RANK. `train.parallel: fsdp` shards parameters, gradients and optimizer state (`shard_model`);
checkpoints gather them into whole tensors (`full_tensor`) and scatter them back on load
(`shard_like`), so a checkpoint does not depend on the number of processes or the mode.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from andrea.errors import Restarting, UserError

T = TypeVar("T")


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells each process it starts, through the environment; a process started
    otherwise is rank 0 of 1."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # the processes on this machine
    restart_count: int = 0  # how often the launcher has restarted the processes
    max_restarts: int = 0  # how often it may (torchrun --max-restarts)
    run_id: str = ""  # the launcher's id of the job (--rdzv_id)
    master_addr: str = ""
    master_port: int = 0
    agent_store: bool = False  # whether the launcher's key-value store is open to the processes


@functools.cache
def torchrun_env() -> TorchrunEnv:
    """The torchrun environment, read once per process: every user takes it from here."""
    env = os.environ
    return TorchrunEnv(
        rank=int(env.get("RANK", "0")), local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        run_id=env.get("TORCHELASTIC_RUN_ID", ""), master_addr=env.get("MASTER_ADDR", ""),
        master_port=int(env.get("MASTER_PORT", "0")),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1  # the processes on this machine, which share its memory

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str, join_timeout: float = 300.0) -> DistInfo:
    """Join the torchrun process group if there are several processes; else a single one.
    A process that cannot meet the others within join_timeout seconds stops with one line."""
    env = torchrun_env()
    if env.world_size <= 1:
        return DistInfo()
    info = DistInfo(env.rank, env.local_rank, env.world_size, env.local_world_size)
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


@dataclass(frozen=True)
class Attempt:
    """Which launch of the workers this is, the same on every rank, and its key-value store."""

    number: int  # 0: the first launch; n: torchrun's n-th restart of the workers
    store: Any  # this attempt's part of torchrun's store (None without a shared one)


@functools.cache
def attempt() -> Attempt:
    """torchrun keeps its store across a restart: without keys of its own, a restarted worker
    reads the addresses the dead attempt published there, and gloo fails to connect
    (`connectFullMesh ... Connection refused`) or waits on them. TORCHELASTIC_RESTART_COUNT
    alone cannot name the attempt: under --rdzv-backend c10d across machines, a node whose
    workers did not fail restarts them without counting. Every restart starts every rank once,
    so each rank takes the first number, from the restart count on, it has not started under."""
    env = torchrun_env()
    if env.world_size <= 1 or not env.agent_store:
        return Attempt(env.restart_count, None)
    client = dist.TCPStore(env.master_addr, env.master_port, world_size=env.world_size,
                           is_master=False, timeout=timedelta(minutes=5))
    number = env.restart_count
    while client.add(f"andrea/rank-{env.rank}/started-{number}", 1) > 1:
        number += 1
    return Attempt(number, dist.PrefixStore(f"andrea/attempt-{number}", client))


def lost_ranks(info: DistInfo, wait: float = 5.0) -> list[int] | None:
    """After a collective failed on this rank: the ranks that do not answer a roll call in this
    attempt's store within `wait` seconds. Every rank a collective failed on answers, so []
    means that no process was lost (the failure is another); None: no store to ask (it is gone
    with node 0's launcher, or torchrun shares none)."""
    store = attempt().store
    if store is None:
        return None
    try:
        store.set(f"andrea/alive/{info.rank}", "1")
        deadline = time.monotonic() + wait
        while True:
            missing = [r for r in range(info.world_size)
                       if not store.check([f"andrea/alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except (RuntimeError, OSError):  # the store's own failure: nobody left to ask
        return None


def lost_peer_line(info: DistInfo, exc: BaseException, step: int, checkpoint: Path | None,
                   run_dir: Path) -> UserError | Restarting | None:
    """What the surviving ranks say when a collective failed because another rank's process
    ended (gloo's or nccl's own message names an address, not a rank, nor how to go on), as
    the exception that ends this process; None for any other failure."""
    if not (info.enabled and isinstance(exc, RuntimeError)):
        return None
    lost = lost_ranks(info)
    if lost == []:
        return None
    line, restarting = lost_peer_words(lost, step, checkpoint, run_dir, attempt().number,
                                       torchrun_env().max_restarts)
    return Restarting(line) if restarting else UserError(line)


def lost_peer_words(lost: list[int] | None, step: int, checkpoint: Path | None, run_dir: Path,
                    attempt_number: int, max_restarts: int) -> tuple[str, bool]:
    """(the line, whether torchrun restarts the job) for `lost` ranks (None: unknown, the store
    is gone with node 0's launcher, which takes the job with it) in attempt `attempt_number`.
    The attempt counts every restart, and each node's launcher at most as many, so restarts
    left by it are left on every node: the line never promises one that does not come."""
    who = (f"ranks {', '.join(map(str, lost))} were lost (their processes ended, or their "
           f"nodes went down)" if lost and len(lost) > 1 else
           f"{f'rank {lost[0]}' if lost else 'a process on another node'} was lost (its "
           f"process ended, or its node went down)")
    where = (f"the newest intact checkpoint is {checkpoint}" if checkpoint is not None
             else "no checkpoint was written yet")
    head = f"{who} after step {step}; {where}"
    if lost and attempt_number < max_restarts:
        return (f"{head}; torchrun restarts the job (restart {attempt_number + 1} of "
                f"{max_restarts})"), True
    return (f"{head}; continue with the same launch and --resume {run_dir} (torchrun "
            f"--max-restarts N continues by itself)"), False


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
    local = data.to(_comm_device(info))
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local)
    return [p.cpu() for p in parts]


def _comm_device(info: DistInfo) -> torch.device:
    """Where a collective's tensors must live: the rank's GPU under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", info.local_rank)
    return torch.device("cpu")


def from_rank0(decide: Callable[[], T], info: DistInfo) -> T:
    """decide() run on rank 0 alone, its (small, picklable) result on every rank. An exception
    there is raised on every rank too (a UserError as the same one-line error), so no rank is
    left waiting for a value that never comes."""
    if not info.enabled:
        return decide()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if info.is_main:
        try:
            box = [("ok", decide())]
        except Exception as exc:  # re-raised below, after the others have heard of it
            failure = exc
            box = [("user" if isinstance(exc, UserError) else "failed", str(exc))]
    dist.broadcast_object_list(box, src=0, device=_comm_device(info))
    kind, value = box[0]
    if failure is not None:
        raise failure
    if kind == "user":
        raise UserError(value)
    if kind == "failed":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def broadcast_tensors(tensors: dict[str, torch.Tensor], info: DistInfo) -> dict[str, torch.Tensor]:
    """Rank 0's named tensors, as CPU tensors on every rank (the others pass {}): their names,
    shapes and dtypes first, then each tensor, one at a time."""
    if not info.enabled:
        return tensors
    layout = from_rank0(lambda: {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, info)
    device, out = _comm_device(info), {}
    for key, (shape, dtype) in layout.items():
        if info.is_main:
            buffer = tensors[key].to(device).contiguous()
        else:
            buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buffer, src=0)
        out[key] = buffer.cpu()
    return out


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        # The DDP wrapper sits in reference cycles and holds the process group and tensors;
        # left to the interpreter's last collection, gloo's threads are torn down after Python
        # is gone, which can abort a finished run (SIGABRT). Free it while Python is whole.
        gc.collect()
        dist.destroy_process_group()


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
