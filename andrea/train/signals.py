"""Ctrl-C and SIGTERM in `andrea train`: a stop during set-up, or after a micro-batch.

During set-up (data preparation, model build) the first stops it at once; during training it
asks the loop to stop after the current micro-batch; the second, of either kind, ends the
process at once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from andrea.train.rundir import read_latest

EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class SetUpInterrupted(KeyboardInterrupt):
    """A signal stopped the set-up. A KeyboardInterrupt, so what catches Ctrl-C (the data
    preparation keeps its complete shards for the next run) handles it the same way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalWatch:
    """During set-up, the first Ctrl-C / SIGTERM raises SetUpInterrupted where the set-up is.
    In training: finish the micro-batch, checkpoint the last completed step, exit.
    The second (either kind): exit at once, recording the end of the run in metrics.jsonl."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.elsewhere = False  # received by another rank of the run, not this process (adopt)
        self.setting_up = True  # the trainer clears it once the run is set up
        self._previous: dict[int, Any] = {}
        # Kept current by the trainer, so the messages name only what exists.
        self.completed_step = 0
        self.completed_tokens = 0
        self.checkpoint: Path | None = None
        self.metrics_path: Path | None = None

    def __enter__(self) -> SignalWatch:
        # Python delivers signals to the main thread alone and lets only it install handlers: a
        # training started from another thread (a sweep's worker thread, a web app's callback)
        # runs without the watch, as `andrea prepare` does (stop_on_signals).
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in EXIT_SIGNAL:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.received is not None and not self.elsewhere:
            latest = self.latest_checkpoint()
            where = (f"{latest} stays the latest checkpoint" if latest
                     else "no checkpoint was written")
            self.record_end(f"second signal ({name}): exited at once; {where}", name)
            os.write(2, f"\nsecond signal ({name}): exiting now; {where}\n".encode())
            os._exit(EXIT_SIGNAL.get(signal.Signals(signum), 130))
        # After another rank's signal (adopt) this one's own is its first: torchrun's agent
        # sends each worker the signal it got, not all at the same moment.
        self.received, self.elsewhere = signum, False
        if self.setting_up:
            os.write(2, f"\n{name}: stopping the set-up\n".encode())
            raise SetUpInterrupted(signum)
        # The step under way may still complete (a signal in its last micro-batch), so the
        # step to be checkpointed is named only once it is known, in the final line.
        os.write(2, f"\n{name}: stopping after this micro-batch and checkpointing the last "
                    f"completed step ({'Ctrl-C' if signum == signal.SIGINT else name} again "
                    f"to exit at once)\n".encode())

    def adopt(self, signum: int) -> None:
        """Under torchrun, a signal another rank received stops this one too (the step's
        reduction said so): the run ends as stopped by it here as well, not as finished. A
        signal of this process's own after it is still its first (_handle)."""
        if self.received is None:
            self.received, self.elsewhere = signum, True

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint the run's `latest` names, where this process writes the run (rank 0),
        else the last one the trainer saved: a signal can come after a checkpoint was published
        and before the trainer heard back (while the oldest is pruned), when `checkpoint` still
        names the one before it."""
        named = read_latest(self.metrics_path.parent) if self.metrics_path is not None else None
        return named or self.checkpoint

    def record_end(self, message: str, signal_name: str) -> None:
        # One O_APPEND write of a whole line: it cannot split a line the trainer is writing.
        if self.metrics_path is None:
            return
        record = {
            "event": "end", "step": self.completed_step, "tokens": self.completed_tokens,
            "state": "interrupted",
            "signal": signal_name, "message": message,
            "checkpoint": latest.name if (latest := self.latest_checkpoint()) else None,
            "time": round(time.time(), 3),
        }
        try:
            fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            pass
