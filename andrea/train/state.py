"""What a checkpoint records besides its tensors: `TrainerState`, stored as trainer_state.json.

`to_dict` writes the file's keys in the order they have always had; `from_dict` is the one
place that knows what checkpoints of earlier releases lack and what a missing key means:

- the first releases wrote step, tokens, data_position, best_val_loss, best_val_step,
  skipped_steps, world_size, seed and preset;
- micro_batch_size came with `micro_batch_size: auto` (missing: nothing recorded to reuse);
- parallel with train.parallel (missing: None, which train.parallel.mode_before_recorded
  reads as the one mode there was then);
- tokens_per_step and device with the one-resume-decision change (missing: one micro-batch
  per process, and the device the run resumes on);
- max_steps, schedule_anchor and spike_guard with the spike guard (missing: the max_steps of
  the run's config, the plain schedule, a fresh guard);
- loss_scaling with train.precision fp16 (missing, or null for bf16 and fp32: a fresh scale).

An imported run (`andrea import`) records where its weights came from instead of the training
fields it has not used yet.

No torch here: `andrea runs` reads trainer states without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The keys written since the first release; the later ones follow in to_dict.
_FIRST_KEYS = ("step", "tokens", "data_position", "best_val_loss", "best_val_step",
               "skipped_steps", "world_size", "seed", "preset")


@dataclass
class TrainerState:
    """The run's counters and the records a resume decides by. A field that is None was
    not recorded (an older checkpoint); its docstring line says what that means."""

    step: int
    tokens: int = 0
    data_position: int = 0  # the data step the next step draws from, past skipped windows
    best_val_loss: float | None = None
    best_val_step: int | None = None
    skipped_steps: int = 0
    world_size: int = 1
    seed: int = 0
    preset: str | None = None
    micro_batch_size: int | None = None  # None: the checkpoint predates its record
    parallel: str | None = None  # Parallel.name of the mode that wrote it; None: not recorded
    tokens_per_step: int | None = None  # None: one micro-batch per process (older runs)
    device: str | None = None  # None: taken to be the device the run resumes on
    max_steps: int | None = None  # the max_steps planned for; None: the run's config's
    schedule_anchor: dict[str, Any] | None = None  # the lr schedule as re-planned on a resume
    spike_guard: dict[str, Any] | None = None  # SpikeGuard.state_dict(); None: a fresh guard
    loss_scaling: dict[str, Any] | None = None  # fp16's scaler state; None: none or a fresh one
    imported_from: str | None = None  # an imported run: the folder its weights came from
    imported_sha256: str | None = None  # and the digest of its weights file

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainerState:
        """A trainer_state.json of any release (a KeyError without a step: not one)."""
        return cls(
            step=raw["step"], tokens=raw.get("tokens", 0),
            data_position=raw.get("data_position", raw["step"]),
            best_val_loss=raw.get("best_val_loss"), best_val_step=raw.get("best_val_step"),
            skipped_steps=raw.get("skipped_steps", 0), world_size=raw.get("world_size", 1),
            seed=raw.get("seed", 0), preset=raw.get("preset"),
            micro_batch_size=raw.get("micro_batch_size"),
            parallel=raw.get("parallel"),
            tokens_per_step=raw.get("tokens_per_step"), device=raw.get("device"),
            max_steps=raw.get("max_steps"), schedule_anchor=raw.get("schedule_anchor"),
            spike_guard=raw.get("spike_guard"), loss_scaling=raw.get("loss_scaling"),
            imported_from=raw.get("imported_from"),
            imported_sha256=raw.get("imported_sha256"),
        )

    def to_dict(self) -> dict[str, Any]:
        """trainer_state.json's content: a trained run's sixteen keys (and loss_scaling under
        fp16 only, so other runs' files stay as they were), or an import's first
        keys and its source."""
        out = {key: getattr(self, key) for key in _FIRST_KEYS}
        if self.imported_from is not None:
            return {**out, "imported_from": self.imported_from,
                    "imported_sha256": self.imported_sha256}
        return {
            **out, "micro_batch_size": self.micro_batch_size, "parallel": self.parallel,
            "tokens_per_step": self.tokens_per_step, "device": self.device,
            "max_steps": self.max_steps, "schedule_anchor": self.schedule_anchor,
            "spike_guard": self.spike_guard,
            **({} if self.loss_scaling is None else {"loss_scaling": self.loss_scaling}),
        }

    def recorded_micro_batch(self, world_size: int, device: str) -> int | None:
        """The micro-batch `auto` chose, when it still applies: on as many processes (another
        count changes the sequences per process, which it must divide) and the same device
        (another has other memory)."""
        same_device = self.device is None or self.device == device
        if self.micro_batch_size is None or self.world_size != world_size or not same_device:
            return None
        return self.micro_batch_size

    def recorded_tokens_per_step(self, block_size: int) -> int | None:
        """The tokens per step the run trained with (older runs: one micro-batch per
        process, all that global_batch_tokens: 0 allowed then); None if not recorded."""
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        if self.micro_batch_size is None:
            return None
        return self.micro_batch_size * block_size * self.world_size
