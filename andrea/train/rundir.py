"""A run folder's layout and its checkpoints' format, without torch: every name in them, `latest`,
the partial folders a checkpoint is assembled in, the checksums record, trainer_state.json
(`TrainerState`), which checkpoint a path means and whether it is intact. `andrea runs` and
`andrea plot` read runs through here without loading torch; andrea/train/checkpoint.py writes
and reads the tensors.

    runs/NAME/config.yaml          the resolved config the run trains with
    runs/NAME/metrics.jsonl        one JSON event per line (start, step, eval, end, ...)
    runs/NAME/step-NNNNNN/         checkpoints, below
    runs/NAME/latest               the name of the newest complete checkpoint
    runs/NAME/wandb_run_id         the W&B run's id (train.wandb), kept so a resume continues it
    runs/NAME/wandb/               W&B's own files (an offline run's, for `wandb sync`)
    runs/NAME/.andrea-train.lock   while a training writes the run: its lock, who holds it
                                   (andrea/train/runlock.py); removed at its end (a killed
                                   training's is stale)
    runs/NAME/.andrea-overwritten/ during an --overwrite's set-up: the old run, set aside;
                                   removed once the new run has started, put back if it does not

Checkpoints are safetensors and JSON only (no pickle). Each `step-NNNNNN/` holds:

- `model.safetensors`: the weights (the tied LM head stored once, as the token embedding), with the
  resolved config, step and tokenizer identity in the safetensors metadata;
- `optimizer.safetensors`: the optimizer state keyed by `<parameter name>.<field>`: AdamW's
  moments and step counts, and with train.optimizer muon each block matrix's Muon momentum buffer;
- `rng.safetensors`: every generator's state (the CPU generator of each rank, and CUDA's);
- `trainer_state.json`: the run's counters and records (`TrainerState`);
- `tokenizer.json` for a run with a trained or given BPE: the tokenizer it was trained with, so
  that the checkpoint opens without the run's data folder (byte and gpt2 need only their names);
- `checksums.json`: the sha256 of each other file, computed from the bytes as they were written
  (the shards' from their files, once every rank has written them), checked as each file is
  read (`verify_file`): a copy damaged on its way is refused naming the file, never used.
  Checkpoints written before it open unchecked.

With `train.parallel: fsdp` the weights and optimizer state (AdamW's, Muon's) are written by every
rank at once, each its own shards, through torch.distributed.checkpoint's Hugging Face writer:
`shards/shard-NNNNN-model-00001-of-00001.safetensors`, NNNNN the rank + 1 in five digits (each
tensor's slice with its offsets in the metadata) and `shards/index.json` (the files and their
sizes); `optimizer.safetensors` is then not written. A resume reads the shards at any number of
processes, in either mode (DCP reshards); `model.safetensors` stays whole for eval, generate and
export.

A checkpoint is assembled in `step-NNNNNN.partial-<pid>/` (each file flushed and fsynced; with
shards, after every rank has finished its files), the folder is renamed into place (`publish`),
and only then is `latest` replaced (write, fsync, rename). A crash at any moment therefore leaves
`latest` pointing at a complete checkpoint.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import struct
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from andrea.config.declare import registry, type_name
from andrea.config.load import override_value
from andrea.config.sections import NS_PRECISIONS, PRECISION_DTYPES
from andrea.errors import UserError, quoted
from andrea.fileio import atomic_write_text, fsync_dir, size_text

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
CHECKSUMS = "checksums.json"  # each other file's sha256 as written
OVERWRITTEN = ".andrea-overwritten"  # the old run an --overwrite set aside (set_aside)
STEP_DIR = re.compile(r"step-(\d+)")
FORMAT = "andrea-checkpoint/1"  # the safetensors files' and the shard index's "format"
CHECKSUMS_FORMAT = "andrea-checksums/1"
# safetensors' own limit on the JSON header; a larger length is damage, never a real header.
MAX_HEADER_BYTES = 100_000_000


def is_run(path: Path) -> bool:
    return (path / METRICS).exists() or (path / CONFIG).exists()


# Every name an andrea run folder holds: what the trainer writes, an imported run's BPE
# (andrea.data.tokenizer.BPE_FILE), the loggers' folders, and checkpoint folders, whole, being
# written or being replaced. Anything else in a folder is a user's own.
RUN_ENTRIES = frozenset({CONFIG, METRICS, LATEST, WANDB_RUN_ID, RUN_LOCK, "tokenizer.json",
                         OVERWRITTEN, f"{OVERWRITTEN}.deleting", "tensorboard", "wandb"})
RUN_STEP_ENTRY = re.compile(r"step-\d+(\.(partial|stale)-\d+)?")


def not_a_run(folder: Path) -> str | None:
    """Why `folder`, which exists, is not an andrea run's to write or replace, in words (a
    user's own files in it, or a config.yaml or metrics.jsonl andrea did not write); None
    when it holds nothing but a run's own entries. `--overwrite`, `import --force` and a new
    run's start write into a folder only when this is None: none of them may take a user's
    files with it."""
    foreign = sorted(e.name for e in folder.iterdir()
                     if e.name not in RUN_ENTRIES and not RUN_STEP_ENTRY.fullmatch(e.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        return f"holds {shown}, which no andrea run holds"
    metrics, config = folder / METRICS, folder / CONFIG
    if metrics.is_file() and not _first_line_is_a_record(metrics):
        return f"its {METRICS} is not an andrea run's (no record on its first line)"
    if config.is_file() and not _is_a_config(config):
        return f"its {CONFIG} is not an andrea config (no model, data or train section)"
    return None


def linked_entries(folder: Path) -> str | None:
    """The run's own entries that are symbolic links, in words ("metrics.jsonl -> /x"), or
    None. A run folder from elsewhere may hold them: the trainer appending to its metrics,
    writing its lock's record or replacing a checkpoint would write through them, outside the
    run."""
    links = sorted(e for e in folder.iterdir() if e.is_symlink()
                   and (e.name in RUN_ENTRIES or RUN_STEP_ENTRY.fullmatch(e.name)))
    if not links:
        return None
    return ", ".join(f"{e.name} -> {os.readlink(e)}" for e in links[:3]) + (
        ", ..." if len(links) > 3 else "")


def _first_line_is_a_record(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            first = f.readline(1 << 16)
    except OSError:
        return False
    if not first.strip():
        return True  # a run that stopped as it opened the file
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and "event" in record


def _is_a_config(path: Path) -> bool:
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(loaded, dict) and bool(loaded) and set(loaded) <= {"model", "data", "train"}


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


def start_over_command(run_dir: Path) -> str:
    """The command that starts the run in `run_dir` over (one that stopped before its first
    checkpoint: train takes the folder without --overwrite), in that folder: its config.yaml,
    and a --set of train.runs_dir and train.name where that config names another folder from
    here. A run moved or renamed keeps the config it was started with, whose runs_dir is
    mostly relative: as it is, the command trained a new run under ./runs and left this one
    as it was."""
    import yaml

    try:
        loaded = yaml.safe_load((run_dir / CONFIG).read_text(encoding="utf-8"))
        train = loaded.get("train") or {}
        runs_dir, name = Path(train.get("runs_dir", "runs")), train.get("name") or \
            Path(CONFIG).stem  # an empty name is the config file's stem
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError, TypeError):
        runs_dir, name = None, None  # train names what is wrong with the file
    argv = ["andrea", "train", "--config", str(run_dir / CONFIG)]
    if runs_dir is None or runs_dir.resolve() != run_dir.parent.resolve():
        argv += ["--set", f"train.runs_dir={override_value(str(run_dir.parent))}"]
    if name != run_dir.name:
        argv += ["--set", f"train.name={override_value(run_dir.name)}"]
    return shlex.join(argv)


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
    """The run's checkpoint folders, oldest first: renamed into place whole, so complete unless
    damaged since (never a .partial-)."""
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


# ----------------------------------------------------------------------------- --overwrite

# What --overwrite replaces besides the checkpoints: the files a new run writes again. Other
# files (wandb_run_id, a tensorboard folder) were never removed by --overwrite and stay.
REPLACED = (LATEST, METRICS, CONFIG)


def set_aside(run_dir: Path) -> Path:
    """--overwrite: move the old run's checkpoints, `latest`, metrics and config into
    run_dir/OVERWRITTEN (renames, nothing copied or deleted yet); the folder. `discard` deletes
    it once the new run has started, `put_back` restores it if it does not."""
    aside = run_dir / OVERWRITTEN
    aside.mkdir()
    for old in [*(run_dir / name for name in REPLACED), *step_dirs(run_dir)]:
        if old.exists():
            old.rename(aside / old.name)
    fsync_dir(run_dir)
    return aside


def put_back(run_dir: Path) -> bool:
    """The old run set aside back in place, over what the new run wrote meanwhile (its config
    and metrics: it never gets as far as a checkpoint); whether there was one. A set-aside
    stopped half-way (a kill) leaves the rest in place: only names the folder holds are
    replaced."""
    aside = run_dir / OVERWRITTEN
    if not aside.is_dir():
        return False
    for old in sorted(aside.iterdir()):
        new = run_dir / old.name
        if new.is_dir() and not new.is_symlink():
            shutil.rmtree(new)
        elif new.exists() or new.is_symlink():
            new.unlink()
        old.rename(new)
    aside.rmdir()
    fsync_dir(run_dir)
    return True


def discard(run_dir: Path) -> None:
    """Delete the old run set aside: the new run has started. Renamed first, so that a kill
    half-way through the deletion never leaves half a run to put back."""
    aside = run_dir / OVERWRITTEN
    if aside.is_dir():
        doomed = run_dir / f"{OVERWRITTEN}.deleting"
        aside.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def set_aside_run(path: Path) -> Path | None:
    """The run folder at `path` (a run, or a step folder of one) whose old run an --overwrite
    that never started left set aside, or None."""
    for folder in (path, path.parent):
        if (folder / OVERWRITTEN).is_dir():
            return folder
    return None


def recover_overwrite(run_dir: Path) -> bool:
    """For the run's new holder: an --overwrite whose process ended during set-up (killed, its
    host lost) left the old run set aside: put back (the new run never trained a step), or, if
    it was being deleted, the deletion finished. Whether a run was put back."""
    shutil.rmtree(run_dir / f"{OVERWRITTEN}.deleting", ignore_errors=True)
    return put_back(run_dir)


def stored_shapes(path: Path) -> dict[str, list[int]]:
    """Each tensor's shape in safetensors file `path`, from its header alone (a forged or
    truncated header refused in one line before anything else is read)."""
    try:
        header = read_safetensors_header(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a valid safetensors file (truncated or damaged?): "
                        f"{exc}") from None
    return {key: list(entry.get("shape", [])) for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict)}


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


def checkpoint_problem(ckpt: Path, for_resume: bool = False, verify: bool = False) -> str | None:
    """What makes checkpoint folder `ckpt` unusable, in a few words, or None if it is intact:
    its model file (for eval, generate, export) and, for_resume, the trainer state, RNG states
    and optimizer state (under fsdp its shards: shards_problem) too. Files and headers only; no
    tensor is read. The one test of "intact" that `andrea runs`, the refusal of a damaged
    checkpoint and the checkpoint a resume or a torchrun restart picks all ask, so that none of
    them takes a checkpoint another calls damaged. `verify`: also every such file's sha256
    against checksums.json (checksums_problem), which a flipped byte alone fails: seconds for
    a big checkpoint, so asked where nobody is there to choose (a torchrun restart's pick); a
    load checks each file as it reads it anyway."""
    if not ckpt.is_dir():
        return "the folder does not exist"
    files = [MODEL_FILE]
    sharded = for_resume and has_shards(ckpt)
    if for_resume:
        files += [RNG_FILE, TRAINER_STATE] + ([] if sharded else [OPTIMIZER_FILE])
    for name in files:
        problem = _file_problem(ckpt / name, name)
        if problem is not None:
            return problem
    problem = shards_problem(ckpt) if sharded else None
    return checksums_problem(ckpt, for_resume) if problem is None and verify else problem


def checksums_problem(ckpt: Path, for_resume: bool = False) -> str | None:
    """Which file of checkpoint `ckpt` is not the bytes its checksums.json recorded when it was
    written, in a few words, or None: the files eval and generate read (the model file, a BPE's
    tokenizer.json) and, for_resume, every file the record lists (under fsdp every shard). A
    checkpoint without the record (written before andrea kept one) has nothing to verify:
    None."""
    record = ckpt / CHECKSUMS
    if not record.is_file():
        return None
    try:
        sums = json.loads(record.read_text(encoding="utf-8"))["files"]
        listed = [(str(name), str(digest)) for name, digest in sums.items()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return f"{CHECKSUMS} is unreadable, so its files cannot be checked"
    for name, expected in listed:
        inside = not Path(name).is_absolute() and ".." not in Path(name).parts
        if not inside or not (for_resume or name in (MODEL_FILE, "tokenizer.json")):
            continue  # a forged name never leads the hashing out of the checkpoint
        path = ckpt / name
        if path.is_file() and file_sha256(path) != expected:
            return (f"{name} is damaged: its sha256 is not the one {CHECKSUMS} recorded when it "
                    f"was written (a copy damaged on its way?)")
    return None


def _file_problem(path: Path, name: str) -> str | None:
    """Why checkpoint file `path` (`name` inside its checkpoint) cannot be read, or None: a
    safetensors file's header against its size, a JSON file's syntax, and the trainer state's
    checksum and content (_check_state)."""
    if not path.is_file():
        return f"{name} is missing"
    try:
        if name.endswith(".safetensors"):
            read_safetensors_header(path)
        elif name == TRAINER_STATE:
            _check_state(path)
        else:
            json.loads(path.read_text(encoding="utf-8"))
    except DamagedState as exc:
        return f"{name} is damaged: {exc}"
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{name} is unreadable: {exc}"
    return None


def shard_files(ckpt: Path) -> dict[str, int]:
    """The shard files a sharded checkpoint's shards/index.json lists, each with its size; a
    ValueError saying what is wrong with the index otherwise. The index is untrusted: only
    plain .safetensors names inside shards/ ('../x' or '/x' would lead out)."""
    index = f"{SHARDS_DIR}/{SHARD_INDEX}"
    try:
        raw = json.loads((ckpt / index).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{index} is unreadable: {exc}") from None
    files = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(files, dict) or not all(type(size) is int for size in files.values()):
        raise ValueError(f"{index} is unreadable: no 'files' mapping file names to sizes")
    for name in files:
        if Path(name).name != name or name in ("", ".", "..") or not name.endswith(".safetensors"):
            raise ValueError(f"{index} lists {name!r}, which is not a .safetensors file name "
                             f"inside {SHARDS_DIR}/: a damaged or forged index")
    return files


def shards_problem(ckpt: Path) -> str | None:
    """What makes a sharded checkpoint's shards unusable, in a few words naming the file, or
    None: shards/index.json missing or unreadable (shard_files), a shard it lists missing, of
    another size than it says, or with a damaged safetensors header. Files and headers only:
    the shards' checksums and tensors are checkpoint.check_shards'. A .safetensors file in
    shards/ that the index does not list is one too: torch.distributed.checkpoint reads every
    such file in the folder, so a leftover of another copy would be loaded with the shards."""
    if not (ckpt / SHARDS_DIR / SHARD_INDEX).is_file():
        return f"{SHARDS_DIR}/{SHARD_INDEX} is missing"
    try:
        files = shard_files(ckpt)
    except ValueError as exc:
        return str(exc)
    for name, size in files.items():
        path, shown = ckpt / SHARDS_DIR / name, f"{SHARDS_DIR}/{name}"
        if path.is_file() and path.stat().st_size != size:
            return (f"{shown} is {path.stat().st_size:,} bytes, but {SHARD_INDEX} lists it at "
                    f"{size:,}: truncated or damaged")
        problem = _file_problem(path, shown)
        if problem is not None:
            return problem
    unlisted = sorted(p.name for p in (ckpt / SHARDS_DIR).iterdir()
                      if p.name.endswith(".safetensors") and p.name not in files)
    if unlisted:
        return (f"{SHARDS_DIR}/{unlisted[0]} is not listed in {SHARD_INDEX}, yet the shards' "
                f"reader would load it: a leftover of another copy?")
    return _slices_problem(ckpt, files)


Slice = tuple[tuple[int, ...], tuple[int, ...]]  # a tensor's part in a shard: offsets, sizes


def _slices_problem(ckpt: Path, files: dict[str, int]) -> str | None:
    """Why the shards' slices of a tensor, as their headers give them (the offsets in DCP's
    metadata, the sizes in safetensors' own), do not tile the tensor they reach over, in words
    naming it; None when every tensor's do. The tensor's shape is the slices' reach, as DCP takes
    it: a last slice missing is the load's to find, against the model (check_shards)."""
    slices: dict[str, list[Slice]] = {}
    for name in files:
        try:  # the header is sound (_file_problem's), unless replaced since
            header = read_safetensors_header(ckpt / SHARDS_DIR / name)
            info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                offsets = tuple(int(o) for o in info[key]["saved_offsets"])
                sizes = tuple(int(n) for n in entry["shape"])
                if len(offsets) != len(sizes):
                    return (f"{SHARDS_DIR}/{name}: tensor '{key}' has offsets {list(offsets)} "
                            f"for its shape {list(sizes)}: damaged or forged")
                slices.setdefault(key, []).append((offsets, sizes))
        except OSError as exc:
            return f"{SHARDS_DIR}/{name} is unreadable: {exc}"
        except (KeyError, TypeError, ValueError, AttributeError):
            return (f"{SHARDS_DIR}/{name}: its metadata gives no offsets of some tensor "
                    f"(DCP_SHARDING_INFO): damaged or forged")
    for key, parts in slices.items():
        dims = len(parts[0][0])  # a slice of other dimensions is tiling_problem's to name
        reach = tuple(max(o[d] + n[d] for o, n in parts if len(o) == dims)
                      for d in range(dims))
        problem = tiling_problem(parts, reach)
        if problem is not None:
            return f"{SHARDS_DIR}: the slices of tensor '{key}' {problem}"
    return None


def tiling_problem(slices: list[Slice], shape: tuple[int, ...]) -> str | None:
    """Why slices (offsets, sizes) do not make up a tensor of `shape`, each value once, in
    words, or None: one reaches outside it, they hold another number of values, or two overlap
    (holding as many values as the tensor, the overlap leaves a gap). Swept along the first
    dimension, so that fsdp's slices (rows, a rank's each) meet their neighbours alone."""
    for offsets, sizes in slices:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape,
                                                                strict=True)):
            return (f"include one at offsets {list(offsets)} of size {list(sizes)}, outside "
                    f"its shape {list(shape)}")
    held, whole = sum(math.prod(sizes) for _, sizes in slices), math.prod(shape)
    if held != whole:
        return (f"hold {held:,} values of its {whole:,} (a shard missing, or one of another "
                f"checkpoint)")
    boxes = sorted((s for s in slices if math.prod(s[1]) > 0), key=lambda s: s[0][:1])
    reaching: list[Slice] = []  # the slices so far that reach past this one's first row
    for offsets, sizes in boxes:
        reaching = [b for b in reaching if not shape or b[0][0] + b[1][0] > offsets[0]]
        for other, other_sizes in reaching:
            if all(o < p + m and p < o + n for o, n, p, m in
                   zip(offsets, sizes, other, other_sizes, strict=True)):
                return (f"at offsets {list(other)} and {list(offsets)} overlap, which leaves "
                        f"part of it in no slice")
        reaching.append((offsets, sizes))
    return None


