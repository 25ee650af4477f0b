"""The data folder: what a prepare may remove from it, and the folders it created."""

from __future__ import annotations

from pathlib import Path

from andrea.data.documents import SCRATCH
from andrea.data.shards import MANIFEST
from andrea.data.tokenizer import BPE_FILE

PROGRESS = "progress.json"  # an unfinished prepare's complete shards and where to go on


def clear(out: Path) -> None:
    """Remove what a previous prepare wrote (the manifest first: it is the 'complete' mark)."""
    (out / MANIFEST).unlink(missing_ok=True)
    (out / PROGRESS).unlink(missing_ok=True)
    for pattern in ("train_*.bin", "val_*.bin", "*.tmp", BPE_FILE, SCRATCH):
        for p in out.glob(pattern):
            p.unlink()


def remove_unlisted(out: Path, keep: set[str]) -> None:
    """Before resuming: drop partial shards (*.tmp) and shards no progress record lists."""
    for pattern in ("train_*.bin", "val_*.bin", "*.tmp", SCRATCH):
        for p in out.glob(pattern):
            if p.name not in keep:
                p.unlink()


def missing_dirs(out: Path) -> list[Path]:
    """`out` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for p in (out, *out.absolute().parents):
        if p.exists():
            break
        missing.append(p)
    return missing



def remove_empty(dirs: list[Path]) -> None:
    """Remove the folders a failed prepare created, deepest first, if they are empty."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return

