"""Shard bytes per input byte of `andrea prepare`, per tokenizer: what andrea.data.stops'
estimate (the free-space warning) is built from.

    python scripts/prepare_size.py [INPUT ...]     (default: shakespeare)

For each input (anything --input takes) and tokenizer (byte, gpt2, bpe of 4,096 and 32,768 ids)
it prepares into a temporary folder with one worker and prints the input's bytes, the shards'
bytes, their ratio and tokens per input byte; then, for the first input's text, how much gzip
(-6), zstd (-3) and Parquet (pyarrow's default) shrink it. Deletes what it wrote.
"""

from __future__ import annotations

import gzip
import sys
import tempfile
from pathlib import Path

from andrea.data import prepare
from andrea.data.documents import documents
from andrea.data.shards import read_manifest
from andrea.resources import cpu_name

TOKENIZERS = (("byte", None), ("gpt2", None), ("bpe", 4096), ("bpe", 32768))


def measure(source: str, tmp: Path) -> None:
    size = sum(d.size for d in documents(source, None, say=lambda line: None))
    for kind, vocab in TOKENIZERS:
        out = tmp / f"{kind}{vocab or ''}"
        prepare.prepare_inputs(source, kind, out, vocab_size=vocab, verbose=False, workers=1)
        shards = sum(p.stat().st_size for p in out.glob("*.bin"))
        tokens = sum(read_manifest(out)["tokens"].values())
        print(f"{source}: {kind}{'-' + str(vocab) if vocab else ''}: input {size:,} B, shards "
              f"{shards:,} B, {shards / size:.3f} shard bytes and {tokens / size:.3f} tokens "
              "per input byte", flush=True)


def compression(source: str, tmp: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = documents(source, None, say=lambda line: None)
    text = b"".join(d.open().read() if hasattr(d, "open") else Path(d.path).read_bytes()
                    for d in docs)
    pq.write_table(pa.table({"text": text.decode("utf-8", "replace").split("\n\n")}),
                   tmp / "t.parquet")
    print(f"{source}: text {len(text):,} B; stored bytes per text byte: gzip -6 "
          f"{len(gzip.compress(text, 6)) / len(text):.3f}, zstd -3 "
          f"{len(zstandard.ZstdCompressor(level=3).compress(text)) / len(text):.3f}, Parquet "
          f"{(tmp / 't.parquet').stat().st_size / len(text):.3f}")


def main() -> None:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return
    sources = sys.argv[1:] or ["shakespeare"]
    print(f"CPU: {cpu_name()}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, source in enumerate(sources):
            measure(source, Path(tmp) / str(i))
        compression(sources[0], Path(tmp))


if __name__ == "__main__":
    main()
