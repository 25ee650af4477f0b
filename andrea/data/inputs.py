"""Which files an input names (`--input` / data.source): a file, a directory (every file of a
known format below it), a glob, or a Hugging Face `datasets` save_to_disk folder; and what the
manifest records of each (its identity), so a changed file is noticed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from andrea.data.readers import BY_KIND, BY_SUFFIX, COMPRESSIONS, READERS, InputFile
from andrea.errors import UserError

DATASETS_STATE = "state.json"  # marks a `datasets` save_to_disk folder
DATASETS_DICT = "dataset_dict.json"  # marks a saved DatasetDict (one folder per split)
SAMPLE_BYTES = 1 << 20  # the input identity hashes this much at the start, middle and end


def source_last_part(source: str) -> str:
    """A source as configured (a file, folder or glob) by its last part, `data/wiki/` ->
    `wiki`: what `andrea eval --source` accepts besides the whole path, and what tables and
    legends show of it."""
    return source.rstrip("/").rsplit("/", 1)[-1]


def file_kind(path: Path) -> tuple[str | None, str]:
    """(kind, compression) from the file name; kind None for a name no reader claims."""
    name = path.name.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    suffix = Path(name.removesuffix(compression)).suffix if compression else path.suffix.lower()
    reader = BY_SUFFIX.get(suffix)
    if reader is None or (compression and not reader.compressible):
        return None, compression
    return reader.kind, compression


def _described() -> str:
    return ", ".join(s for r in READERS if r.in_folders for s in r.suffixes) + " (+.gz/.zst)"


def _datasets_files(folder: Path) -> list[Path]:
    """The Arrow files of a `datasets` save_to_disk folder (its 'train' split for a
    DatasetDict), in the order state.json lists them."""
    if (folder / DATASETS_DICT).is_file():
        try:
            splits = json.loads((folder / DATASETS_DICT).read_text("utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            raise UserError(f"{folder / DATASETS_DICT}: unreadable DatasetDict index") from None
        if "train" not in splits:
            raise UserError(
                f"{folder}: saved DatasetDict has no 'train' split (it has: {', '.join(splits)}); "
                f"point --input at {folder}/<split>"
            )
        folder = folder / "train"
    state = folder / DATASETS_STATE
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text("utf-8"))["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(
            f"{state}: not a `datasets` save_to_disk state (no _data_files list)"
        ) from None
    files = [folder / n for n in names]
    for f in files:
        if not f.is_file():
            raise UserError(f"{f}: listed in {state} but missing")
    return files


def _is_datasets_folder(folder: Path) -> bool:
    return (folder / DATASETS_STATE).is_file() or (folder / DATASETS_DICT).is_file()


def _walk(root: Path, exclude: Callable[[Path], bool]) -> list[Path]:
    """Every regular file of a known format below `root`, hidden ones and excluded folders
    skipped. A FIFO, socket or device is skipped without a word, as a glob skips it: opening a
    FIFO nobody writes to blocks forever, and none of them holds a corpus."""
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                         and not exclude(Path(here) / d))
        # The name test first, so only files a reader claims cost a stat.
        found += [Path(here) / n for n in names if not n.startswith(".")
                  and _in_folders(file_kind(Path(n))[0]) and (Path(here) / n).is_file()]
    return sorted(found)


def _in_folders(kind: str | None) -> bool:
    return kind is not None and BY_KIND[kind].in_folders


def input_files(spec: str, exclude: Callable[[Path], bool] | None = None) -> list[InputFile]:
    """The files `spec` names: a file, a directory (every file of a known format in it,
    recursively, hidden ones skipped), a glob, or a `datasets` save_to_disk folder; sorted.
    `exclude(folder)`: True for a folder whose files are not input (prepared data)."""
    verdicts: dict[Path, bool] = {}

    def excluded(folder: Path) -> bool:
        if folder not in verdicts:
            verdicts[folder] = exclude is not None and exclude(folder)
        return verdicts[folder]

    path = Path(spec)
    if path.is_file():
        paths = [path]
    elif path.is_dir() and _is_datasets_folder(path):
        paths = _datasets_files(path)
    elif path.is_dir():
        if excluded(path):
            raise UserError(
                f"{spec}: this folder is prepared data (andrea shards, a manifest or progress "
                "record) or the output folder, not input; point --input at the text"
            )
        paths = _walk(path, excluded)
        if not paths:
            raise UserError(
                f"{spec}: directory has no input files ({_described()}); "
                "point --input at a file or a glob"
            )
    elif glob.has_magic(spec):
        matched = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        paths = [p for p in matched if not any(excluded(d) for d in _parents_below(p, spec))]
        if not paths:
            raise UserError(f"{spec}: the pattern matches no files; check the path and quoting")
    elif path.exists():
        raise UserError(f"{spec}: not a regular file: {_special_kind(path)}; "
                        "point --input at a file, a folder or a glob of text")
    else:
        raise UserError(f"{spec}: no such file or directory")
    files = []
    for p in paths:
        kind, compression = file_kind(p)
        try:
            st = p.stat()
        except OSError as exc:
            raise UserError(f"{p}: cannot read input: {exc.strerror}") from None
        # A file named explicitly (or by a glob) with no known extension is read as text.
        files.append(InputFile(p.resolve(), kind or "text", compression, st.st_size,
                               st.st_mtime_ns))
    return files


def _special_kind(path: Path) -> str:
    """What a path that exists but is neither a regular file nor a folder is, in words."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return "unreadable"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file or folder"


def names_anything(spec: str) -> bool:
    """Whether an input spec names something here (a file, a folder, a glob's match), without
    reading it."""
    return Path(spec).exists() or (glob.has_magic(spec) and bool(glob.glob(spec, recursive=True)))


def _parents_below(path: Path, spec: str) -> list[Path]:
    """The folders from a file a glob matched up to the glob's fixed start, nearest first."""
    prefix = spec[: min((spec.find(c) for c in "*?[" if c in spec), default=len(spec))]
    base = Path(prefix) if prefix.endswith(("/", os.sep)) else Path(prefix).parent
    out = []
    for d in path.parents:
        out.append(d)
        if d == base:
            break
    return out


def input_identity(f: InputFile) -> dict[str, Any]:
    """What the manifest records of an input: size, mtime and a hash of a sample (start,
    middle, end), so a changed file is noticed without reading tens of GB."""
    digest = hashlib.sha256()
    try:
        with open(f.path, "rb") as fh:
            for start in sorted({0, max(0, f.size // 2 - SAMPLE_BYTES // 2),
                                 max(0, f.size - SAMPLE_BYTES)}):
                fh.seek(start)
                digest.update(fh.read(SAMPLE_BYTES))
    except OSError as exc:
        raise UserError(f"{f.path}: cannot read input: {exc.strerror}") from None
    return {"name": f.name, "bytes": f.size, "mtime_ns": f.mtime_ns,
            "sample_sha256": digest.hexdigest()}