def _check_state(path: Path) -> None:
    """Whether trainer_state.json `path` is one a resume reads (read_state): ValueError when
    it is not JSON; DamagedState when it is not the bytes its checkpoint's checksums.json
    recorded, or not a trainer state andrea writes. Valid JSON alone is not enough: `{}` or a
    changed counter parsed, so `andrea runs` called the checkpoint fine and a torchrun restart
    took it as the newest intact one, then failed on it in every restart."""
    blob = path.read_bytes()
    raw = json.loads(blob)
    try:
        differs = _checksum_differs(path, path.parent, blob)
    except ValueError:
        raise DamagedState(f"{CHECKSUMS} is unreadable, so it cannot be checked") from None
    if differs:
        raise DamagedState(f"its sha256 is not the one {CHECKSUMS} recorded when it was written "
                           "(a copy damaged on its way?)")
    TrainerState.from_dict(raw)


def latest_problem(run: Path, name: str | None, verify: bool = False) -> str | None:
    """Why the checkpoint a run's `latest` names (`name`; None: no `latest` file) cannot be
    opened, or None when it can: what `find_checkpoint` would refuse, as `andrea runs` says
    it (`verify`: and its model file's checksum, checkpoint_problem's)."""
    if name is None:
        return f"no {LATEST} file naming the newest checkpoint"
    if not (run / name).is_dir():
        return f"{LATEST} points to {name}, which does not exist"
    damage = checkpoint_problem(run / name, verify=verify)
    return None if damage is None else f"{LATEST} points to {name}, whose {damage}"


