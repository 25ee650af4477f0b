"""Optional TensorBoard logging (`train.tensorboard: true`), a second sink beside metrics.jsonl.

The trainer opens it once, passes every metrics record to `.log`, and closes it at the end.
TensorBoard is not a dependency: without the package, `open_tensorboard` says so in one line and
returns None, and training goes on with metrics.jsonl alone.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

# Record field -> TensorBoard tag, per event type. Steps are the records' optimizer steps.
TAGS: dict[str, dict[str, str]] = {
    "train": {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_s",
        "mfu": "train/mfu",
        "tokens": "train/tokens_seen",
    },
    "eval": {"val_loss": "val/loss", "val_bpb": "val/bits_per_byte"},
}


class TensorBoardWriter:
    """Writes the scalars of train and eval records into `<run_dir>/tensorboard/`."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def log(self, record: dict[str, Any]) -> None:
        tags = TAGS.get(record.get("event", ""))
        step = record.get("step")
        if not tags or not isinstance(step, int):
            return
        for key, tag in tags.items():
            value = record.get(key)
            # Missing values (mfu on a CPU is null) and NaN losses are left out, not drawn as 0.
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(
                value
            ):
                self._writer.add_scalar(tag, float(value), global_step=step)
        sources = record.get("val_sources")  # a mixture's: one curve per source
        for name, fields in (sources.items() if isinstance(sources, dict) else ()):
            loss = fields.get("loss") if isinstance(fields, dict) else None
            if isinstance(loss, float) and math.isfinite(loss):
                self._writer.add_scalar(f"val/source/{name}/loss", loss, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_tensorboard(run_dir: Path, enabled: bool) -> TensorBoardWriter | None:
    """A writer for `run_dir/tensorboard`, or None when disabled or TensorBoard is missing."""
    if not enabled:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as exc:  # ImportError, or a broken install (protobuf mismatches raise others)
        print(
            f"tensorboard: skipped, the package is not usable ({type(exc).__name__}: {exc}); "
            "pip install tensorboard to enable it",
            file=sys.stderr,
        )
        return None
    return TensorBoardWriter(SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard")))
