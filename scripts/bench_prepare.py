"""`andrea prepare` on a generated JSONL and Parquet corpus, beside the bare tokenizer.

    python scripts/bench_prepare.py [--mb 1024] [--workers 1 2] [--rounds 3] [--tmp /tmp]

Generates about MB megabytes of text as JSON Lines and as Parquet (the same documents: random
runs of lines of the embedded Shakespeare corpus, 1-8 KB each) under --tmp, then, round after
round, for each worker count W:
  - bare: tiktoken gpt2 `encode_ordinary_batch(docs, num_threads=W)` over the same documents,
    read beforehand in batches of 1,000 (only the encode calls are timed);
  - andrea prepare -t gpt2 --workers W on the JSONL file, then on the Parquet file (the real
    command in a subprocess, wall time, output deleted after each run).
Rates are MB of UTF-8 document text per second, the same numerator for all three. Peak RSS is
the largest sum of RSS over the command's process tree, sampled every 0.1 s from /proc. The
inputs are deleted at the end. Prints the CPU's model name; quote medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from andrea.resources import cpu_name

BATCH_DOCS = 1000


def generate(folder: Path, target_bytes: int) -> tuple[Path, Path, int, int]:
    """JSONL and Parquet files of the same documents; returns them, their text bytes and the
    document count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from andrea.data.corpus import shakespeare

    lines = [ln for _, text in shakespeare() for ln in text.splitlines() if ln.strip()]
    rng = random.Random(0)
    jsonl, parquet = folder / "bench.jsonl", folder / "bench.parquet"
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    text_bytes, n = 0, 0
    with open(jsonl, "w", encoding="utf-8") as fj, pq.ParquetWriter(parquet, schema) as fp:
        while text_bytes < target_bytes:
            docs = []
            for _ in range(BATCH_DOCS):
                start = rng.randrange(len(lines) - 200)
                doc = "\n".join(lines[start : start + rng.randint(30, 200)])
                docs.append(doc)
                text_bytes += len(doc.encode("utf-8"))
            fj.write("".join(json.dumps({"id": n + i, "text": d}) + "\n"
                             for i, d in enumerate(docs)))
            fp.write_table(pa.table({"id": list(range(n, n + len(docs))), "text": docs},
                                    schema=schema))
            n += len(docs)
    return jsonl, parquet, text_bytes, n


def tree_rss(root: int) -> int:
    """Sum of RSS (bytes) of `root` and its descendants, from /proc."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
            rss[int(entry)] = int(fields[21]) * page
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack += [p for p, parent in parents.items() if parent == pid]
    return total


TOKENS = re.compile(r"([\d,]+) train \+ ([\d,]+) val tokens")


def run_andrea(input_path: Path, workers: int, out: Path) -> tuple[float, int, int]:
    """Wall seconds, peak tree RSS and tokens written of `andrea prepare` on one input."""
    cmd = [sys.executable, "-m", "andrea", "prepare", "-i", str(input_path), "-t", "gpt2",
           "-o", str(out), "--workers", str(workers), "--force"]
    peak = 0
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"andrea prepare failed ({proc.returncode}): {stderr[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)
    counts = TOKENS.search(stdout)
    tokens = sum(int(g.replace(",", "")) for g in counts.groups()) if counts else 0
    return seconds, peak, tokens


def run_bare(jsonl: Path, workers: int) -> float:
    """Seconds tiktoken's encode_ordinary_batch takes over every document, in batches."""
    from andrea.data.tokenizer import Gpt2Tokenizer

    enc = Gpt2Tokenizer()._enc
    seconds = 0.0
    with open(jsonl, encoding="utf-8") as f:
        while True:
            docs = [json.loads(line)["text"] for _, line in zip(range(BATCH_DOCS), f,
                                                                 strict=False)]
            if not docs:
                break
            start = time.perf_counter()
            enc.encode_ordinary_batch(docs, num_threads=workers)
            seconds += time.perf_counter() - start
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024, help="text megabytes to generate")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    args = ap.parse_args()
    print(f"cpu: {cpu_name()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")
    free = shutil.disk_usage(args.tmp).free
    need = args.mb * (1 << 20) * 3
    if free < need:
        raise SystemExit(f"{args.tmp}: {free / 2**30:.1f} GiB free, need about "
                         f"{need / 2**30:.1f} GiB")
    folder = Path(tempfile.mkdtemp(prefix="bench-prepare-", dir=args.tmp))
    try:
        t = time.perf_counter()
        jsonl, parquet, text_bytes, n = generate(folder, args.mb * (1 << 20))
        mb = text_bytes / 1e6
        print(f"generated {n:,} documents, {mb:,.0f} MB of text in {time.perf_counter() - t:.0f}"
              f" s: JSONL {jsonl.stat().st_size / 1e6:,.0f} MB, Parquet "
              f"{parquet.stat().st_size / 1e6:,.0f} MB")
        rates: dict[tuple[str, int], list[float]] = {}
        peaks: dict[tuple[str, int], list[int]] = {}
        for r in range(args.rounds):
            for w in args.workers:
                secs = run_bare(jsonl, w)
                rates.setdefault(("bare", w), []).append(mb / secs)
                for name, path in (("jsonl", jsonl), ("parquet", parquet)):
                    secs, peak, tokens = run_andrea(path, w, folder / "out")
                    rates.setdefault((name, w), []).append(mb / secs)
                    peaks.setdefault((name, w), []).append(peak)
                line = ", ".join(f"{k} {rates[(k, w)][-1]:.2f}" for k in
                                 ("bare", "jsonl", "parquet"))
                print(f"round {r + 1} workers={w}: MB/s {line}; peak RSS jsonl "
                      f"{peaks[('jsonl', w)][-1] / 2**20:,.0f} MiB, parquet "
                      f"{peaks[('parquet', w)][-1] / 2**20:,.0f} MiB", flush=True)
        print(f"\nmedians over {args.rounds} rounds ({mb:,.0f} MB of text, {tokens:,} gpt2 "
              f"tokens incl. end-of-text: {text_bytes / max(1, tokens):.2f} bytes/token):")
        for w in args.workers:
            bare = statistics.median(rates[("bare", w)])
            for name in ("jsonl", "parquet"):
                rate = statistics.median(rates[(name, w)])
                peak = max(peaks[(name, w)]) / 2**20
                print(f"  workers={w} {name:8s} {rate:6.2f} MB/s = {rate / bare:5.1%} of bare "
                      f"tiktoken ({bare:.2f} MB/s); peak RSS {peak:,.0f} MiB")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
