"""Faults the tests inject into a real run: one environment variable, read once at start-up.

ANDREA_FAULTS holds comma-separated items, each KIND@WHERE; at most one item per kind:

- ``nan@STEP``: step STEP's loss (1-based, after the clip) becomes NaN.
- ``overflow@STEP``: rank 0's backward of step STEP (1-based) overflows: its loss is multiplied
  by infinity before backward, so every gradient (after ddp's all-reduce or fsdp's
  reduce-scatter, every rank's) is inf or NaN while the loss stays finite, as in an fp16
  overflow.
- ``sigint@STEP.MICRO``: SIGINT to this process after micro-batch MICRO (0-based) of the step
  that follows STEP completed steps, as if Ctrl-C came then (``sigint@3.1``: step 4's second).
- ``spike@FIRST[-LAST][xSCALE]``: the batches of data positions FIRST..LAST (1-based, as steps
  are counted) become random tokens and their loss is scaled by SCALE (default 1) before
  backward: bad data and a gradient blow-up at a chosen place.
- ``kill-rank@RANK:step-NNNNNN``: rank RANK SIGKILLs itself once its shards of that checkpoint
  are written, the checkpoint not yet complete.
- ``kill-after@RANK:step-NNNNNN``: rank RANK SIGKILLs itself once that checkpoint is complete
  (renamed into place and `latest` naming it), as a worker lost between checkpoints; only the
  process that wrote it, so a run restarted from it goes on.
- ``checkpoint-delay@SECONDS``: a checkpoint write sleeps SECONDS after its model file, so a
  test can kill the process while the checkpoint is half written.
- ``prepare-pause@SHARD[:UNTIL_FILE]``: `andrea prepare` stops mid-shard in the shard file
  SHARD (``train_000002.bin``), saying ``paused in SHARD`` on stderr, until UNTIL_FILE exists
  (forever without one), for a SIGKILL or a second process to act on.
- ``disk-full@AREA:NAME``: the write NAME of AREA fails as on a full disk (OSError ENOSPC), for
  a machine where no small filesystem can be mounted: ``checkpoint:step-000004`` (that
  checkpoint, after its model file is written), ``prepare:train_000003.bin`` (that shard file).
- ``sigterm@STEP.MICRO``, ``sigkill@STEP.MICRO``: as sigint@, with SIGTERM (a scheduler's stop)
  or SIGKILL (``kill -9``: nothing runs after it) at that micro-batch.

Example: ``ANDREA_FAULTS=nan@7,checkpoint-delay@2``. The CLI parses the variable once
(`installed_from_environment`, for the command's length); a malformed item is a one-line error
naming it. Unset, every hook is a no-op behind one attribute check. In-process tests call
`install` directly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from andrea.errors import UserError

VARIABLE = "ANDREA_FAULTS"


@dataclass(frozen=True)
class Faults:
    """The parsed variable: None (or 0) for a fault not asked for."""

    nan_at_step: int | None = None
    overflow_at_step: int | None = None
    sigint_after: tuple[int, int] | None = None  # (completed steps, micro-batch)
    spike: tuple[int, int, float] | None = None  # (first, last, scale)
    kill_rank: tuple[int, str] | None = None  # (rank, step folder name)
    kill_after: tuple[int, str] | None = None  # (rank, step folder name)
    checkpoint_delay: float = 0.0
    prepare_pause: tuple[str, str | None] | None = None  # (shard file, until file)
    disk_full: str | None = None  # "AREA:NAME", the write that fails
    sigterm_after: tuple[int, int] | None = None  # as sigint_after
    sigkill_after: tuple[int, int] | None = None  # as sigint_after


def _nan(where: str) -> tuple[str, Any]:
    return "nan_at_step", int(where)


def _overflow(where: str) -> tuple[str, Any]:
    return "overflow_at_step", int(where)


def _sigint(where: str) -> tuple[str, Any]:
    step, dot, micro = where.partition(".")
    if not dot:
        raise ValueError(where)
    return "sigint_after", (int(step), int(micro))


def _spike(where: str) -> tuple[str, Any]:
    span, _, scale = where.partition("x")
    first, _, last = span.partition("-")
    return "spike", (int(first), int(last or first), float(scale or 1.0))


def _kill_rank(where: str) -> tuple[str, Any]:
    rank, colon, folder = where.partition(":")
    if not colon or not folder.startswith("step-"):
        raise ValueError(where)
    return "kill_rank", (int(rank), folder)


def _kill_after(where: str) -> tuple[str, Any]:
    return "kill_after", _kill_rank(where)[1]


def _checkpoint_delay(where: str) -> tuple[str, Any]:
    return "checkpoint_delay", float(where)


def _prepare_pause(where: str) -> tuple[str, Any]:
    shard, _, until = where.partition(":")  # the shard's name has no colon; a path may
    if not shard:
        raise ValueError(where)
    return "prepare_pause", (shard, until or None)


def _sigterm(where: str) -> tuple[str, Any]:
    return "sigterm_after", _sigint(where)[1]


def _sigkill(where: str) -> tuple[str, Any]:
    return "sigkill_after", _sigint(where)[1]


def _disk_full(where: str) -> tuple[str, Any]:
    area, colon, name = where.partition(":")
    if not colon or not area or not name:
        raise ValueError(where)
    return "disk_full", where


# kind -> (its spelling, its parser)
KINDS = {
    "nan": ("nan@STEP", _nan),
    "sigint": ("sigint@STEP.MICRO", _sigint),
    "spike": ("spike@FIRST[-LAST][xSCALE]", _spike),
    "kill-rank": ("kill-rank@RANK:step-NNNNNN", _kill_rank),
    "kill-after": ("kill-after@RANK:step-NNNNNN", _kill_after),
    "checkpoint-delay": ("checkpoint-delay@SECONDS", _checkpoint_delay),
    "prepare-pause": ("prepare-pause@SHARD[:UNTIL_FILE]", _prepare_pause),
    "disk-full": ("disk-full@AREA:NAME", _disk_full),
    "overflow": ("overflow@STEP", _overflow),
    "sigterm": ("sigterm@STEP.MICRO", _sigterm),
    "sigkill": ("sigkill@STEP.MICRO", _sigkill),
}


def parse(spec: str) -> Faults:
    """The faults `spec` (ANDREA_FAULTS's spelling) asks for; UserError names a bad item."""
    faults, seen = Faults(), set()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, at, where = item.partition("@")
        if kind not in KINDS or not at:
            raise UserError(
                f"{VARIABLE}: unknown fault {item!r}; the kinds are "
                f"{', '.join(s for s, _ in KINDS.values())} (or unset {VARIABLE})"
            )
        spelling, parser = KINDS[kind]
        if kind in seen:
            raise UserError(f"{VARIABLE}: {kind} is given twice; keep one {spelling}")
        try:
            field, value = parser(where)
        except ValueError:
            raise UserError(f"{VARIABLE}: {item!r} is not {spelling}") from None
        faults, seen = replace(faults, **{field: value}), seen | {kind}
    return faults


_active = Faults()


def install(spec: str | None) -> None:
    """Make `spec`'s faults the ones the hooks fire (none for None or "")."""
    global _active
    _active = parse(spec) if spec else Faults()


@contextlib.contextmanager
def installed_from_environment() -> Iterator[None]:
    """Read ANDREA_FAULTS once, at start-up: the hooks never read the environment. The faults
    installed before come back at the end, so a command run in a process that goes on (a test
    calling the CLI's main) leaves none behind."""
    global _active
    previous = _active
    try:
        install(os.environ.get(VARIABLE))
        yield
    finally:
        _active = previous


def after_micro_batch(step: int, micro: int) -> None:
    """sigint@, sigterm@, sigkill@: that signal as if it came during this micro-batch."""
    at = (step, micro)
    for sig, asked in ((signal.SIGINT, _active.sigint_after),
                       (signal.SIGTERM, _active.sigterm_after),
                       (signal.SIGKILL, _active.sigkill_after)):
        if asked == at:
            os.kill(os.getpid(), sig)


def poison_loss(loss: Any, step: int) -> Any:
    """nan@: step `step`'s (1-based) loss made NaN; otherwise the loss itself."""
    return loss * float("nan") if _active.nan_at_step == step else loss


def overflow_factor(step: int, rank: int) -> float:
    """overflow@: what the loss of step `step` (1-based) is multiplied by before backward on
    `rank`: infinity where the fault fires, else 1."""
    return float("inf") if rank == 0 and _active.overflow_at_step == step else 1.0


def spike_scale(data_step: int) -> float | None:
    """spike@: the loss scale for a garbled batch at this data position (0-based), or None."""
    spike = _active.spike
    if spike is not None and spike[0] <= data_step + 1 <= spike[1]:
        return spike[2]
    return None


def garble(x: Any, y: Any, vocab_size: int, data_step: int) -> tuple[Any, Any]:
    """spike@'s batch in place of (x, y): uniform random tokens, the same on every run."""
    import torch  # only a run with a spike gets here; the CLI starts without torch

    gen = torch.Generator().manual_seed(data_step)
    tokens = torch.randint(0, vocab_size, (x.shape[0], x.shape[1] + 1), generator=gen)
    return tokens[:, :-1].to(x.device), tokens[:, 1:].to(y.device)


def after_shards_written(rank: int, step_folder: str) -> None:
    """kill-rank@: this rank dies here, its shards of checkpoint `step_folder` written."""
    if _active.kill_rank == (rank, step_folder):
        os.kill(os.getpid(), signal.SIGKILL)


def after_checkpoint(rank: int, folder: str) -> None:
    """kill-after@: this rank dies once checkpoint `folder` is whole. Rank 0 writes it while
    the others go on, so another rank first waits (at most a minute) for `latest` to name it."""
    if _active.kill_after != (rank, os.path.basename(folder)):
        return
    latest = os.path.join(os.path.dirname(folder), "latest")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with open(latest) as f:
                if f.read().strip() == os.path.basename(folder):
                    break
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)


def after_model_file() -> None:
    """checkpoint-delay@: a checkpoint half written (its model file only) for that long."""
    if _active.checkpoint_delay:
        time.sleep(_active.checkpoint_delay)


def in_shard(name: str) -> None:
    """prepare-pause@: stop mid-shard in shard file `name` until the until-file exists."""
    pause = _active.prepare_pause
    if pause is None or pause[0] != name:
        return
    print(f"paused in {name}", file=sys.stderr, flush=True)
    until = pause[1]
    while not (until and os.path.exists(until)):
        time.sleep(0.05)


def disk_full(area: str, name: str) -> None:
    """disk-full@: write `name` of `area` (checkpoint, prepare) fails here as on a full disk."""
    if _active.disk_full == f"{area}:{name}":
        raise OSError(errno.ENOSPC, f"No space left on device ({VARIABLE} disk-full@{area}:{name})")
