"""Optional TensorBoard logging (`train.tensorboard: true`), a sink beside metrics.jsonl.

The trainer opens it once; MetricsLog passes it every record (`.log`: the scalars that
`train.metrics.scalars` finds in it, the same W&B gets) and closes it at the end.
TensorBoard is not a dependency: without the package, `open_tensorboard` says so in one line and
returns None, and training goes on with metrics.jsonl alone.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from andrea.train.metrics import scalars


class TensorBoardWriter:
    """Writes the scalars of each record (train.metrics.scalars) into `<run_dir>/tensorboard/`."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer

    def log(self, record: dict[str, Any]) -> None:
        found = scalars(record)
        for tag, value in (found[1].items() if found else ()):
            self._writer.add_scalar(tag, value, global_step=found[0])

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
