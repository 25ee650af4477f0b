"""A training's output whose reader goes away (`andrea train ... | head`, a closed `tee`, a
terminal multiplexer gone): the output ends there, the training does not.

Python ignores SIGPIPE, so a write to a pipe nobody reads raises BrokenPipeError wherever it
happens: an eval line, the progress bar, the summary. Raised inside the step loop it ended the
run as failed, its last steps unsaved. Here the first such error points that stream's file
descriptor at /dev/null, so every later write (and Python's own flush at exit) is dropped
quietly; metrics.jsonl keeps every figure the lines said.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


class SurvivesClosedReader:
    """`stream`, writing as before until its reader is gone, then to /dev/null."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        with contextlib.suppress(OSError):  # what was buffered for the pipe goes there too
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding...: the stream's own
        return getattr(self._stream, name)


@contextlib.contextmanager
def output_survives_closed_reader() -> Iterator[None]:
    """sys.stdout and sys.stderr as SurvivesClosedReader for the block (the objects are put
    back after; a stream already pointed at /dev/null stays so)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = SurvivesClosedReader(sys.stdout), SurvivesClosedReader(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
