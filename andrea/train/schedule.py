"""Learning-rate schedules: linear warmup, then cosine decay, constant, or warmup-stable-decay."""

from __future__ import annotations

import math

from andrea.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate for optimizer step `step` (0-based) of cfg.max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
    # wsd: hold lr, then decay linearly to min_lr over the last decay_fraction of the run.
    decay_steps = max(1, round(cfg.decay_fraction * cfg.max_steps))
    decay_start = cfg.max_steps - decay_steps
    if step < decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return cfg.lr + progress * (cfg.min_lr - cfg.lr)
