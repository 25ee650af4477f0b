"""Learning-rate schedules: linear warmup, then cosine decay, constant, or warmup-stable-decay.

A resume that changes max_steps re-plans the rest of the schedule from the learning rate the
next step would have had (the anchor, kept in the checkpoint's trainer state), so the lr never
jumps: cosine decays from there to min_lr over the remaining steps; wsd still in its constant
phase simply holds longer (its decay moves to the new end), else decays linearly from there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from andrea.config import TrainConfig
from andrea.errors import UserError

# A change of the next step's lr on resume beyond this fraction is said in one line.
JUMP_TOLERANCE = 0.10


def wsd_decay_steps(cfg: TrainConfig) -> int:
    """wsd: the last steps of cfg.max_steps over which the lr decays to min_lr."""
    return max(1, round(cfg.decay_fraction * cfg.max_steps))


def lr_at(step: int, cfg: TrainConfig, anchor: dict[str, Any] | None = None) -> float:
    """The learning rate for optimizer step `step` (0-based) of cfg.max_steps; `anchor`
    ({"step", "lr"}): the schedule re-planned on a resume that changed max_steps."""
    if anchor is not None:
        return _replanned(step, cfg, anchor["step"], anchor["lr"])
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
    # wsd: hold lr, then decay linearly to min_lr over the last decay_fraction of the run.
    decay_steps = wsd_decay_steps(cfg)
    decay_start = cfg.max_steps - decay_steps
    if step < decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return cfg.lr + progress * (cfg.min_lr - cfg.lr)


def _replanned(step: int, cfg: TrainConfig, start: int, start_lr: float) -> float:
    remaining = max(1, cfg.max_steps - start)
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = min(1.0, max(0.0, (step - start) / remaining))
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (start_lr - cfg.min_lr)
    decay_start = cfg.max_steps - wsd_decay_steps(cfg)
    if start_lr >= cfg.lr and start <= decay_start:  # still holding: the plain wsd, extended
        return lr_at(step, cfg)
    progress = min(1.0, max(0.0, (step - start + 1) / remaining))
    return start_lr + progress * (cfg.min_lr - start_lr)


def replan(
    step: int, cfg: TrainConfig, old_max_steps: int, anchor: dict[str, Any] | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """On a resume at `step` (steps done): the anchor to train on with cfg.max_steps, and the
    lines that say so. Unchanged max_steps or a run still in warm-up: the plan as it was."""
    if old_max_steps == cfg.max_steps or (anchor is None and step < cfg.warmup_steps):
        return anchor, []
    was = dataclasses.replace(cfg, max_steps=old_max_steps)
    planned = lr_at(step, was, anchor)
    if planned <= 0 and cfg.max_steps > step:
        # A run that decayed to min_lr 0 (the wsd preset's way) would train on at lr 0.
        hint = ""
        if cfg.schedule == "wsd" and anchor is None:
            # the last checkpoint whose next step still had the peak lr
            stable = old_max_steps - wsd_decay_steps(was) - 1
            hint = (f"resume from a checkpoint written before its decay began (step {stable} "
                    "or earlier) if one is kept, or ")
        raise UserError(
            f"resume: train.max_steps {old_max_steps} -> {cfg.max_steps}: the run had decayed to "
            f"lr 0 by step {step}, so the steps after it would not train; {hint}start a new run "
            f"with train.max_steps {cfg.max_steps}")
    new_anchor = {"step": step, "lr": planned}
    lines = [
        f"resume: train.max_steps {old_max_steps} -> {cfg.max_steps}: the {cfg.schedule} "
        f"schedule continues from lr {planned:.3g} at step {step} over the remaining "
        f"{max(0, cfg.max_steps - step)} steps (docs/training.md)"
    ]
    now = lr_at(step, cfg, new_anchor)
    if planned > 0 and abs(now - planned) / planned > JUMP_TOLERANCE:
        lines.append(f"resume: the learning rate jumps from {planned:.3g} to {now:.3g} at "
                     f"step {step}")
    return new_anchor, lines
