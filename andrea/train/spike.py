"""The loss-spike guard (train.spike_guard): a step far out from the recent ones is not applied.

Each step's loss and (pre-clip) gradient norm are compared with the last spike_window applied
steps: z = (x - mean) / std, with std at least SPREAD_FLOOR of the mean, so a flat stretch of
loss does not make ordinary noise an outlier. Only upward outliers count (z > spike_z), and only
once the window is full and warm-up is over.

- skip: an outlier step is not applied (the optimizer does not step; its data is consumed).
  The spike_patience-th outlier in a row is taken as a lasting shift (skipping cannot undo a
  state the model is already in): it is applied and the window starts afresh, so a shift
  cannot stall the run.
- rollback: outliers are skipped as above; the spike_patience-th in a row rolls the run back
  to its newest checkpoint, cuts the learning rate by spike_lr_factor for spike_lr_steps steps
  and moves the data past the offending window (data position = step + data_offset).

A planned change of what a step trains on (the first step after a sequence-length warm-up, whose
longer windows reach positions the model has not trained) moves the loss and gradient norm by
design: the window starts afresh there (restart()), and the guard judges again once it is full.

Every decision is a metrics.jsonl event ("spike", "rollback"). The guard's state (window,
streak, data offset, lr cut) is plain JSON in the checkpoint's trainer state, so a resumed run
decides exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from andrea.config import TrainConfig

# The smallest spread the z-score assumes, as a fraction of the window's mean.
SPREAD_FLOOR = 0.01

APPLY, SKIP, ROLLBACK = "apply", "skip", "rollback"


@dataclass
class Verdict:
    action: str  # apply | skip | rollback
    loss_z: float = 0.0
    grad_z: float = 0.0
    outlier: bool = False


def z_score(x: float, window: list[float]) -> float:
    mean = sum(window) / len(window)
    var = sum((v - mean) ** 2 for v in window) / len(window)
    spread = max(math.sqrt(var), SPREAD_FLOOR * abs(mean), 1e-12)
    return (x - mean) / spread


class SpikeGuard:
    """Decides, step by step, whether a step's update is applied; see the module doc."""

    def __init__(self, cfg: TrainConfig, state: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        state = state or {}
        self.window: deque[tuple[float, float]] = deque(
            (tuple(pair) for pair in state.get("window", [])), maxlen=cfg.spike_window)
        self.streak: int = state.get("streak", 0)  # outliers in a row, up to this step
        self.data_offset: int = state.get("data_offset", 0)
        self.lr_cut_until: int = state.get("lr_cut_until", 0)  # steps below it: lr x factor
        self.spikes: int = state.get("spikes", 0)
        self.rollbacks: int = state.get("rollbacks", 0)

    @property
    def enabled(self) -> bool:
        return self.cfg.spike_guard != "off"

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": [list(pair) for pair in self.window], "streak": self.streak,
            "data_offset": self.data_offset, "lr_cut_until": self.lr_cut_until,
            "spikes": self.spikes, "rollbacks": self.rollbacks,
        }

    def data_step(self, step: int) -> int:
        """The data position of optimizer step `step` (0-based): past every skipped window."""
        return step + self.data_offset

    def lr_scale(self, step: int) -> float:
        return self.cfg.spike_lr_factor if step < self.lr_cut_until else 1.0

    def judge(self, step: int, loss: float, grad_norm: float) -> Verdict:
        """The verdict on completed step `step` (1-based), and the window updated for it.
        Every rank passes the same reduced loss and norm (the loss's all-reduce and the norm
        of the shared gradients give every rank the same bits), so every rank's guard reaches
        the same verdict without a vote."""
        full = len(self.window) == self.window.maxlen and step > self.cfg.warmup_steps
        if not self.enabled or not full or not (math.isfinite(loss) and math.isfinite(grad_norm)):
            if self.enabled and math.isfinite(loss) and math.isfinite(grad_norm):
                self.window.append((loss, grad_norm))
            return Verdict(APPLY)
        loss_z = z_score(loss, [w[0] for w in self.window])
        grad_z = z_score(grad_norm, [w[1] for w in self.window])
        if max(loss_z, grad_z) <= self.cfg.spike_z:
            self.streak = 0
            self.window.append((loss, grad_norm))
            return Verdict(APPLY, loss_z, grad_z)
        self.streak += 1
        self.spikes += 1
        if self.streak < self.cfg.spike_patience:
            return Verdict(SKIP, loss_z, grad_z, outlier=True)
        self.streak = 0
        if self.cfg.spike_guard == ROLLBACK:
            return Verdict(ROLLBACK, loss_z, grad_z, outlier=True)
        return Verdict(self.take_as_shift(loss, grad_norm), loss_z, grad_z, outlier=True)

    def take_as_shift(self, loss: float, grad_norm: float) -> str:
        """The spike_patience-th outlier in a row under skip, or under rollback with no
        checkpoint to go back to: a lasting shift, not a spike (skipping cannot undo a state the
        model is already in, and skipping on would stall the run), taken as the new level,
        measured anew from here. The step is applied."""
        self.window.clear()
        self.window.append((loss, grad_norm))
        return APPLY

    def restart(self) -> None:
        """Forget the window: the steps from here train on something else by plan, so the old
        level says nothing about them."""
        self.window.clear()
        self.streak = 0

    def rolled_back(self, from_step: int, to_step: int) -> None:
        """The run went back from completed step from_step to the checkpoint at to_step: its
        next steps read the data after from_step's, at a cut learning rate."""
        self.data_offset += from_step - to_step
        self.lr_cut_until = to_step + self.cfg.spike_lr_steps
        self.rollbacks += 1


def same_on_every_rank(value: float, device: torch.device, all_reduce_sum: Any,
                       dist: Any) -> bool:
    """Whether every rank holds the same value; the same answer on every rank (from the sums
    of the values and of their squares: W * sum(v^2) == sum(v)^2 only when all are equal)."""
    if not dist.enabled:
        return True
    sums = torch.tensor([value, value * value], dtype=torch.float64, device=device)
    total, squares = all_reduce_sum(sums, dist).tolist()
    return math.isclose(dist.world_size * squares, total * total, rel_tol=1e-12, abs_tol=1e-9)
