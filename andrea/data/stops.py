"""How a prepare stops short of its manifest, and the disk space it needs.

Whatever ends a prepare early (Ctrl-C, SIGTERM, a full disk, bad input, a crash) leaves every
complete shard and the progress record that lists them (`folder.keep_complete`), so the same
command continues from there; only the shard still being written goes. What the user sees is one
line: what was kept and how to go on. Before any shard is written, the shards' size is estimated
from the inputs' and a disk with less free space than that gets a one-line warning.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from andrea.data.documents import Input
from andrea.data.readers import InputFile
from andrea.data.shards import token_dtype
from andrea.data.tokenizer import KINDS
from andrea.errors import UserError, counted
from andrea.fileio import free_bytes, size_text

# Bytes of text per byte of a compressed input, measured on Shakespeare: gzip -6 2.56, zstd -3
# 2.61, Parquet (snappy, pyarrow's default) 1.55.
EXPANSION = {".gz": 2.6, ".zst": 2.6}
PARQUET_EXPANSION = 1.6


def _text_bytes(doc: Input) -> float:
    if not isinstance(doc, InputFile):
        return doc.size  # the embedded corpus: text as it is
    if doc.compression:
        return doc.size * EXPANSION.get(doc.compression, 1.0)
    return doc.size * (PARQUET_EXPANSION if doc.kind == "parquet" else 1.0)


def estimate_bytes(docs: list[Input], kind: str, vocab_size: int | None) -> int:
    """About how many bytes the shards of `docs` take with tokenizer `kind`: the text's bytes
    times tokens per text byte times bytes per id (uint16, or uint32 for a BPE of over 65,536
    ids). A BPE read from a tokenizer.json (`vocab_size` None) is taken as uint16."""
    known = KINDS.get(kind)
    ids = (known.fixed_vocab if known else None) or vocab_size or 2**16
    per_token = token_dtype(ids).itemsize
    per_byte = known.tokens_per_text_byte if known else 1.0
    return int(sum(map(_text_bytes, docs)) * per_byte * per_token)


def warn_if_short(out: Path, needed: int, kind: str, resuming: bool) -> None:
    """One warning line on stderr when the disk holding `out` has less free space than the
    `needed` bytes the shards still take; the prepare goes on (a full disk keeps its work)."""
    free = free_bytes(out)
    if free >= needed:
        return
    rest = "the rest of the shards needs" if resuming else "the shards need"
    print(f"warning: {out}: {rest} about {size_text(needed)} (estimated from the input size for "
          f"tokenizer {kind}) but the disk has {size_text(free)} free; a full disk stops the "
          "prepare, keeping its complete shards", file=sys.stderr, flush=True)


def rerun_command() -> str:
    """The command that continues a stopped prepare, quoted: this process's own command line."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "the same torchrun command"
    argv0 = Path(sys.argv[0])
    if argv0.name == "andrea" or argv0.parent.name == "andrea":
        return f"`{shlex.join(['andrea', *sys.argv[1:]])}`"
    return "the same command"


def kept_words(out: Path, count: int, tokens: int) -> str:
    if not count:
        return f"{out} had no complete shard yet; nothing is kept"
    return f"{out} keeps {counted(count, 'complete shard')} ({tokens:,} tokens)"


def stopped_line(exc: BaseException, out: Path, count: int, tokens: int) -> str:
    """What a signal (or a KeyboardInterrupt) that stopped a prepare leaves, as one line."""
    signum = getattr(exc, "signum", signal.SIGINT)
    head = "interrupted" if signum == signal.SIGINT else \
        f"stopped by {signal.Signals(signum).name}"
    tail = "; run the same command again to continue from there" if count else ""
    return f"{head}: {kept_words(out, count, tokens)}{tail}"


def disk_full_error(
    exc: OSError, out: Path, count: int, tokens: int, rest: int
) -> UserError:
    """A full disk as the one line the CLI prints: the file being written, the space free, the
    space the rest needs (`rest` bytes, estimated), what is kept and the command that continues."""
    what = exc.filename or out
    return UserError(
        f"{out}: disk full writing {what} ({size_text(free_bytes(out))} free; the rest of the "
        f"shards needs about {size_text(rest)}); {kept_words(out, count, tokens)}: free space "
        f"(or choose a data folder on a larger disk) and run {rerun_command()} to continue"
    )


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT to `andrea prepare`: a KeyboardInterrupt, so the prepare stops as on
    Ctrl-C (its complete shards kept), with the signal's number for the exit code and message."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """For the `andrea prepare` verb: the first SIGINT or SIGTERM stops the prepare as Ctrl-C
    does and the process exits 128 + the signal (130, 143); a second one ends it at once,
    which loses nothing either (the complete shards and their record are already on disk)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handle(signum: int, frame: object) -> None:
        if received:
            os.write(2, f"second signal ({signal.Signals(signum).name}): exiting now; the "
                        "complete shards stay\n".encode())
            os._exit(128 + signum)
        received.append(signum)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except Stopped as stop:
        raise SystemExit(128 + stop.signum) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
