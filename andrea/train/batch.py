"""A step's batch: train.global_batch_tokens as whole windows per process, the micro-batch
(a given number, a resumed run's recorded choice, or the largest that andrea/train/memory.py
estimates to fit), the micro-batches a step accumulates, and the batch-size warm-up's.
"""

from __future__ import annotations

import math

import torch

from andrea.config import Config
from andrea.errors import UserError, counted
from andrea.model.transformer import Andrea
from andrea.train.collectives import all_reduce_sum, from_rank0
from andrea.train.device import device_name
from andrea.train.memory import CPU_MICRO_BATCH_TOKENS, GIB, available_memory, choose_micro_batch
from andrea.train.rundir import TrainerState
from andrea.train.torchrun import DistInfo


def resolve_micro_batch(
    cfg: Config,
    model: Andrea,
    dtype: torch.dtype,
    device: torch.device,
    *,
    dist: DistInfo | None = None,
    trainer_state: TrainerState | None = None,
) -> tuple[int, str]:
    """(micro-batch, the line that explains an automatic choice or ''). An integer is obeyed;
    'auto' reuses the value a resumed run recorded on as many processes and the same device,
    else the largest that fits the memory (on a CPU, of at most CPU_MICRO_BATCH_TOKENS tokens).
    Without dist: for one process (e.g. `andrea bench`)."""
    t, dist = cfg.train, dist or DistInfo()
    if isinstance(t.micro_batch_size, int):
        return t.micro_batch_size, ""
    block = cfg.model.block_size
    # Rank 0 decides for all: ranks on other kinds of GPU must not take different paths.
    recorded = from_rank0(lambda: None if trainer_state is None else
                          trainer_state.recorded_micro_batch(dist.world_size, device_name(device)),
                          dist)
    if recorded is not None:
        return recorded, f"micro-batch: auto -> {recorded} x {block} (the run's recorded choice)"
    if t.global_batch_tokens == 0:  # one micro-batch per process: of no size to derive from
        raise UserError(
            f"{cfg.source}: train.micro_batch_size: auto needs train.global_batch_tokens of at "
            f"least block_size x processes = {block * dist.world_size} (0 is one micro-batch per "
            f"process); set it, or give micro_batch_size as a number"
        )
    full = windows_per_process(cfg, dist.world_size)
    sequences = micro_batch_windows(cfg, dist.world_size)
    cap = max(1, CPU_MICRO_BATCH_TOKENS // block) if device.type == "cpu" else None
    choice = choose_micro_batch(
        cfg.model, model.num_params(), sequences, dtype,
        checkpointing=t.activation_checkpointing == "blocks",
        loss_chunk_rows=t.loss_chunk_rows,
        available=available_memory(device, dist.local_world_size), max_sequences=cap,
    )
    # Ranks measure their memory at slightly different moments: all take the smallest choice.
    votes = torch.zeros(dist.world_size, device=device)
    votes[dist.rank] = choice.micro_batch
    micro_batch = int(all_reduce_sum(votes, dist).min().item())
    accum = full // micro_batch
    line = (
        f"micro-batch: auto -> {micro_batch} x {block} ({accum} accumulation step"
        f"{'s' if accum != 1 else ''}), estimated {choice.estimated_bytes / GIB:.1f} of "
        f"{choice.available_bytes / GIB:.1f} GiB available"
    )
    if cap is not None and cap < sequences:
        line += f" (on a CPU at most {CPU_MICRO_BATCH_TOKENS:,} tokens a micro-batch)"
    if not choice.fits:
        line += (" (does not fit even at 1: expect to run out of memory; try "
                 "train.activation_checkpointing=blocks)")
    return micro_batch, line


def accumulation_steps(
    cfg: Config, micro_batch: int, world_size: int, trainer_state: TrainerState | None = None
) -> tuple[int, str]:
    """(micro-batches per process and step, a line when a resume changes the tokens per step).
    train.global_batch_tokens: 0 means one micro-batch per process when a run starts; a resumed
    run keeps the tokens per step it started with (on fewer processes, more micro-batches),
    or says that it cannot when they do not divide."""
    per_round = micro_batch * cfg.model.block_size * world_size
    target = cfg.train.global_batch_tokens
    if target == 0:
        recorded = (trainer_state.recorded_tokens_per_step(cfg.model.block_size)
                    if trainer_state is not None else None)
        if recorded is None or recorded == per_round:
            return 1, ""
        if recorded % per_round == 0:
            return recorded // per_round, ""
        return 1, (
            f"resume: tokens/step {recorded:,} -> {per_round:,} (global_batch_tokens: 0 is one "
            f"micro-batch per process, and {recorded:,} is not a multiple of {micro_batch} x "
            f"{cfg.model.block_size} x {counted(world_size, 'process', 'processes')}; a "
            f"train.micro_batch_size that divides it keeps it)"
        )
    if target % per_round:
        windows = windows_per_process(cfg, world_size)
        shared = micro_batch_windows(cfg, world_size)
        fits = max(m for m in range(1, micro_batch + 1) if shared % m == 0)
        raise UserError(
            f"{cfg.source}: train.global_batch_tokens: {target} is not a "
            f"multiple of micro_batch_size * block_size * processes = "
            f"{micro_batch} * {cfg.model.block_size} * {world_size} = {per_round}; each "
            f"process takes {windows} windows a step: give a micro-batch that divides them, "
            f"e.g. --set train.micro_batch_size={fits}"
        )
    return target // per_round, ""


def micro_batch_windows(cfg: Config, world_size: int) -> int:
    """The windows a micro-batch must divide: a process's in a step and, under a batch-size
    warm-up, a process's in a warm-up step as well (when those are whole windows: otherwise
    batch_warmup_accumulation refuses the warm-up, whatever the micro-batch)."""
    windows = windows_per_process(cfg, world_size)
    round_tokens = cfg.model.block_size * world_size
    warmup = cfg.train.batch_warmup_tokens
    if batch_warmup_active(cfg) and warmup % round_tokens == 0:
        return math.gcd(windows, warmup // round_tokens)
    return windows


def windows_per_process(cfg: Config, world_size: int) -> int:
    """train.global_batch_tokens as whole block_size windows per process and step; a UserError
    saying what would split it when it does not split evenly, which no micro-batch can fix."""
    target, block = cfg.train.global_batch_tokens, cfg.model.block_size
    round_tokens = block * world_size
    if target % round_tokens == 0 and target > 0:
        return target // round_tokens
    processes = "process" if world_size == 1 else "processes"
    other_count = ", or train on a number of processes that divides the step's windows"
    if target < round_tokens:
        why = f"less than one {block}-token window for each of {world_size} {processes}"
        other_count = ", or train on fewer processes"
    elif target % block:
        why, other_count = f"not whole {block}-token windows", ""
    else:
        why = (f"{target // block} windows of {block} tokens, which {world_size} {processes} "
               f"cannot share evenly")
    raise UserError(
        f"{cfg.source}: train.global_batch_tokens: {target:,} is {why}; a step's tokens must "
        f"be a multiple of block_size x processes = {round_tokens:,} (a new run){other_count}"
    )


def batch_warmup_active(cfg: Config) -> bool:
    """A batch-size warm-up that changes anything: a smaller batch first."""
    t = cfg.train
    return 0 < t.batch_warmup_tokens < t.global_batch_tokens


def batch_warmup_accumulation(cfg: Config, micro_batch: int, world_size: int) -> int:
    """Micro-batches per process and step during the batch-size warm-up (0: no warm-up)."""
    t = cfg.train
    per_round = micro_batch * cfg.model.block_size * world_size
    if not batch_warmup_active(cfg):
        return 0
    sequence_round = cfg.model.block_size * world_size
    if t.batch_warmup_tokens % sequence_round:
        # With a micro-batch of the config's own, whole sequences are not enough: named at once
        # (not refused again once made whole); auto's micro-batch divides any whole count.
        # A value below global_batch_tokens, else the warm-up would be off.
        below = (t.global_batch_tokens - 1) // per_round * per_round
        near = min(below, max(per_round, round(t.batch_warmup_tokens / per_round) * per_round))
        fixed = "" if t.micro_batch_size == "auto" else (
            f", and with train.micro_batch_size {micro_batch} one of micro_batch_size * "
            f"block_size * processes = {per_round}: e.g. {near}" if below > 0 else
            f"; with train.micro_batch_size {micro_batch} no warm-up batch is below "
            f"global_batch_tokens {t.global_batch_tokens}: lower train.micro_batch_size")
        raise UserError(
            f"{cfg.source}: train.batch_warmup_tokens: {t.batch_warmup_tokens} is not a "
            f"multiple of block_size * processes = {cfg.model.block_size} * {world_size} = "
            f"{sequence_round}; make it one{fixed}"
        )
    if t.batch_warmup_tokens % per_round:
        raise UserError(
            f"{cfg.source}: train.batch_warmup_tokens: {t.batch_warmup_tokens} is not a "
            f"multiple of micro_batch_size * block_size * processes = "
            f"{micro_batch} * {cfg.model.block_size} * {world_size} = {per_round}; make it one, "
            f"or lower train.micro_batch_size"
        )
    return t.batch_warmup_tokens // per_round
