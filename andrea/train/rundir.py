"""A run directory's layout, and how a run is named on the command line.

    runs/NAME/config.yaml          the resolved config the run trains with
    runs/NAME/metrics.jsonl        one JSON event per line (start, step, eval, end, ...)
    runs/NAME/step-NNNNNN/         checkpoints (andrea/train/checkpoint.py writes them)
    runs/NAME/latest               the name of the newest complete checkpoint
    runs/NAME/wandb_run_id         the W&B run's id (train.wandb), kept so a resume continues it
    runs/NAME/wandb/               W&B's own files (an offline run's, for `wandb sync`)
    runs/NAME/.andrea-train.lock   while a training writes the run: its lock, who holds it
                                   (andrea/train/runlock.py); removed at its end (a killed
                                   training's is stale)

Also here, for the same readers: whether a checkpoint folder is intact (`checkpoint_problem`),
judged from its files and the safetensors headers alone, and the newest intact one of a run.

No torch here: `andrea runs` and `andrea plot` read runs without loading it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from andrea.fileio import size_text

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
LATEST = "latest"
WANDB_RUN_ID = "wandb_run_id"
RUN_LOCK = ".andrea-train.lock"
TRAINER_STATE = "trainer_state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
SHARDS_DIR = "shards"
SHARD_INDEX = "index.json"
CHECKSUMS = "checksums.json"  # each other file's sha256 as written (train/checkpoint.py)
STEP_DIR = re.compile(r"step-(\d+)")
# safetensors' own limit on the JSON header; a larger length is damage, never a real header.
MAX_HEADER_BYTES = 100_000_000


def is_run(path: Path) -> bool:
    return (path / METRICS).exists() or (path / CONFIG).exists()


def run_path(name: str | Path, runs_dir: str | Path = "runs") -> Path:
    """A run given as a path, or as a bare name under runs_dir (when no run has that path:
    `andrea export --out NAME` then `andrea import NAME` leaves ./NAME, an export, beside
    runs/NAME, the run)."""
    path = Path(name)
    under = Path(runs_dir) / path
    if len(path.parts) == 1 and not is_run(path) and under.is_dir():
        if not path.exists() or is_run(under):
            return under
    return path


def step_dir_name(step: int) -> str:
    """The folder name of the checkpoint of step `step`; `step_of_dir` reads it back."""
    return f"step-{step:06d}"


def step_of_dir(path: Path) -> int | None:
    """The step a checkpoint folder's name says (step-NNNNNN), None for any other name."""
    match = STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def is_step_dir(path: Path) -> bool:
    """A checkpoint folder by its name (step-NNNNNN), whatever its contents."""
    return step_of_dir(path) is not None


def step_dirs(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders (complete or damaged; never a .partial-), oldest first."""
    found = [p for p in run_dir.glob("step-*") if p.is_dir() and is_step_dir(p)]
    return sorted(found, key=lambda p: step_of_dir(p) or 0)


def describe_run(run_dir: Path) -> str:
    """What a run folder holds, for the line that names it before --overwrite deletes it:
    its checkpoints, the newest one's step, and their size with the metrics on disk."""
    steps = step_dirs(run_dir)
    files = [f for d in steps for f in d.rglob("*") if f.is_file()]
    files += [run_dir / METRICS] if (run_dir / METRICS).is_file() else []
    size = sum(f.stat().st_size for f in files)
    newest = f", the newest at step {step_of_dir(steps[-1])}" if steps else ""
    return (f"{len(steps)} checkpoint{'s' if len(steps) != 1 else ''}{newest}, "
            f"{size_text(size)} on disk")


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file's size; a ValueError
    saying what is wrong (truncated, a length past the end, data past the end) otherwise.
    Reads at most the header, so a forged length never makes anyone read or allocate it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"truncated: {size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise ValueError(f"header length {length:,} bytes does not fit the file "
                             f"({size:,} bytes): truncated or damaged")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        raise ValueError("the header is not JSON: damaged") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object: damaged")
    try:
        end = max((int(entry["data_offsets"][1]) for key, entry in header.items()
                   if key != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ValueError("a tensor entry of the header has no data offsets: damaged") from None
    if 8 + length + end != size:
        raise ValueError(f"the tensors need {8 + length + end:,} bytes, the file has "
                         f"{size:,}: truncated or damaged")
    return header


def checkpoint_problem(ckpt: Path, for_resume: bool = False) -> str | None:
    """What makes checkpoint folder `ckpt` unusable, in a few words, or None if it is intact:
    its model file (for eval, generate, export) and, for_resume, the trainer state, RNG states
    and optimizer state (or shard index) too. Files and headers only; no tensor is read."""
    if not ckpt.is_dir():
        return "the folder does not exist"
    files = [MODEL_FILE]
    if for_resume:
        sharded = (ckpt / SHARDS_DIR).is_dir()
        files += [RNG_FILE, TRAINER_STATE, f"{SHARDS_DIR}/{SHARD_INDEX}" if sharded
                  else OPTIMIZER_FILE]
    for name in files:
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        try:
            if name.endswith(".safetensors"):
                read_safetensors_header(path)
            else:
                json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return f"{name} is unreadable: {exc}"
    return None


def newest_intact(run_dir: Path, for_resume: bool = False) -> Path | None:
    """The newest checkpoint folder of the run with no `checkpoint_problem`."""
    for ckpt in reversed(step_dirs(run_dir)):
        if checkpoint_problem(ckpt, for_resume) is None:
            return ckpt
    return None
