"""Room on the run folder's disk for a training's checkpoints, and the one line of a run that
has none, which says the command that goes on elsewhere (an `andrea train` command line rebuilt
from the config, or a `mv` and `--resume`).

A checkpoint's size is estimated from the byte counts of the weights and the optimizer state
(andrea/train/checkpoint.py's `checkpoint_nbytes`, once a session: `Session.checkpoint_nbytes`).
At start, a disk that cannot hold even one checkpoint stops the run before its first step,
with a command that trains on another disk (`check_room_at_start`); one that cannot hold the
checkpoints the run will keep at once is a warning (`start_warning`); before each checkpoint,
too little room for one stops the run before anything is written, and a write that fails
anyway (ENOSPC above all) stops it the same way once the partial folder is removed
(`TrainingState.save`, with `full_message`): one line, exit code 2, `latest` and the older
checkpoints untouched, every rank stopping together.
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path
from typing import Any

from andrea.config import Config, load_config, override_value
from andrea.errors import UserError
from andrea.fileio import DISK_FULL_ERRNOS, free_bytes, size_text
from andrea.resources import configs_dir
from andrea.train.collectives import from_rank0
from andrea.train.rundir import read_latest, start_over_command, step_dir_name, step_dirs
from andrea.train.session import Session


class DiskFull(Exception):
    """A checkpoint did not fit (or its write failed): the run stops with this one line."""


def checkpoints_ahead(step: int, max_steps: int, every: int) -> int:
    """How many checkpoints a run at `step` still writes on its way to max_steps."""
    periodic = (max_steps // every - step // every) if every else 0
    return periodic + (0 if every and max_steps % every == 0 else 1)


def peak_checkpoints(s: Session) -> tuple[int, int]:
    """(the run's checkpoints on disk now, the most it holds at once: its existing ones, up to
    train.keep_last, and the one being written)."""
    t = s.cfg.train
    existing = len(step_dirs(s.run_dir))
    ahead = checkpoints_ahead(s.step, t.max_steps, t.checkpoint_every)
    return existing, max(existing + 1, min(t.keep_last + 1, existing + ahead))


def start_warning(s: Session, free: int) -> str | None:
    """The warning line when the disk cannot hold the checkpoints the run keeps at once (its
    existing ones, up to train.keep_last, and the one being written), or None."""
    t, per = s.cfg.train, s.checkpoint_nbytes
    existing, peak = peak_checkpoints(s)
    needed = (peak - existing) * per
    if free >= needed:
        return None
    held = f"{peak} at once, {size_text(per)} each" + (
        f": train.keep_last {t.keep_last} and the one being written"
        if peak == t.keep_last + 1 else "")
    return (f"warning: {s.run_dir}: {size_text(free)} free on its disk, but the checkpoints need "
            f"about {size_text(needed)} more ({held}); the run will stop cleanly at the first "
            f"checkpoint that does not fit: free space, lower train.keep_last, or set "
            f"train.runs_dir to a disk with room")


def check_room_at_start(s: Session, replaced: bool,
                        changes: dict[str, list[Any]] | None = None) -> None:
    """Every rank, before the first step: a UserError when the run folder's disk (as rank 0
    sees it) cannot hold even one checkpoint, rather than training up to the first one to stop
    there. replaced: the run folder is an --overwrite's, whose files make room as they go;
    changes: a resume's {key: [old, new]}, which its command carries on."""

    def measure() -> None:
        free = free_bytes(s.run_dir)
        if replaced and s.run_dir.is_dir():
            free += sum(f.stat().st_size for f in s.run_dir.rglob("*") if f.is_file())
        if free < s.checkpoint_nbytes:
            raise UserError(no_room_message(s, free, changes or {}))

    from_rank0(measure, s.dist)


