"""What a checkpoint's checksums cost (issue 41): sha256 of the bytes as save_checkpoint writes
them, and of the file as a reader checks it (page cache warm, as after a copy), against the
write itself (atomic_write_bytes: write, fsync, rename), for synthetic files the size of the
12M preset's checkpoint and of a 120M model's.

    python scripts/checksum_cost.py [DIR]     # DIR: where to write (default: a temporary one)
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

from andrea.fileio import atomic_write_bytes
from andrea.resources import cpu_name
from andrea.train.rundir import file_sha256

SIZES = [("12M preset checkpoint (weights + AdamW)", 300 << 20),
         ("120M model.safetensors (fp32)", 124_000_000 * 4),
         ("120M checkpoint (weights + AdamW)", 3 * 124_000_000 * 4)]


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    print(f"CPU: {cpu_name()}")
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as tmp:
        path = Path(tmp) / "blob.safetensors"
        for label, nbytes in SIZES:
            blob = os.urandom(nbytes)
            t = time.perf_counter()
            atomic_write_bytes(path, blob)
            write = time.perf_counter() - t
            t = time.perf_counter()
            hashlib.sha256(blob).hexdigest()
            written = time.perf_counter() - t
            file_sha256(path)  # the page cache warm
            t = time.perf_counter()
            file_sha256(path)
            read = time.perf_counter() - t
            print(f"{label}: {nbytes / 2**20:,.0f} MiB; write+fsync {write:.2f} s; sha256 of "
                  f"the bytes written {written:.2f} s ({nbytes / written / 2**20:,.0f} MiB/s); "
                  f"of the file {read:.2f} s ({nbytes / read / 2**20:,.0f} MiB/s)")
            path.unlink()
            del blob


if __name__ == "__main__":
    main()
