"""Loss scaling: what train.precision fp16 adds to a step, and nothing for bf16 or fp32.

fp16's smallest normal number is 6e-5, so small gradients of an unscaled loss flush to zero
in the half-precision backward. Dynamic loss scaling (torch.amp.GradScaler) multiplies the loss
by a large scale S before backward and divides the gradients by S before anything reads them
(the clip, the spike guard, Muon's orthogonalisation, the optimizer). When the scaled gradients
overflow (any inf or NaN among them, the loss itself finite), the step is not applied and S is
halved; after GROWTH_INTERVAL steps in a row without an overflow S doubles.

As in torch's AMP recipe, an overflow step still counts: the step counter, the learning-rate
schedule and the data move on, as they do for a step the spike guard holds back. The step is
counted as an overflow (metrics.jsonl "overflow" events, the progress line, `andrea runs`) and is
no spike to the guard (its gradient norm is not finite, which the guard ignores).

One GradScaler serves one process, ddp and fsdp alike: ddp's gradients are the same on every
rank once all-reduced, and under FSDP2 they are DTensors, whose inf check torch reduces over
the mesh (a max over the ranks: torch/distributed/tensor/_dispatch.py, found_inf_reduce_handler),
so every rank skips the same steps. The old ShardedGradScaler is for FSDP1's flat parameters.

The loop calls, once per step: `scale` on the loss before backward, `unscale` before the clip,
`step` (the optimizer step when the step is applied, then the scale's update). The scaler's
state is in the checkpoint (`state_dict`, TrainerState.loss_scaling), so a resume is exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# GradScaler's defaults, written out because the checkpoint records them.
INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
# Below this the scale cannot rescue fp16's range any more: every step would overflow.
MIN_SCALE = 1.0


class LossScaling:
    """No loss scaling (bf16, fp32): the loss and the gradients pass as they are."""

    enabled = False

    def __init__(self) -> None:
        self.overflows = 0  # steps skipped because their gradients overflowed

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale(self, optimizer: Any) -> None:
        """Divide the step's gradients by the scale (before the clip reads them)."""

    def overflowed(self, loss: float, grad_norm: float) -> bool:
        """Whether the step's gradients overflowed the scale: the loss is finite, they are not
        (after unscale, the global norm is finite exactly when every gradient is)."""
        return False

    def step(self, optimizer: Any, apply: bool) -> None:
        """The optimizer step if `apply`; then the scale's update for this step."""
        if apply:
            optimizer.step()

    @property
    def value(self) -> float | None:
        """The scale now; None without scaling."""
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's state (None: a checkpoint without scaling: start afresh)."""


class DynamicLossScaling(LossScaling):
    """torch.amp.GradScaler, driven per part of a CombinedOptimizer (Muon's and AdamW's
    gradients unscaled before Muon orthogonalises them)."""

    enabled = True

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE,
                                           growth_interval=GROWTH_INTERVAL)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: Any) -> None:
        for part in parts(optimizer):
            self.scaler.unscale_(part)

    def overflowed(self, loss: float, grad_norm: float) -> bool:
        return math.isfinite(loss) and not math.isfinite(grad_norm)

    def step(self, optimizer: Any, apply: bool) -> None:
        if apply:
            for part in parts(optimizer):
                self.scaler.step(part)  # itself skips a part whose gradients overflowed
        self.scaler.update()

    @property
    def value(self) -> float:
        return self.scaler.get_scale()

    def state_dict(self) -> dict[str, Any]:
        return {**self.scaler.state_dict(), "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        state = dict(state)
        self.overflows = state.pop("overflows", 0)
        self.scaler.load_state_dict(state)


def loss_scaling_for(dtype: torch.dtype, device: torch.device) -> LossScaling:
    """Dynamic loss scaling under fp16; none otherwise."""
    return DynamicLossScaling(device) if dtype == torch.float16 else LossScaling()


def parts(optimizer: Any) -> tuple[Any, ...]:
    """The torch optimizers a (possibly combined, andrea/train/optim.py) optimizer drives."""
    return getattr(optimizer, "optimizers", (optimizer,))
