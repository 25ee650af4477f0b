"""Checking prepared shards against their manifest: `andrea prepare --verify DIR`
(`verify_folder`), and a training's check of every shard it reads (`BackgroundCheck`).

A shard is damaged when its header or size is wrong (shards.read_header), when its token bytes
no longer have the CRC-32 the manifest recorded as prepare wrote them, or, in a folder prepared
before checksums were recorded, when it holds an id the tokenizer does not have. The loader
checks every batch's ids on the host as well (data.loader), so an id out of range never reaches
the embedding even before a shard's checksum is known.
"""

from __future__ import annotations

import shlex
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from andrea.data.request import prepare_argv, recorded_command
from andrea.data.shards import (
    CHECKSUM,
    HEADER_BYTES,
    MANIFEST,
    SPLITS,
    DamagedFolder,
    DamagedShard,
    crc32_text,
    open_shard,
    read_header,
    read_manifest,
)
from andrea.errors import UserError, counted
from andrea.fileio import size_text

READ_BYTES = 8 << 20  # a shard is hashed in reads of this size (zlib and reads free the GIL)


def remedy(path: Path) -> str:
    """How to go on from a damaged shard: a folder with a shard missing is prepared anew, from
    the same inputs, keeping its tokenizer, by whatever prepares it next (request.stale): the
    command it records, or a training run again."""
    return (f"delete it (`rm {shlex.quote(str(path))}`) and prepare {path.parent} again from "
            f"the same inputs, keeping its tokenizer: {again(path.parent)} (a training's own "
            "command, run again, does the same; --resume continues it)")


def again(folder: Path) -> str:
    """The command that prepares `folder` again (request.recorded_command), or words for it."""
    return recorded_command(folder) or "the command that prepared it"


def token_crc32(path: Path) -> str:
    """The CRC-32 of a shard's token bytes (everything after its header), 8 hex digits."""
    crc = 0
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc32_text(crc)


def checksum_problem(path: Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with the shard's token bytes, by the checksum its manifest entry records
    (None when they match, or when the entry records none)."""
    want = entry.get("checksum")
    if want is None:
        return None
    try:
        got = token_crc32(path)
    except OSError as exc:
        return f"cannot read token shard: {exc.strerror}"
    if got != want:
        return (f"checksum mismatch ({CHECKSUM} of its tokens is {got}, {MANIFEST} records "
                f"{want}): the shard is damaged")
    return None


def range_problem(tokens: np.ndarray, vocab_size: int, start: int = 0) -> str | None:
    """Where `tokens` (from position `start` of a shard) hold an id >= vocab_size, in words."""
    if not len(tokens):
        return None
    top = int(tokens.max())
    if top < vocab_size:
        return None
    at = start + int(np.argmax(np.asarray(tokens) >= vocab_size))
    return (f"token {int(tokens[at - start])} at position {at:,} is outside the tokenizer's "
            f"{vocab_size:,} ids: the shard is damaged")


def shard_problem(path: Path, entry: dict[str, Any], identity: str, vocab_size: int) -> str | None:
    """Everything `andrea prepare --verify` checks of one shard: header, size, the manifest's
    count and tokenizer, then the checksum (or, without one, the ids' range)."""
    try:
        info = read_header(path)
    except DamagedShard as exc:
        return exc.what
    if info.count != entry.get("tokens"):
        return f"{info.count:,} tokens, {MANIFEST} says {entry.get('tokens')}"
    if info.identity != identity:
        return f"made with tokenizer {info.identity}, {MANIFEST} says {identity}"
    if entry.get("checksum") is not None:
        return checksum_problem(path, entry)
    tokens = open_shard(path)
    for start in range(0, len(tokens), READ_BYTES):
        problem = range_problem(tokens[start : start + READ_BYTES], vocab_size, start)
        if problem:
            return problem
    return None


def verify_folder(data_dir: Path) -> str:
    """`andrea prepare --verify DIR`: check every shard of a prepared folder. Prints one line
    per damaged shard and raises a UserError saying how to go on; returns the summary line."""
    data_dir = Path(data_dir)
    t0 = time.perf_counter()
    manifest = read_manifest(data_dir)
    try:
        tok = manifest["tokenizer"]
        identity, vocab_size = tok["identity"], tok["vocab_size"]
        entries = [e for s in SPLITS for e in manifest["shards"][s]]
        paths = [data_dir / Path(e["file"]).name for e in entries]
    except (KeyError, TypeError) as exc:
        raise DamagedFolder(data_dir / MANIFEST, f"unreadable manifest (no {exc})") from None
    damaged = []
    for path, entry in zip(paths, entries, strict=True):
        problem = shard_problem(path, entry, identity, vocab_size)
        if problem is not None:
            print(f"{path}: {problem}", flush=True)
            damaged.append(path)
    if damaged:
        raise UserError(
            f"{data_dir}: {len(damaged)} of {counted(len(entries), 'shard')} damaged; delete "
            f"them (`{shlex.join(['rm', *map(str, damaged)])}`) and prepare the folder again from "
            f"the same inputs, keeping its tokenizer: {again(data_dir)}")
    size = sum(p.stat().st_size for p in paths)
    how = (f"{CHECKSUM} checksums match" if all("checksum" in e for e in entries) else
           "no checksums recorded (prepared before they were): headers, sizes and ids "
           f"checked; {record_checksums(data_dir, manifest)} records them")
    return (f"{data_dir}: {counted(len(entries), 'shard')} ({size_text(size)}) intact, {how} "
            f"({time.perf_counter() - t0:.1f} s)")


def record_checksums(data_dir: Path, manifest: dict[str, Any]) -> str:
    """The command that prepares an old folder again, recording checksums: its own with
    --force (which, for a trained BPE, trains it again)."""
    try:
        argv = prepare_argv(manifest, data_dir) + ["--force"]
        trained = manifest["tokenizer_request"].get("vocab_size") is not None
    except (KeyError, TypeError, ValueError, AttributeError):
        return "preparing it again with --force"
    return f"`{shlex.join(argv)}`" + (" (with a BPE trained again)" if trained else "")


def verify_command(data_dir: str, alone: bool = True) -> str:
    """`andrea prepare --verify DIR`: nothing else with it (`alone`: it writes nothing)."""
    if not alone:
        raise UserError("prepare --verify DIR checks a prepared folder and writes nothing; give "
                        "it alone")
    return verify_folder(Path(data_dir))


class BackgroundCheck:
    """The checksums of the shards a training reads, computed on a thread of their own from
    the start, so the first step waits for none of them. `raise_if_damaged` (a flag read on
    the host) stops at the first damaged shard found so far; `wait` waits for all of them
    (a checkpoint is written only from shards found intact)."""

    def __init__(self, shards: list[tuple[Path, dict[str, Any]]]) -> None:
        self.shards = shards
        self.problem: str | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="andrea-shard-check",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        for path, entry in self.shards:
            problem = checksum_problem(path, entry)
            if problem is not None:
                self.problem = f"{path}: {problem}; {remedy(path)}"
                break
        self.seconds = time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def raise_if_damaged(self) -> None:
        if self.problem is not None:
            raise UserError(self.problem)

    def wait(self) -> None:
        self._thread.join()
        self.raise_if_damaged()
