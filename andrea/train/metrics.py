"""metrics.jsonl: one JSON event per line, appended (and mirrored to TensorBoard)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """metrics.jsonl: one JSON object a line, appended and flushed as it happens (rank 0)."""

    def __init__(self, path: Path | None, tensorboard: Any = None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path is not None else None
        self.tensorboard = tensorboard

    def write(self, event: str, **fields: Any) -> None:
        if self.file is None:
            return
        record = {"event": event, **fields, "time": round(time.time(), 3)}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            self.tensorboard.log(record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
