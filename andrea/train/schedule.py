"""Learning-rate schedules: linear warmup, then cosine decay, constant, or warmup-stable-decay.

The schedule is a multiplier on every parameter group's peak lr (optim.py records each group's
peak when the optimizer is built: train.lr for AdamW's, train.muon_lr for Muon's). It is
computed as the lr it gives the reference peak, train.lr (see `Multiplier` for why).

A resume that changes max_steps re-plans the rest of the schedule from the learning rate the
next step would have had (the anchor, kept in the checkpoint's trainer state as {"step", "lr"},
the reference lr), so the lr never jumps: cosine decays from there to min_lr over the remaining
steps; wsd still in its constant phase simply holds longer (its decay moves to the new end), else
decays linearly from there. A re-planned decay is the fresh decay started from the anchor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from andrea.config import TrainConfig
from andrea.errors import UserError, counted
from andrea.train.rundir import step_dir_name

# A change of the next step's lr on resume beyond this fraction is said in one line.
JUMP_TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class Multiplier:
    """The schedule's factor on a group's peak lr at one step, held as the lr it gives the
    reference peak (`lr` at `reference`, train.lr) rather than as a rounded quotient.

    A group's lr is `lr * (peak / reference)`: for the reference group (AdamW's) the ratio is
    exactly 1, so its lr is the schedule's formula to the last bit; for Muon's it is the product
    every run has been trained with. (peak * (lr / reference) would move some last bits, and
    with them the losses.)"""

    lr: float
    reference: float

    def cut(self, factor: float) -> Multiplier:
        """This multiplier times `factor` (the spike guard's lr cut)."""
        return Multiplier(self.lr * factor, self.reference)

    def lr_for(self, peak: float) -> float:
        """The lr of a group whose peak lr is `peak`."""
        return self.lr * (peak / self.reference)


def wsd_decay_steps(cfg: TrainConfig) -> int:
    """wsd: the last steps of cfg.max_steps over which the lr decays to min_lr."""
    return max(1, round(cfg.decay_fraction * cfg.max_steps))


def multiplier(step: int, cfg: TrainConfig, anchor: dict[str, Any] | None = None) -> Multiplier:
    """The schedule at optimizer step `step` (0-based) of cfg.max_steps; `anchor`
    ({"step", "lr"}): the schedule re-planned on a resume that changed max_steps."""
    return Multiplier(_reference_lr(step, cfg, anchor), cfg.lr)


def _reference_lr(step: int, cfg: TrainConfig, anchor: dict[str, Any] | None) -> float:
    """The lr the schedule gives the reference peak cfg.lr at `step`."""
    if anchor is not None and not _still_holding(cfg, anchor):
        if cfg.schedule == "constant":
            return cfg.lr
        return _decay(step, cfg, anchor["step"], anchor["lr"])
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    # cosine decays from the end of warm-up; wsd holds the peak until its last decay steps
    start = cfg.warmup_steps if cfg.schedule == "cosine" else cfg.max_steps - wsd_decay_steps(cfg)
    if step < start:
        return cfg.lr
    return _decay(step, cfg, start, cfg.lr)


def _still_holding(cfg: TrainConfig, anchor: dict[str, Any]) -> bool:
    """A wsd run re-planned before its decay began: the plain wsd over the new length."""
    decay_start = cfg.max_steps - wsd_decay_steps(cfg)
    return cfg.schedule == "wsd" and anchor["lr"] >= cfg.lr and anchor["step"] <= decay_start


def _decay(step: int, cfg: TrainConfig, start: int, top: float) -> float:
    """From `top` at step `start` down to min_lr at cfg.max_steps: a cosine, or (wsd) a line
    whose first step is already one decay step below `top`."""
    length = max(1, cfg.max_steps - start)
    if cfg.schedule == "cosine":
        progress = min(1.0, max(0.0, (step - start) / length))
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (top - cfg.min_lr)
    progress = min(1.0, max(0.0, (step - start + 1) / length))
    return top + progress * (cfg.min_lr - top)


def replan(
    step: int, cfg: TrainConfig, old_max_steps: int, anchor: dict[str, Any] | None,
    kept: Sequence[int] = (),
) -> tuple[dict[str, Any] | None, list[str]]:
    """On a resume at `step` (steps done): the anchor to train on with cfg.max_steps, and the
    lines that say so. Unchanged max_steps or a run still in warm-up: the plan as it was.
    `kept`: the steps of the run's checkpoints, named when the resume is refused."""
    if old_max_steps == cfg.max_steps or (anchor is None and step < cfg.warmup_steps):
        return anchor, []
    was = dataclasses.replace(cfg, max_steps=old_max_steps)
    planned = _reference_lr(step, was, anchor)
    if planned <= 0 and cfg.max_steps > step:
        # A run that decayed to min_lr 0 (the wsd preset's way) would train on at lr 0. Any
        # earlier checkpoint whose next step still had an lr can be extended instead.
        earlier = [k for k in sorted(kept, reverse=True)
                   if k < step and _reference_lr(k, was, anchor) > 0][:3]
        held = (f"kept here: {', '.join(step_dir_name(k) for k in earlier)}" if earlier
                else "this run keeps none now")
        if cfg.schedule == "wsd" and anchor is None:
            # the last checkpoint whose next step still had the peak lr
            stable = old_max_steps - wsd_decay_steps(was) - 1
            held += (f"; one of step {stable} or earlier holds the peak lr longer and decays "
                     "over the new end")
        raise UserError(
            f"resume: train.max_steps {old_max_steps} -> {cfg.max_steps}: the run had decayed to "
            f"lr 0 by step {step}, so the steps after it would not train; resume from an "
            f"earlier checkpoint ({held}), or start a new run with train.max_steps "
            f"{cfg.max_steps}")
    new_anchor = {"step": step, "lr": planned}
    lines = [
        f"resume: train.max_steps {old_max_steps} -> {cfg.max_steps}: the {cfg.schedule} "
        f"schedule continues from lr {planned:.3g} at step {step} over the remaining "
        f"{counted(max(0, cfg.max_steps - step), 'step')} (docs/training.md)"
    ]
    now = _reference_lr(step, cfg, new_anchor)
    if planned > 0 and abs(now - planned) / planned > JUMP_TOLERANCE:
        lines.append(f"resume: the learning rate jumps from {planned:.3g} to {now:.3g} at "
                     f"step {step}")
    return new_anchor, lines
