"""Encoding throughput (MB/s of UTF-8 input) of `gpt2` and `bpe` on the embedded Shakespeare
corpus, with 1 and 2 worker processes, through the same chunked pipeline `andrea prepare` uses.

    python scripts/bench_tokenize.py [--workers 1 2] [--repeat 2]

BPE training (4,096 ids) is timed once on its own; worker start-up is included in each figure.
The first line names the CPU the figures are of.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from andrea.data import documents, encode
from andrea.data.folder import scratch_name
from andrea.data.tokenizer import load_tokenizer, train_bpe
from andrea.resources import cpu_name

SETTINGS = documents.Settings(val_fraction=0.1, text_field="text", errors="strict")


def encode_seconds(docs, kind: str, data_dir: Path, workers: int) -> tuple[float, int]:
    start = time.perf_counter()
    n = 0
    jobs = documents.all_jobs(docs, 0.1, "text", 0, data_dir / scratch_name())
    tok = load_tokenizer(kind, data_dir)
    for _, result in encode.encode_all(jobs, SETTINGS, tok, data_dir, "<u2", workers):
        n += 0 if result is None else sum(len(t) for t in result[0].values())
    return time.perf_counter() - start, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=2, help="best of this many runs")
    args = ap.parse_args()
    docs = documents.documents(documents.SHAKESPEARE)
    mb = sum(d.size for d in docs) / 1e6
    print(f"cpu: {cpu_name()}, {os.cpu_count()} cores; corpus: {len(docs)} plays, {mb:.2f} MB")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        texts = encode.train_texts(docs, SETTINGS, Path(tmp) / scratch_name())
        train_bpe(texts, 4096, Path(tmp) / "tokenizer.json")
        print(f"bpe training (4,096 ids, train split): {time.perf_counter() - t:.2f} s")
        for kind in ("gpt2", "bpe"):
            for workers in args.workers:
                runs = [encode_seconds(docs, kind, Path(tmp), workers) for _ in range(args.repeat)]
                secs, tokens = min(runs)
                print(
                    f"{kind:5s} workers={workers}: {mb / secs:6.2f} MB/s  "
                    f"({tokens:,} tokens in {secs:.2f} s)"
                )


if __name__ == "__main__":
    main()
