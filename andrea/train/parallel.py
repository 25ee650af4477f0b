"""How the processes share the training: one process alone, `ddp` or `fsdp`, one object each.

`ddp`: every process a whole copy of the model, gradients all-reduced; `fsdp`: parameters,
gradients and optimizer state sharded over the processes (FSDP2). The one place that knows the
modes: set-up builds one `Parallel` from train.parallel and the process group (`parallel_for`),
and the set-up, the loop, the checkpoint and the plan lines ask it what to do instead of
comparing the mode's name.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

from andrea.config import register_choices
from andrea.train.compiled import compile_model
from andrea.train.rundir import TrainerState
from andrea.train.sharding import clip_grad_norm, shard_model
from andrea.train.torchrun import DistInfo


def bare_name(name: str) -> str:
    """A parameter's or state_dict key's name as the model itself has it, without the prefixes
    of the wrappers `Parallel.wrap` puts around it (compiled, inside DDP)."""
    return name.replace("_orig_mod.", "").removeprefix("module.")


@dataclass
class Parallel:
    """One process training alone (also a run that asked for ddp or fsdp with one process)."""

    dist: DistInfo
    asked: str  # train.parallel as configured, whatever the number of processes

    name: ClassVar[str] = "none"  # the plan lines' and the checkpoint's word for the mode
    # Each process holds a shard of the weights and optimizer state, so: a checkpoint is
    # written as every rank's shards (plus the gathered weights), every forward is a
    # collective (evaluation runs in lockstep), and every rank must see the run folder.
    sharded: ClassVar[bool] = False

    def shard(self, model: nn.Module, device: torch.device, bf16_params: bool) -> None:
        """Lay the model out over the processes, before the optimizer takes its parameters."""

    def wrap(self, model: nn.Module, compile_mode: str | None, device: torch.device) -> nn.Module:
        """The module the steps call: compiled in torch.compile's `compile_mode` if one is given
        (inside DDP under ddp)."""
        return model if compile_mode is None else compile_model(model, compile_mode)

    def gradient_sync(self, model: nn.Module, train_model: nn.Module,
                      last: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-batch's forward and backward: the gradients are shared among
        the processes on the last micro-batch of a step only."""
        return contextlib.nullcontext()

    def clip(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients to max_norm by their global norm; returns that norm."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def lines(self) -> list[str]:
        """What the plan says about the processes' share of the work."""
        if MODES[self.asked].sharded:
            return [f"parallel: {self.asked} with 1 process: nothing to shard, the model runs "
                    f"whole"]
        return []

    def layout_change_line(self, trainer_state: TrainerState) -> str | None:
        """The plan line when a resumed checkpoint was written by another number of processes
        or in another mode, else None."""
        was_world = trainer_state.world_size
        was = trainer_state.parallel or mode_before_recorded(was_world)
        if (was_world, was) == (self.dist.world_size, self.name):
            return None
        before, now = processes(was_world, was), processes(self.dist.world_size, self.name)
        if MODES.get(was, Parallel).sharded or self.sharded:
            return f"resume: resharding the checkpoint written by {before} for {now}"
        return f"resume: the checkpoint written by {before} goes on with {now}"  # whole weights


def processes(world_size: int, mode: str) -> str:
    """'1 process', '2 processes (fsdp)': a layout as the resume line names it."""
    return "1 process" if world_size == 1 else f"{world_size} processes ({mode})"


@dataclass
class DataParallel(Parallel):
    name: ClassVar[str] = "ddp"

    def wrap(self, model: nn.Module, compile_mode: str | None, device: torch.device) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [self.dist.local_rank] if device.type == "cuda" else None
        return DDP(super().wrap(model, compile_mode, device), device_ids=device_ids)

    def gradient_sync(self, model: nn.Module, train_model: nn.Module,
                      last: bool) -> contextlib.AbstractContextManager[Any]:
        # DDP all-reduces the gradients after every backward outside no_sync.
        return contextlib.nullcontext() if last else train_model.no_sync()  # type: ignore[operator]


@dataclass
class FullyShardedParallel(Parallel):
    name: ClassVar[str] = "fsdp"
    sharded: ClassVar[bool] = True

    def shard(self, model: nn.Module, device: torch.device, bf16_params: bool) -> None:
        shard_model(model, self.dist, device, bf16_params)

    def gradient_sync(self, model: nn.Module, train_model: nn.Module,
                      last: bool) -> contextlib.AbstractContextManager[Any]:
        # FSDP reduce-scatters the gradients after a backward while this is on.
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()

    def clip(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(list(model.parameters()), max_norm)  # over every rank's shards

    def lines(self) -> list[str]:
        n = self.dist.world_size
        return [f"parallel: {self.name}, parameters, gradients and optimizer state sharded over "
                f"{n} process{'es' if n != 1 else ''}"]


MODES: dict[str, type[Parallel]] = {mode.name: mode for mode in (DataParallel,
                                                                  FullyShardedParallel)}
register_choices("train.parallel", MODES)  # its names are the key's allowed values
# The modes a checkpoint records (trainer_state.json's parallel): one process's too.
register_choices("trainer_state.parallel", {mode.name: mode for mode in (Parallel,
                                                                          *MODES.values())})


def parallel_for(asked: str, dist: DistInfo) -> Parallel:
    """The mode a run trains in: train.parallel (`asked`) when there are several processes,
    else one process alone."""
    return MODES[asked](dist, asked) if dist.enabled else Parallel(dist, asked)


def mode_before_recorded(world_size: int) -> str:
    """The mode of a checkpoint written before checkpoints recorded it: ddp was the only mode
    with several processes."""
    return DataParallel.name if world_size > 1 else Parallel.name
