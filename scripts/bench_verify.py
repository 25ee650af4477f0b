"""What checking shard checksums costs (docs/data.md, "Checksums"): first the hash candidates
of the standard library on 256 MiB (GB/s on one core, best of 3), then a folder of GB gigabytes
of uint16 shards (random ids; shard_tokens as prepare's default) written with ShardWriter: the
CRC-32's share of writing, `andrea prepare --verify`'s whole pass, and the training's background
check.

    python scripts/bench_verify.py [--gb 1] [--dir /tmp/bench-verify]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
import zlib
from pathlib import Path

import numpy as np

from andrea.data import shards
from andrea.data.verify import BackgroundCheck, verify_folder

SHARD_TOKENS = 50_000_000  # data.shard_tokens' default: 100 MB a uint16 shard
VOCAB = 50_257


def candidates() -> None:
    blob = memoryview(os.urandom(256 << 20))
    step = 8 << 20

    def crc32() -> None:
        c = 0
        for i in range(0, len(blob), step):
            c = zlib.crc32(blob[i : i + step], c)

    def adler32() -> None:
        c = 1
        for i in range(0, len(blob), step):
            c = zlib.adler32(blob[i : i + step], c)

    def digest(name: str):
        def run() -> None:
            h = hashlib.new(name)
            for i in range(0, len(blob), step):
                h.update(blob[i : i + step])
            h.digest()
        return run

    for name, run in [("crc32", crc32), ("adler32", adler32), ("sha256", digest("sha256")),
                      ("blake2b", digest("blake2b"))]:
        best = min(_seconds(run) for _ in range(3))
        print(f"{name:8s} {len(blob) / best / 1e9:.2f} GB/s")


def _seconds(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def write_folder(out: Path, gb: float) -> tuple[float, float]:
    """A prepared-looking folder of `gb` GB of train shards and one val shard; (seconds writing,
    seconds of them in the CRC-32)."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    total = int(gb * 1e9) // 2
    entries: dict[str, list] = {"train": [], "val": []}
    t_write = t_crc = 0.0
    k = 0
    while total > 0:
        n = min(SHARD_TOKENS, total)
        split = "val" if total <= SHARD_TOKENS and k else "train"
        file = f"{split}_{len(entries[split]):06d}.bin"
        tokens = rng.integers(0, VOCAB, n, dtype=np.uint16)
        t0 = time.perf_counter()
        w = shards.ShardWriter(out / file, np.dtype("<u2"), "bench:v1")
        for start in range(0, n, 1 << 20):  # prepare writes per encoded job, about 1 MiB
            w.write(tokens[start : start + (1 << 20)])
        entries[split].append({"file": file, "tokens": w.close().count, "checksum": w.checksum})
        t_write += time.perf_counter() - t0
        blob = tokens.tobytes()
        t0 = time.perf_counter()
        zlib.crc32(blob)
        t_crc += time.perf_counter() - t0
        total -= n
        k += 1
    manifest = {"manifest_version": shards.MANIFEST_VERSION, "shard_checksum": shards.CHECKSUM,
                "tokenizer": {"kind": "gpt2", "identity": "bench:v1", "vocab_size": VOCAB,
                              "eot_id": 0},
                "shards": entries}
    (out / shards.MANIFEST).write_text(json.dumps(manifest))
    return t_write, t_crc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/bench-verify")
    args = ap.parse_args()
    candidates()
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    t_write, t_crc = write_folder(out, args.gb)
    size = sum(p.stat().st_size for p in out.glob("*.bin"))
    print(f"wrote {size / 1e9:.2f} GB in {t_write:.2f} s; its CRC-32 alone {t_crc:.2f} s "
          f"({size / 1e9 / t_crc:.2f} GB/s)")
    t0 = time.perf_counter()
    print(verify_folder(out))
    t_verify = time.perf_counter() - t0
    print(f"prepare --verify: {t_verify:.2f} s ({size / 1e9 / t_verify:.2f} GB/s, page cache warm)")
    manifest = json.loads((out / shards.MANIFEST).read_text())
    items = [(out / e["file"], e) for s in shards.SPLITS for e in manifest["shards"][s]]
    t0 = time.perf_counter()
    check = BackgroundCheck(items)
    started = time.perf_counter() - t0
    check.wait()
    print(f"background check: started in {1e3 * started:.2f} ms, all {len(items)} shards in "
          f"{check.seconds:.2f} s")
    shutil.rmtree(out)


if __name__ == "__main__":
    main()
