"""The progress bar of `andrea train`: tokens, rate, and a remaining time a person can read."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from andrea.resources import cpu_name
from andrea.train.device import device_name

DAY = 86_400.0
# From this remaining time on, the bar says days instead of H:MM:SS (13317:40:36 says little).
LONG_RUN = 2 * DAY


def format_eta(seconds: float) -> str:
    """'1:02:03' below two days, '555 days' from there on."""
    if seconds >= LONG_RUN:
        return f"{seconds / DAY:,.0f} days"
    return tqdm.format_interval(seconds)


class PlanNote:
    """One line, once the first micro-batches are timed, when the rest of the plan would take
    more than a day at their pace: how long, on what, and what to run instead. The first
    micro-batch (allocations, a compile) is left out; the next TIMED set the pace, so a plan of
    years is told within a few micro-batches, not after steps that may take hours each.
    `quiet` (no bar, --no-progress): a plan of QUIET_PLAN or more is said too, since nothing
    else is printed until the first val loss or the end, an hour away for one step of
    andrea-120m on a CPU."""

    TIMED = 2
    QUIET_PLAN = 600.0  # seconds

    def __init__(self, tokens_left: int, machine: str, instead: str, quiet: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.tokens_left, self.machine, self.instead = tokens_left, machine, instead
        self.quiet = quiet
        self.clock = clock
        self.start: float | None = None
        self.timed = 0
        self.tokens = 0
        self.said = False

    def after_micro_batch(self, tokens: int) -> str | None:
        """Call after each micro-batch of `tokens` (over every rank): the line, at most once."""
        now = self.clock()
        self.tokens_left -= tokens
        if self.said:
            return None
        if self.start is None:
            self.start = now
            return None
        self.timed, self.tokens = self.timed + 1, self.tokens + tokens
        if self.timed < self.TIMED or now <= self.start:
            return None
        self.said = True
        rate = self.tokens / (now - self.start)
        seconds = self.tokens_left / rate
        days = seconds / DAY
        if days > 1:
            return (f"note: this plan needs about {days:,.{0 if days >= 10 else 1}f} days on "
                    f"this machine ({self.machine}, {rate:,.0f} tokens/s); {self.instead}")
        if self.quiet and seconds >= self.QUIET_PLAN:
            return (f"note: the rest of this plan needs about {format_eta(seconds)} on this "
                    f"machine ({self.machine}, {rate:,.0f} tokens/s); without the bar "
                    "(--no-progress), the next line on progress is the first val loss or the "
                    "end")
        return None


# andrea-12m's parameters: the preset the README trains on a CPU, in minutes.
CPU_PRESET, CPU_PRESET_PARAMS = "andrea-12m", 12_292_992


def plan_note_for(tokens_left: int, device: torch.device, world_size: int,
                  n_params: int, quiet: bool = False) -> PlanNote:
    """The PlanNote of a run on `device` x world_size: the machine named as a benchmark names
    it, and what to run instead there (a model larger than andrea-12m on a CPU: that preset);
    `quiet`: the run shows no bar."""
    if device.type == "cpu":
        threads = torch.get_num_threads()
        machine = f"{cpu_name()}, {threads} thread{'s' if threads > 1 else ''}"
        if world_size > 1:
            machine = f"{world_size} processes on {machine}"
        instead = (f"on a CPU train {CPU_PRESET}, as the README does: andrea train --config "
                   f"{CPU_PRESET}.yaml; or lower train.max_steps for a trial of this plan"
                   if n_params > 2 * CPU_PRESET_PARAMS else
                   "lower train.max_steps or train.global_batch_tokens, or train on a GPU")
    else:
        machine = f"{world_size} x {device_name(device)}"
        instead = ("lower train.max_steps or train.global_batch_tokens, or add GPUs (torchrun "
                   "--nproc_per_node, --nnodes)")
    return PlanNote(tokens_left, machine, instead, quiet)


class RunBar(tqdm):
    """tqdm, with the remaining time in days once it passes two days, and as its rate the run's
    tokens/s (train.metrics.Throughput, given by `set_rate` after each step) instead of tqdm's
    own smoothed one, so the bar's last state says what the end record and `andrea runs` say.
    `plan_note` (rank 0's): said above the bar, disabled or not."""

    run_rate: float | None = None
    plan_note: PlanNote | None = None

    def update(self, n: float = 1) -> bool | None:
        line = self.plan_note.after_micro_batch(int(n)) if self.plan_note else None
        if line:
            self.write(line, file=sys.stderr)
        return super().update(n)

    def set_rate(self, tokens_per_s: float | None) -> None:
        self.run_rate = tokens_per_s

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        if self.run_rate:
            d["rate"] = self.run_rate
        return d

    @staticmethod
    def format_meter(n: float, total: float, elapsed: float, **kw: Any) -> str:
        rate = kw.get("rate") or ((n - kw.get("initial", 0)) / elapsed if elapsed else None)
        if total and rate and (total - n) / rate >= LONG_RUN:
            eta = format_eta((total - n) / rate)
            kw["bar_format"] = ("{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<" + eta
                                + ", {rate_fmt}{postfix}]")
        return tqdm.format_meter(n, total, elapsed, **kw)
