"""What the ranks send each other: sums, gathers, and rank 0's decisions and tensors.

Each does nothing in a single process: `barrier`, `all_reduce_sum`, `all_gather_bytes`,
`all_gather_objects`; `from_rank0` (a decision made on rank 0, its result or its error on every
rank), `on_every_rank` (what each rank does itself, any rank's error on every rank) and
`broadcast_tensors` (rank 0's tensors on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from andrea.errors import UserError
from andrea.train.torchrun import DistInfo

T = TypeVar("T")


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """`tensor` summed over the ranks, in place, wherever it lives: nccl reduces GPU tensors
    only, so a host tensor travels to the rank's GPU and back."""
    if info.enabled:
        sent = tensor.to(_comm_device(info))
        dist.all_reduce(sent, op=dist.ReduceOp.SUM)
        if sent is not tensor:
            tensor.copy_(sent)
    return tensor


def all_gather_bytes(data: torch.Tensor, info: DistInfo) -> list[torch.Tensor]:
    """Gather an equal-length uint8 tensor from every rank (RNG states for checkpoints)."""
    if not info.enabled:
        return [data]
    local = data.to(_comm_device(info))
    parts = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(parts, local)
    return [p.cpu() for p in parts]


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's (small, picklable) `obj`, in rank order."""
    if not info.enabled:
        return [obj]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def on_every_rank(work: Callable[[], T], info: DistInfo) -> T:
    """work() run on every rank, its result here. An exception on any rank is raised on every
    rank (a UserError as one line, `rank N: ` before it), so that no rank goes on alone into a
    collective the failed one never joins (gloo then fails with a traceback, nccl hangs)."""
    if not info.enabled:
        return work()
    result: T | None = None
    failure: BaseException | None = None
    try:
        result = work()
        outcome: tuple[str, str] = ("ok", "")
    except Exception as exc:  # re-raised below, after the others have heard of it
        failure = exc
        outcome = ("user" if isinstance(exc, UserError) else "failed", str(exc))
    outcomes = all_gather_objects(outcome, info)
    failed = [(rank, kind, text) for rank, (kind, text) in enumerate(outcomes) if kind != "ok"]
    if not failed:
        return result  # type: ignore[return-value]
    rank, kind, text = failed[0]
    if kind == "user":
        raise UserError(f"rank {rank}: {text}")
    if failure is not None:
        raise failure
    raise RuntimeError(f"rank {rank} failed: {text}")


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