def no_room_message(s: Session, free: int, changes: dict[str, list[Any]]) -> str:
    """The one line of a run whose disk cannot hold one checkpoint: the size, the room, where,
    and the command that trains on a disk with room for every checkpoint the run keeps."""
    existing, peak = peak_checkpoints(s)
    needed = (peak - existing) * s.checkpoint_nbytes
    head = (f"{s.run_dir}: a checkpoint of this run needs about "
            f"{size_text(s.checkpoint_nbytes)}, its disk has {size_text(free)} free; nothing "
            f"was trained or written")
    folder = folder_with_room(needed, s.run_dir)
    dest = str(folder) if folder else "DIR"
    where = ("" if folder else
             f"; DIR: a folder on a disk with about {size_text(needed)} free")
    if s.checkpoint is not None:  # a resume: the run folder moves with its checkpoints
        moved = Path(dest) / s.run_dir.name
        resume_sets = [arg for key, (_, new) in changes.items()
                       for arg in ("--set", f"{key}={override_value(new)}")]
        # mkdir first: into a folder that does not exist yet, mv would rename the run to it.
        return (f"{head}; move the run to a disk with room and continue there: "
                f"{shlex.join(['mkdir', '-p', dest])} && "
                f"{shlex.join(['mv', str(s.run_dir), dest + '/'])} && "
                f"{shlex.join(['andrea', 'train', '--resume', str(moved), *resume_sets])}"
                f"{where}")
    return (f"{head}; train on a disk with room: "
            f"{shlex.join(train_command(s.cfg, {'train.runs_dir': dest}))}{where}")


def folder_with_room(needed: int, run_dir: Path) -> Path | None:
    """A runs folder on another disk with `needed` bytes free: under the home directory, else
    the temporary one; None when neither has the room."""
    for folder in (Path.home() / "andrea-runs", Path(tempfile.gettempdir()) / "andrea-runs"):
        if folder.resolve() != run_dir.parent.resolve() and free_bytes(folder) >= needed:
            return folder
    return None


def train_command(cfg: Config, changed: dict[str, str]) -> list[str]:
    """`andrea train` that trains cfg, as argv: its config file (a preset by name) and a --set
    for each key it differs from it by, then for each of `changed`'s {dotted key: value}."""
    base = load_config(None if cfg.source == "<defaults>" else cfg.source)
    sets = {f"{section}.{key}": value
            for section, keys in cfg.to_dict().items()
            for key, value in keys.items() if value != base.to_dict()[section][key]}
    sets.update(changed)
    source = Path(cfg.source)
    name = source.stem if source.parent.resolve() == configs_dir().resolve() else cfg.source
    argv = ["andrea", "train"] + ([] if cfg.source == "<defaults>" else ["--config", name])
    for key, value in sets.items():
        argv += ["--set", f"{key}={override_value(value) if key not in changed else value}"]
    return argv


def full_message(s: Session, free: int, cause: str | None, full: bool | None = True) -> str:
    """The one line of a checkpoint that was not written. cause: why the write failed, None
    when the free-space check stopped it before writing anything; full: whether the disk was
    full, None when not known (another rank's write failed, most likely on the same disk)."""
    folder, per = s.run_dir / step_dir_name(s.step), size_text(s.checkpoint_nbytes)
    if cause is None:
        what = (f"{folder} was not written: a checkpoint needs about {per}, the disk has "
                f"{size_text(free)} free")
    else:
        what = (f"writing {folder} failed ({cause}; it needs about {per}, {size_text(free)} was "
                f"free); its partial folder is removed")
    latest = read_latest(s.run_dir)
    # A failure known not to be about room (not ENOSPC, a quota) is the cause's to fix.
    room = full is not False
    if latest is None:
        fix = "free space there, or set train.runs_dir to a disk with room" if room else \
            "fix that"
        how = (f"no checkpoint was written before it; {fix}, then start over: "
               f"{start_over_command(s.run_dir)}")
    else:
        fix = f"free space there, or move {s.run_dir} to a disk with room" if room else \
            "fix that"
        how = (f"latest is still {latest}; {fix}, then continue: "
               f"{shlex.join(['andrea', 'train', '--resume', str(s.run_dir)])}"
               f"{' (its new path if moved)' if room else ''}")
    head = "disk full" if full else "checkpoint write failed"
    return f"{head} at step {s.step}: {what}; {how}"


def describe_failure(exc: OSError | None) -> tuple[str, bool | None]:
    """(what failed, in a few words; whether the disk was full, None when not known) for a
    failed write: rank 0's OSError, or None when only another rank's write failed."""
    if exc is None:
        return "a write failed on another rank", None
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}", exc.errno in DISK_FULL_ERRNOS

