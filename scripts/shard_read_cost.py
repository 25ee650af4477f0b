"""What reading the training's windows with os.pread costs against np.memmap (issue 51): the
per-step read time of `train_batch` (every micro-batch of one optimizer step on one process),
each window read with os.pread and each shard a batch read checked with os.stat
(`ShardFile`), against the same windows sliced from np.memmap as before, on a synthetic
prepared folder (uint16 tokens, the page cache warm, as in a training past its first pass).

    python scripts/shard_read_cost.py [DIR]   # DIR: where to write (default: a temporary one)

Prints the CPU's model name and one line per batch shape: the median over STEPS steps.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from andrea.data import loader, shards
from andrea.data.verify import range_problem
from andrea.resources import cpu_name

SHARD_TOKENS = 50_000_000  # data.shard_tokens' default
SHARDS = 2
STEPS = 200
# (label, micro-batch windows, block_size, accumulation steps): the presets' steps on one
# process (andrea-12m on a CPU: 16 x 256 x 2; andrea-120m: 0.5M tokens as 16 x 1024 x 32).
SHAPES = [("andrea-tiny: 8 x 64, 1 micro-batch", 8, 64, 1),
          ("andrea-12m: 16 x 256, 2 micro-batches", 16, 256, 2),
          ("andrea-120m: 16 x 1024, 32 micro-batches", 16, 1024, 32)]


def write_folder(out: Path) -> Path:
    """SHARDS train shards of SHARD_TOKENS random byte-vocabulary tokens, and a manifest."""
    rng = np.random.default_rng(0)
    entries = []
    for k in range(SHARDS):
        name = shards.shard_name("train", k)
        writer = shards.ShardWriter(out / name, shards.token_dtype(257), "byte:v1")
        for _ in range(SHARD_TOKENS // 10_000_000):
            writer.write(rng.integers(0, 257, size=10_000_000))
        entries.append({"file": name, "tokens": writer.close().count})
    manifest = {"manifest_version": shards.MANIFEST_VERSION,
                "tokenizer": {"kind": "byte", "identity": "byte:v1", "vocab_size": 257,
                              "eot_id": 256},
                "shards": {"train": entries, "val": []}}
    (out / shards.MANIFEST).write_text(json.dumps(manifest))
    return out


class MappedSplit(loader.TokenSplit):
    """The split as read before: each shard an np.memmap, sliced, never checked."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir, "train")
        self.mapped = [np.memmap(p, dtype=s.dtype, mode="r", offset=shards.HEADER_BYTES,
                                 shape=(len(s),)) for p, s in zip(self.paths, self.shards,
                                                                  strict=True)]

    def tokens(self, shard: int, start: int, length: int) -> np.ndarray:
        window = np.asarray(self.mapped[shard][start : start + length], dtype=np.int64)
        assert range_problem(window, self.vocab_size, start) is None
        return window

    def check_unchanged(self) -> None:
        pass


def step_seconds(split: loader.TokenSplit, windows: int, block: int, accum: int) -> float:
    """The median time of one optimizer step's micro-batches, over STEPS steps."""
    times = []
    for step in range(STEPS):
        t = time.perf_counter()
        for micro in range(accum):
            loader.train_batch(split, seed=0, step=step, micro_step=micro, rank=0,
                               accum_steps=accum, world_size=1, micro_batch_size=windows,
                               block_size=block)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    print(f"CPU: {cpu_name()}")
    with tempfile.TemporaryDirectory(dir=sys.argv[1] if len(sys.argv) > 1 else None) as tmp:
        data = write_folder(Path(tmp))
        pread, mapped = loader.TokenSplit(data, "train"), MappedSplit(data)
        for path in pread.paths:  # the page cache warm
            path.read_bytes()
        for label, windows, block, accum in SHAPES:
            args = dict(seed=1, step=7, micro_step=0, rank=0, accum_steps=accum, world_size=1,
                        micro_batch_size=windows, block_size=block)
            same = all(torch.equal(a, b) for a, b in zip(
                loader.train_batch(pread, **args), loader.train_batch(mapped, **args),
                strict=True))
            step_mapped = step_seconds(mapped, windows, block, accum)
            step_pread = step_seconds(pread, windows, block, accum)
            print(f"{label}: memmap {1e3 * step_mapped:.3f} ms a step, pread + stat "
                  f"{1e3 * step_pread:.3f} ms (+{1e6 * (step_pread - step_mapped):.0f} us, "
                  f"x{step_pread / step_mapped:.2f}); batches identical: {same}", flush=True)


if __name__ == "__main__":
    main()
