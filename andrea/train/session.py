"""What one training process holds while it trains, and what a run's end reports.

`Session` and `TrainResult`: the types the set-up (andrea/train/setup.py) builds and the loop
advances."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from andrea.config import Config
from andrea.data.loader import TokenSplit
from andrea.errors import counted
from andrea.model.transformer import Andrea
from andrea.train.flops import MfuMeter, flops_per_token
from andrea.train.metrics import MetricsLog, Throughput
from andrea.train.parallel import Parallel
from andrea.train.runlock import TrainingLocks
from andrea.train.scaling import LossScaling
from andrea.train.signals import SignalWatch
from andrea.train.spike import SpikeGuard
from andrea.train.torchrun import DistInfo
from andrea.train.validation import ValSource


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    tokens: int
    seconds: float
    state: str  # finished | stopped | interrupted | nonfinite | nothing to do
    best_val_loss: float | None
    best_val_step: int | None
    last_val_loss: float | None
    checkpoint: Path | None
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss
    exit_code: int = 0
    message: str = ""
    is_main: bool = True  # rank 0 (the one process that writes and speaks)
    said: bool = False  # its end lines are printed (`say`)
    start_step: int = 0  # the step this process began from (a resume's checkpoint)
    skipped: int = 0  # steps not applied for a non-finite loss or gradient (skip_nonfinite)

    def say(self) -> None:
        """Rank 0's end of the run, once: a stop's line on stderr (`error: ` unless the user
        asked for it: Ctrl-C, a scheduler's SIGTERM), then the summary line on stdout."""
        if self.is_main and not self.said:
            if self.message and self.exit_code:
                prefix = "" if self.state == "interrupted" else "error: "
                print(f"{prefix}{self.message}", file=sys.stderr, flush=True)
            print(self.summary_line(), flush=True)
        self.said = True

    def summary_line(self) -> str:
        """The run's last line (rank 0's stdout): how it ended, size, best val loss, checkpoint."""
        if self.state == "nothing to do":
            return self.message
        if self.best_val_loss is not None:
            best = f"best val loss {self.best_val_loss:.4f} at step {self.best_val_step}"
        else:
            best = "no evaluation" if self.last_val_loss is None else "no finite val loss"
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint"
        if self.skipped:  # a run that applied few of its steps must not read as a clean one
            where += (f"; {self.skipped:,} of its {counted(self.steps, 'step')} not applied: "
                      f"a non-finite loss or gradient (train.skip_nonfinite)")
        run = f"{counted(self.steps, 'step')}, {self.tokens:,} tokens"
        if self.start_step:  # the run's totals; the seconds are this process's steps'
            here = self.steps - self.start_step
            return (f"{self.state}: {run}, {counted(here, 'step')} of them in "
                    f"{self.seconds:.1f} s from step {self.start_step:,}; {best}; {where}")
        return f"{self.state}: {run} in {self.seconds:.1f} s; {best}; {where}"


@dataclass
class Session:
    """What one training process holds while it runs: set up once, then advanced step by step."""

    cfg: Config
    device: torch.device
    dtype: torch.dtype
    run_dir: Path
    model: Andrea
    optimizer: torch.optim.Optimizer
    param_names: dict[int, str]
    train_split: TokenSplit
    val_split: TokenSplit
    log: MetricsLog
    signals: SignalWatch
    locks: TrainingLocks  # the run folder's lock (rank 0) and the data folders' it reads
    mfu: MfuMeter
    n_params: int  # the model's, for its FLOPs per token
    preset: str
    guard: SpikeGuard
    parallel: Parallel  # how the processes share the work
    step: int = 0
    tokens_seen: int = 0
    skipped: int = 0
    best_val: float | None = None
    best_step: int | None = None
    last_val: float | None = None
    checkpoint: Path | None = None  # the newest complete checkpoint of the run
    checkpoint_step: int | None = None
    losses: dict[int, float] = field(default_factory=dict)
    throughput: list[float] = field(default_factory=list)  # each step's tokens/s
    speed: Throughput = field(default_factory=Throughput)  # the run's one tokens/s
    # The (windows, length) shapes this process has stepped on: a step of a new one warms up.
    timed_shapes: set[tuple[int, int]] = field(default_factory=set)
    val_set: list[ValSource] | None = None  # the fixed val windows, made at the first eval
    schedule_anchor: dict[str, Any] | None = None  # the lr schedule re-planned on a resume
    warmup_accum: int = 0  # micro-batches per step during the batch-size warm-up (0: none)
    scaling: LossScaling = field(default_factory=LossScaling)  # fp16's loss scaling, or none
    precision_why: str = ""  # why the run computes in its dtype (train.precision auto: the device)
    # Muon's Newton-Schulz precision as it resolved (optim.muon_ns_precision); None: no Muon.
    ns_precision: str | None = None
    checkpoint_nbytes: int = 0  # one checkpoint's size on disk, estimated once by the set-up
    # Decided once a resumed checkpoint is restored (auto measures the memory it leaves):
    micro_batch: int = field(init=False)
    accum: int = field(init=False)
    train_model: nn.Module = field(init=False)  # the module the steps call (Parallel.wrap)

    @property
    def dist(self) -> DistInfo:  # the processes, as the parallel mode holds them
        return self.parallel.dist

    @property
    def tokens_per_micro_batch(self) -> int:  # over all ranks
        return self.micro_batch * self.cfg.model.block_size * self.dist.world_size

    @property
    def tokens_per_step(self) -> int:  # after any batch-size warm-up
        return self.tokens_per_micro_batch * self.accum

    @property
    def batch_warmup_steps(self) -> int:  # 0 when no warm-up applies
        return self.cfg.train.batch_warmup_steps if self.warmup_accum else 0

    @property
    def seq_warmup_steps(self) -> int:  # 0 when no sequence-length warm-up applies
        t = self.cfg.train
        return t.seq_warmup_steps if 0 < t.seq_warmup_length < self.cfg.model.block_size else 0

    def windows_at(self, step: int) -> tuple[int, int]:
        """(windows, tokens each) of one micro-batch of optimizer step `step` (0-based): during a
        sequence-length warm-up more, shorter windows of the same tokens in all."""
        block = self.cfg.model.block_size
        if step < self.seq_warmup_steps:
            length = self.cfg.train.seq_warmup_length
            return self.micro_batch * (block // length), length
        return self.micro_batch, block

    def accum_at(self, step: int) -> int:
        """Micro-batches per process for optimizer step `step` (0-based)."""
        return self.warmup_accum if step < self.batch_warmup_steps else self.accum

    def tokens_at(self, step: int) -> int:
        return self.tokens_per_micro_batch * self.accum_at(step)

    def flops_at(self, step: int) -> float:
        """Model FLOPs of optimizer step `step` (0-based) over all ranks, at its window length."""
        return self.tokens_at(step) * flops_per_token(self.cfg.model, self.n_params,
                                                      self.windows_at(step)[1])

    def tokens_through(self, steps: int) -> int:
        """Tokens of steps [0, steps) as this session plans them."""
        warm = min(steps, self.batch_warmup_steps)
        micro_batches = warm * self.warmup_accum + (steps - warm) * self.accum
        return micro_batches * self.tokens_per_micro_batch

    def say(self, text: str) -> None:
        if self.dist.is_main:
            print(text, flush=True)