def newest_intact(run_dir: Path, for_resume: bool = False, verify: bool = False) -> Path | None:
    """The newest checkpoint folder of the run with no `checkpoint_problem`."""
    for ckpt in reversed(step_dirs(run_dir)):
        if checkpoint_problem(ckpt, for_resume, verify) is None:
            return ckpt
    return None


def has_shards(ckpt: Path) -> bool:
    """Whether the checkpoint holds fsdp shards (every rank reads its own)."""
    return (ckpt / SHARDS_DIR).is_dir()


# ----------------------------------------------------------------------------- latest, partials


def read_latest(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names; None without one, or when it names anything but a
    step folder of this run (a forged '../elsewhere' never leads out of the run)."""
    try:
        name = (run_dir / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return run_dir / name if is_step_dir(Path(name)) and "/" not in name else None


def partial_dir(run_dir: Path, step: int, pid: int) -> Path:
    """Where checkpoint `step` is assembled by the writer with process id `pid` (rank 0's)."""
    return run_dir / f"{step_dir_name(step)}.partial-{pid}"


def publish(partial: Path, run_dir: Path, step: int) -> Path:
    """Rename the assembled `partial` folder into place as checkpoint `step`, then point `latest`
    at it; the checkpoint folder. A folder of the same step (written by an earlier segment of
    this run) is set aside under a .stale- name and removed first."""
    final = run_dir / step_dir_name(step)
    if (final.exists() or final.is_symlink()) and not final.is_dir():
        # Not a checkpoint of the run: someone's file, left as it is (and under its name).
        raise OSError(errno.EEXIST, "a file, not a checkpoint folder, is in the way", str(final))
    if final.exists():
        remove_checkpoint(final)
    partial.rename(final)
    fsync_dir(run_dir)
    atomic_write_text(run_dir / LATEST, final.name + "\n")
    return final


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Remove all but the newest keep_last checkpoints up to the one `latest` names (never it).
    Those past it are left: a resume from an older step writes its way back to them, replacing
    each as it writes that step again, and pruning them sooner would keep them in place of the
    checkpoint it resumed from."""
    latest = read_latest(run_dir)
    upto = step_of_dir(latest) if latest is not None else None
    line = [d for d in step_dirs(run_dir) if upto is None or (step_of_dir(d) or 0) <= upto]
    for old in line[:-keep_last]:
        if latest is None or old.resolve() != latest.resolve():
            remove_checkpoint(old)


def remove_checkpoint(step_dir: Path) -> None:
    """Take a checkpoint folder out of the run at once (renamed under a .stale- name), then
    delete it: a command reading the run meanwhile (eval --all-steps while it trains) finds the
    folder gone, never half-deleted, which would read as a damaged checkpoint. A crash while
    deleting leaves the .stale- folder, which clean_partials removes."""
    stale = step_dir.with_name(f"{step_dir.name}.stale-{os.getpid()}")
    try:
        step_dir.rename(stale)
    except OSError:
        return  # gone already, or not ours to remove
    shutil.rmtree(stale, ignore_errors=True)


def clean_partials(run_dir: Path) -> None:
    """Remove folders a crashed writer left behind (never a complete checkpoint)."""
    for leftover in list(run_dir.glob("step-*.partial-*")) + list(run_dir.glob("step-*.stale-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def resolve_checkpoint(
    path: str | Path, use: str = "andrea eval --checkpoint {}", for_resume: bool = False
) -> Path:
    """A run directory means its latest checkpoint; a step directory means itself. A damaged
    one (see checkpoint_problem) is refused in one line that names the newest intact
    checkpoint of the run and the command that uses it: `use` with {} for the folder (shell-
    quoted)."""
    path = Path(path)
    aside = set_aside_run(path)
    if not path.exists() and aside is None:
        raise UserError(f"{path}: no such checkpoint or run directory")
    if aside is not None and not (aside / LATEST).is_file():
        raise UserError(
            f"{aside}: an --overwrite that stopped during its set-up (or is in it now) left the "
            f"run in {aside / OVERWRITTEN}; any training of the run puts it back: "
            f"{shlex.join(['andrea', 'train', '--resume', str(aside)])}")
    if (path / MODEL_FILE).is_file() or is_step_dir(path):
        run_dir, ckpt, what = path.parent, path, f"{path}: damaged checkpoint"
    else:
        ckpt = read_latest(path)
        if ckpt is None and not step_dirs(path):
            if is_run(path):
                raise UserError(f"{path}: the run has no checkpoint yet (it stopped before its "
                                f"first, or has not reached it); "
                                f"{shlex.join(['andrea', 'runs', str(path)])} says how it stands")
            if path.is_file():  # the model file itself, most often
                raise UserError(f"{path}: a file; give the checkpoint's folder (the one that "
                                f"holds {MODEL_FILE}), or its run's folder for the newest")
            raise UserError(f"{path}: not a checkpoint (no {MODEL_FILE}) and not a run "
                            f"directory (no '{LATEST}' file)")
        run_dir = path
        what = (f"{path}: no usable '{LATEST}' file" if ckpt is None
                else f"{path}: the latest checkpoint, {ckpt.name}, is damaged")
    problem = checkpoint_problem(ckpt, for_resume) if ckpt is not None else "missing"
    if problem is None:
        return ckpt
    intact = newest_intact(run_dir, for_resume)
    way_out = (f"the newest intact checkpoint is {intact}: {use.format(shlex.quote(str(intact)))}"
               if intact is not None else "the run has no intact checkpoint")
    reason = f" ({problem})" if ckpt is not None else ""
    raise UserError(f"{what}{reason}; {way_out}")


# ----------------------------------------------------------------------------- checksums


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(folder: Path, sums: dict[str, str]) -> None:
    """The checkpoint's checksums.json: each file's sha256 by its path inside `folder`; written
    last, once every other file is."""
    atomic_write_text(folder / CHECKSUMS, json.dumps(
        {"format": CHECKSUMS_FORMAT, "hash": "sha256", "files": sums}, indent=1))


def verify_file(path: Path, blob: bytes | None = None) -> None:
    """Check a checkpoint's file against the sha256 its checksums.json recorded when it was
    written; `blob`: its bytes, when the caller has read them. A mismatch is a copy damaged on
    its way (a flipped byte keeps a safetensors header valid): refused in one line naming the
    file, the checkpoint and the run's newest other checkpoint whose model file is intact. A
    checkpoint without the record (written before andrea kept one), or a file it does not
    list, passes unchecked."""
    ckpt = path.parent.parent if path.parent.name == SHARDS_DIR else path.parent
    again = f"copy {ckpt} again from where it was written, or use another checkpoint of the run"
    try:
        damaged = _checksum_differs(path, ckpt, blob)
    except ValueError:
        raise UserError(f"{ckpt / CHECKSUMS}: unreadable (damaged?), so the checkpoint's files "
                        f"cannot be checked; {again}") from None
    if damaged:
        # Hashed only now that one copy is damaged: the others may have come the same way.
        other = next((o for o in reversed(step_dirs(ckpt.parent)) if o.name != ckpt.name
                      and checkpoint_problem(o) is None and _model_matches(o)), None)
        raise UserError(f"{path}: damaged: its sha256 is not the one {ckpt.name}/{CHECKSUMS} "
                        f"recorded when the checkpoint was written (a copy damaged on its "
                        f"way?); {again}" + (f" (the newest other intact one is {other})"
                                              if other is not None else ""))


def _model_matches(ckpt: Path) -> bool:
    """Whether checkpoint `ckpt`'s model file matches its recorded checksum (or has none)."""
    try:
        return not _checksum_differs(ckpt / MODEL_FILE, ckpt)
    except (ValueError, OSError):
        return False


def _checksum_differs(path: Path, ckpt: Path, blob: bytes | None = None) -> bool:
    """Whether `path`, a file of checkpoint `ckpt`, differs from the sha256 its checksums.json
    recorded (False where nothing is recorded); ValueError for a record that cannot be read."""
    record = ckpt / CHECKSUMS
    if not record.is_file():
        return False
    try:
        sums = json.loads(record.read_text(encoding="utf-8"))["files"]
        expected = sums.get(path.relative_to(ckpt).as_posix())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(record) from None
    if expected is None:
        return False
    return (hashlib.sha256(blob).hexdigest() if blob is not None else file_sha256(path)) \
        != expected


# ----------------------------------------------------------------------------- trainer_state.json

# Which trainer_state.json writes a key (`_key`'s `written`): every one, a trained run's, or an
# imported run's (`andrea import`: where its weights came from, instead of the training keys
# it has not used yet).
EVERY, TRAINED, IMPORTED = "every", "trained", "imported"

# A value's range beyond its type: None when it is in range, else what it must be, in words.
Valid = Callable[[Any], "str | None"]
# Counters feed numpy and torch, whose integers are 64-bit.
INT64_MAX = 2**63 - 1


class DamagedState(ValueError):
    """A trainer_state.json whose content is not one andrea writes: its message names the key
    and the value."""


def _integer(low: int) -> Valid:
    return lambda x: None if low <= x <= INT64_MAX else f"an integer of {low} or more, below 2^63"


COUNT, POSITIVE = _integer(0), _integer(1)


def _finite(x: float) -> str | None:
    return None if math.isfinite(x) else "a finite number"


def _name(x: str) -> str | None:
    good = x.strip() != "" and x.isprintable() and len(x) <= 4096  # PATH_MAX: imported_from
    return None if good else "a name in printable characters"


def _recorded(dotted: str) -> Valid:
    """A name of the registry `dotted` (andrea.config.register_choices), checked once its module
    is imported: `andrea runs` reads trainer states without torch, so without the registries."""
    def valid(x: str) -> str | None:
        names = registry(dotted)
        return None if names is None or x in names else f"one of {', '.join(names)}"
    return valid


def _precision(x: str) -> str | None:
    """A precision as it resolved: a name of PRECISION_DTYPES (never auto)."""
    return None if x in PRECISION_DTYPES else f"one of {', '.join(PRECISION_DTYPES)}"


def _ns_precision(x: str) -> str | None:
    """Muon's Newton-Schulz precision as it resolved: a name of NS_PRECISIONS but auto."""
    names = [name for name in NS_PRECISIONS if name != "auto"]
    return None if x in names else f"one of {', '.join(names)}"


def _is(value: Any, tp: type) -> bool:
    """JSON's types as Python reads them: an integer is no bool (bool subclasses int), and a
    number may be written without a fraction."""
    if isinstance(value, bool):
        return tp is bool
    return isinstance(value, (int, float) if tp is float else tp)


def _object(keys: dict[str, tuple[type, Valid | None]], required: bool) -> Valid:
    """A JSON object of these keys, each of its type and in range (`required`: all of them;
    else an older writer's subset)."""
    def valid(x: dict[str, Any]) -> str | None:
        if not set(x) <= set(keys) or (required and set(x) != set(keys)):
            return f"an object of {'exactly ' if required else ''}the keys {', '.join(keys)}"
        for k, v in x.items():
            tp, check = keys[k]
            must = type_name(tp) if not _is(v, tp) else check(v) if check else None
            if must is not None:
                return f"an object whose '{k}' is {must}"
        return None
    return valid


def _window(x: list[Any]) -> str | None:
    pairs = all(isinstance(p, list) and len(p) == 2 and all(_is(v, float) and math.isfinite(v)
                                                            for v in p) for p in x)
    return None if pairs else "a list of [loss, gradient norm] pairs of finite numbers"


def _hex(x: str) -> str | None:
    return None if re.fullmatch(r"[0-9a-f]{1,128}", x) else "a digest in hex digits"


# schedule.replan's anchor; SpikeGuard.state_dict() (an older guard wrote fewer keys); fp16's
# GradScaler.state_dict() with LossScaling's overflow count.
ANCHOR = _object({"step": (int, COUNT), "lr": (float, lambda x: None if math.isfinite(x)
                                                and x >= 0 else "a finite number of 0 or more")},
                 required=True)
GUARD = _object({"window": (list, _window), "streak": (int, COUNT), "data_offset": (int, COUNT),
                 "lr_cut_until": (int, COUNT), "spikes": (int, COUNT),
                 "rollbacks": (int, COUNT)}, required=False)

def _list_of(item: Valid) -> Valid:
    """A JSON list of objects, each of which `item` finds in range."""
    def valid(x: list[Any]) -> str | None:
        for v in x:
            must = "an object" if not isinstance(v, dict) else item(v)
            if must is not None:
                return f"a list, each entry {must}"
        return None
    return valid


# loader.data_record's: a source's folder and its splits' digests.
DATA = _list_of(_object({"dir": (str, _name), "train": (str, _hex), "val": (str, _hex)},
                        required=True))
_SCALE = (float, lambda x: None if math.isfinite(x) and x > 0 else "a finite positive number")
SCALER = _object({"scale": _SCALE, "growth_factor": _SCALE, "backoff_factor": _SCALE,
                  "growth_interval": (int, POSITIVE), "_growth_tracker": (int, COUNT),
                  "overflows": (int, COUNT)}, required=False)



def _key(
    default: Any = MISSING, *, valid: Valid | None = None, written: str = EVERY,
    absent: str | None = None, session: str | None = None, omitted_while_none: bool = False,
) -> Any:
    """A TrainerState field: one key of trainer_state.json, of the field's type (None only where
    the type allows it). default: what a file without the key (an older checkpoint's) reads it
    as, unless `absent` names the earlier key whose value it then reads as; valid: its range
    beyond the type; written: which files write it (EVERY, TRAINED, IMPORTED);
    omitted_while_none: left out of the file while None; session: the Session attribute that
    holds it while a run trains, which TrainingState records and restores as it is."""
    return field(default=default, metadata={
        "valid": valid, "written": written, "absent": absent, "session": session,
        "omitted_while_none": omitted_while_none})


@dataclass
class TrainerState:
    """What trainer_state.json records: the run's counters and the records a resume decides by.
    The fields are the file's keys in its order, each declared once (`_key`) with what a file
    without it means; `from_dict` and `to_dict` follow them."""

    step: int = _key(valid=COUNT, session="step")
    tokens: int = _key(0, valid=COUNT, session="tokens_seen")
    # The data step the next step draws from, past skipped windows; older runs skipped none.
    data_position: int = _key(0, valid=COUNT, absent="step")
    best_val_loss: float | None = _key(None, valid=_finite, session="best_val")
    best_val_step: int | None = _key(None, valid=COUNT, session="best_step")
    skipped_steps: int = _key(0, valid=COUNT, session="skipped")
    world_size: int = _key(1, valid=POSITIVE)
    seed: int = _key(0, valid=COUNT)
    preset: str | None = _key(None, valid=_name)
    # The micro-batch `auto` chose; None: the checkpoint predates its record, none to reuse.
    micro_batch_size: int | None = _key(None, valid=POSITIVE, written=TRAINED)
    # Parallel.name of the mode that wrote it; None: not recorded, which
    # train.parallel.mode_before_recorded reads as the one mode there was.
    parallel: str | None = _key(None, valid=_recorded("trainer_state.parallel"), written=TRAINED)
    # None: one micro-batch per process (older runs).
    tokens_per_step: int | None = _key(None, valid=POSITIVE, written=TRAINED)
    # None: taken to be the device the run resumes on. 'cpu' or the GPU's model, as its driver
    # names it: no list to check it against.
    device: str | None = _key(None, valid=_name, written=TRAINED)
    # The attention backend the run ran (a name of model.attention.BACKENDS, never auto); None:
    # not recorded, model.attention resolves afresh on resume. Left out while None, so that an
    # older checkpoint's file is written again byte for byte.
    attention: str | None = _key(None, valid=_recorded("trainer_state.attention"),
                                 written=TRAINED, omitted_while_none=True)
    # The precision the run computed in (train.precision as it resolved), to which a resume may
    # pin an `auto`; None: not recorded (older checkpoints), such a pin refused as any change.
    # Left out while None, so that an older checkpoint's file is written again byte for byte.
    precision: str | None = _key(None, valid=_precision, written=TRAINED,
                                 omitted_while_none=True)
    # Muon's Newton-Schulz precision (train.muon_ns_precision as it resolved), as `precision`
    # is recorded and for the same resumes; None: no Muon, or not recorded (older checkpoints).
    muon_ns_precision: str | None = _key(None, valid=_ns_precision, written=TRAINED,
                                         omitted_while_none=True)
    # The max_steps planned for; None: the run's config's.
    max_steps: int | None = _key(None, valid=POSITIVE, written=TRAINED)
    # The lr schedule as re-planned on a resume; None: the plain schedule.
    schedule_anchor: dict[str, Any] | None = _key(None, valid=ANCHOR, written=TRAINED,
                                                  session="schedule_anchor")
    # SpikeGuard.state_dict(); None: a fresh guard.
    spike_guard: dict[str, Any] | None = _key(None, valid=GUARD, written=TRAINED)
    # fp16's scaler state; None (or null: bf16 and fp32), a fresh scale. Left out while None,
    # so that other runs' files stay byte for byte as they were before it.
    loss_scaling: dict[str, Any] | None = _key(None, valid=SCALER, written=TRAINED,
                                               omitted_while_none=True)
    # The data the run read (loader.data_record), which a resume and eval compare with what
    # they find; None: not recorded (older runs, an import), nothing to compare. Left out while
    # None, so that an older checkpoint's file is written again byte for byte.
    data: list[dict[str, str]] | None = _key(None, valid=DATA, written=TRAINED,
                                             omitted_while_none=True)
    # An imported run's: the folder its weights came from, and the digest of its weights file.
    imported_from: str | None = _key(None, valid=_name, written=IMPORTED)
    imported_sha256: str | None = _key(None, valid=_hex, written=IMPORTED)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainerState:
        """Any trainer_state.json andrea has written; DamagedState (a ValueError) naming the key
        and value for anything else: a checkpoint is untrusted input, and a value of another
        type or range would fail deep in the run or, worse, be taken."""
        if not isinstance(raw, dict) or "step" not in raw:
            raise DamagedState("not a trainer state (no 'step')")
        values = {}
        for key in fields(cls):
            if key.name in raw:
                values[key.name] = _checked(key.name, raw[key.name], key.metadata["valid"])
            elif key.metadata["absent"] is not None:
                values[key.name] = values[key.metadata["absent"]]
            else:
                values[key.name] = key.default
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """trainer_state.json's content, its keys in their order: a trained run's, or an
        import's."""
        kind = TRAINED if self.imported_from is None else IMPORTED
        out = {}
        for key in fields(self):
            value = getattr(self, key.name)
            if key.metadata["written"] in (EVERY, kind) and not (
                    value is None and key.metadata["omitted_while_none"]):
                out[key.name] = value
        return out

    def to_json(self) -> bytes:
        """trainer_state.json's bytes."""
        return json.dumps(self.to_dict(), indent=1).encode("utf-8")

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


@functools.cache
def _declared_types() -> dict[str, tuple[type, bool]]:
    """Each TrainerState key's type as declared: (the type, whether null is allowed)."""
    out = {}
    for name, hint in typing.get_type_hints(TrainerState).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        kinds = [a for a in args if a is not type(None)]
        out[name] = (typing.get_origin(kinds[0]) or kinds[0], len(kinds) < len(args))
    return out


def _checked(name: str, value: Any, valid: Valid | None) -> Any:
    tp, nullable = _declared_types()[name]
    if value is None and nullable:
        return None
    must = None
    if not _is(value, tp):
        must = type_name(tp) + (" or null" if nullable else "")
    elif valid is not None:
        must = valid(value)
    if must is not None:
        raise DamagedState(f"'{name}' is {quoted(value)}, not {must}")
    return value


def another_intact(ckpt: Path) -> Path | None:
    """The newest checkpoint of ckpt's run other than ckpt that a resume takes."""
    return next((other for other in reversed(step_dirs(ckpt.parent)) if other.name != ckpt.name
                 and checkpoint_problem(other, for_resume=True) is None), None)


def read_state(ckpt: Path) -> TrainerState:
    """The checkpoint's TrainerState (trainer_state.json), checked against its checksum, and
    each key against its declaration."""
    path = ckpt / TRAINER_STATE
    try:
        blob = path.read_bytes()
        verify_file(path, blob)
        raw = json.loads(blob)
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable trainer state: {exc}") from None
    try:
        return TrainerState.from_dict(raw)
    except DamagedState as exc:
        other = another_intact(ckpt)
        way = (f"the newest other intact one is {other}: "
               f"{shlex.join(['andrea', 'train', '--resume', str(other)])}"
               if other is not None else "the run has no other intact one")
        raise UserError(f"{path}: {exc}; the checkpoint is damaged: resume from another step "
                        f"folder ({way})") from None
