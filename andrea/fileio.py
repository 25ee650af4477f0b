"""Writing files so that a crash never leaves a half-written one under the real name."""

from __future__ import annotations

import errno
import math
import os
import shutil
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary name beside `path`, flush and fsync, then rename over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


# A full disk and an exhausted quota look alike to whoever writes: no byte more fits.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def file_in_the_way(folder: Path) -> str | None:
    """Why `folder` cannot be made where a file stands in its place or in that of a folder
    above it (mkdir's "File exists" or "Not a directory" would not say which file, or that it
    is one), in the words every verb gives it; None when no file does."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()),
                   None)
    if blocker is None:
        return None
    return f"{blocker} is a file, not a folder; move it away or choose another folder"


def is_disk_full(exc: BaseException) -> bool:
    """True for the OSError of a write that found no space (a full disk, an exhausted quota)."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def free_bytes(path: Path) -> int:
    """Bytes an ordinary user may still write on the filesystem that holds `path` (or will hold
    it: its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def size_text(n: float) -> str:
    """A byte count for a message, in powers of 1024 as `df -h` counts: 512 B, 80.0 MiB."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    step = 0
    while abs(n) >= 1024 and step < len(units) - 1:
        n, step = n / 1024, step + 1
    return f"{n:.0f} B" if step == 0 else f"{n:.1f} {units[step]}"


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (a diverged run's NaN loss) made None, nested dicts
    and lists included: json.dumps would write NaN, which is not JSON and jq refuses."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
