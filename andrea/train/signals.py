"""Ctrl-C and SIGTERM: the first asks the loop to stop after the current micro-batch,
the second ends the process at once."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class SignalWatch:
    """First Ctrl-C / SIGTERM: finish the micro-batch, checkpoint the last completed step, exit.
    Second Ctrl-C: exit at once, recording the end of the run in metrics.jsonl."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        # Kept current by the trainer, so the messages name only what exists.
        self.completed_step = 0
        self.checkpoint: Path | None = None
        self.metrics_path: Path | None = None

    def __enter__(self) -> SignalWatch:
        for sig in EXIT_SIGNAL:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None and signum == signal.SIGINT:
            where = (f"{self.checkpoint} stays the latest checkpoint" if self.checkpoint
                     else "no checkpoint was written")
            self._record_end(f"second interrupt: exited at once; {where}")
            os.write(2, f"\nsecond interrupt: exiting now; {where}\n".encode())
            os._exit(130)
        self.received = signum
        step = self.completed_step
        then = (f"checkpointing step {step}" if step else
                "no step has completed, so nothing will be checkpointed")
        os.write(2, f"\nstopping after this micro-batch, {then} "
                    f"(Ctrl-C again to exit at once)\n".encode())

    def _record_end(self, message: str) -> None:
        # One O_APPEND write of a whole line: it cannot split a line the trainer is writing.
        if self.metrics_path is None:
            return
        record = {
            "event": "end", "step": self.completed_step, "state": "interrupted",
            "signal": "SIGINT", "message": message,
            "checkpoint": self.checkpoint.name if self.checkpoint else None,
            "time": round(time.time(), 3),
        }
        try:
            fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass
