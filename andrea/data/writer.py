"""Resumable shard writing: encode every job and stream its tokens into shards. Whenever a
shard fills, the open shards are closed and the position recorded (progress.json), so an
interrupted prepare continues from there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from andrea import faults
from andrea.data import documents, readers, shards
from andrea.data.documents import SPLITS, Input, Settings, all_jobs
from andrea.data.encode import encode_all, train_texts
from andrea.data.folder import PROGRESS, scratch_name
from andrea.data.tokenizer import BPE_FILE, KINDS, BpeTokenizer, load_tokenizer, train_bpe
from andrea.errors import UserError, counted
from andrea.fileio import atomic_write_bytes, atomic_write_text


def resume_point(out: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The progress record of an interrupted prepare of these same inputs and settings, whose
    listed shards are all intact; None when there is nothing to resume."""
    try:
        progress = json.loads((out / PROGRESS).read_text("utf-8"))
        if progress["settings"] != settings or progress["job_rule"] != job_rule():
            return None
        identity = progress["tokenizer"]["identity"]
        if load_tokenizer(progress["tokenizer"]["kind"], out).identity != identity:
            return None
        for split in SPLITS:
            for entry in progress["shards"][split]:
                info = shards.read_header(out / entry["file"])
                if info.count != entry["tokens"] or info.identity != identity:
                    return None
    except (OSError, ValueError, UserError, KeyError, TypeError):
        return None
    return progress


def mark_started(
    out: Path, settings: dict[str, Any], tokenizer: dict[str, str] | None = None
) -> None:
    """The progress record of a prepare that has written nothing yet: it marks the folder as
    andrea's (and its tokenizer.json, for a BPE) from the first file on. `tokenizer` ({kind,
    identity}): the folder's own, kept: the record is then a resume point with no shard."""
    progress = {
        "settings": settings, "job_rule": job_rule(), "tokenizer": tokenizer,
        "shards": {s: [] for s in SPLITS}, "job": 0, "drop": {s: 0 for s in SPLITS},
        "skipped_records": 0, "replaced_bytes": 0,
    }
    atomic_write_text(out / PROGRESS, json.dumps(progress))


def job_rule() -> dict[str, int]:
    """What fixes the job boundaries: a resumed run must cut its input the same way."""
    return {"chunk_bytes": documents.CHUNK_BYTES, "read_bytes": readers.READ_BYTES,
            "feed_bytes": readers.FEED_BYTES}


def _tokenizer(
    out: Path, docs: list[Input], kind: str, vocab_size: int | None, settings: Settings,
    tokenizer_blob: bytes | None, resuming: bool, scratch: Path,
) -> Any:
    """The tokenizer the shards are written with: the folder's own when resuming, a given
    tokenizer.json copied byte for byte (so the identity is the file's), a BPE trained on the
    train split, or a fixed one."""
    if resuming:
        return load_tokenizer(kind, out)
    if tokenizer_blob is not None:
        atomic_write_bytes(out / BPE_FILE, tokenizer_blob)
        return BpeTokenizer(out / BPE_FILE)
    if KINDS[kind].trained:
        assert vocab_size is not None
        return train_bpe(train_texts(docs, settings, scratch), vocab_size, out / BPE_FILE)
    return load_tokenizer(kind, out)


class ShardStream:
    """Tokens of both splits streamed into shards of `shard_tokens`. When a shard fills, every
    open shard is closed and the position recorded in progress.json: the job being written
    (`index`) and how many of its tokens per split are already in shards (`consumed`)."""

    def __init__(
        self, out: Path, shard_tokens: int, dtype: np.dtype, tok: Any,
        progress: dict[str, Any], resume: dict[str, Any] | None,
    ) -> None:
        self.out, self.shard_tokens, self.dtype, self.tok = out, shard_tokens, dtype, tok
        self.progress = progress  # what every progress record repeats: settings, tokenizer
        self.written: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
        self.writers: dict[str, shards.ShardWriter | None] = {s: None for s in SPLITS}
        # Records skipped and bytes replaced (--errors replace), up to the job being written.
        self.tally = {"skipped_records": 0, "replaced_bytes": 0}
        self.index = 0
        if resume is not None:
            self.written = resume["shards"]
            self.index = resume["job"]
            self.tally = {k: resume.get(k, 0) for k in self.tally}
        self.consumed = {s: 0 for s in SPLITS}
        self.writing: Path | None = None  # the file being written, for a full disk's message

    def close_open(self) -> None:
        for s in SPLITS:
            w = self.writers[s]
            if w is not None:
                count = w.close().count
                self.written[s].append({"file": w.path.name, "tokens": count,
                                        "checksum": w.checksum})
                self.writers[s] = None

    def checkpoint(self) -> None:
        self.close_open()
        record = {**self.progress, "shards": self.written, "job": self.index,
                  "drop": dict(self.consumed), **self.tally}
        self.writing = self.out / PROGRESS
        atomic_write_text(self.out / PROGRESS, json.dumps(record))

    def emit(self, split: str, tokens: np.ndarray) -> None:
        while len(tokens):
            w = self.writers[split]
            if w is None:
                name = shards.shard_name(split, len(self.written[split]))
                w = self.writers[split] = shards.ShardWriter(self.out / name, self.dtype,
                                                             self.tok.identity)
            room = self.shard_tokens - w.count
            self.writing = w.path
            faults.disk_full("prepare", w.path.name)
            w.write(tokens[:room])
            self.consumed[split] += min(room, len(tokens))
            tokens = tokens[room:]
            if w.count == self.shard_tokens:
                self.checkpoint()
            else:
                faults.in_shard(w.path.name)

    def manifest_part(self, kind: str, val_fraction: float) -> dict[str, Any]:
        """What the finished shards add to the manifest: tokenizer, shards, counts, tally."""
        counts = {s: sum(e["tokens"] for e in self.written[s]) for s in SPLITS}
        if counts["val"] == 0:
            skipped = self.tally["skipped_records"]
            if counts["train"] == 0:
                raise UserError(
                    f"{self.out}: no text came out of the inputs"
                    + (f": every record was skipped ({counted(skipped, 'record')}, data.errors "
                       f"replace); fix them"
                       if skipped else "; give inputs that hold text"))
            # The rule is docs/data.md's "Train/val split": one whole text gives val its tail
            # from a line break on, so a file of one line (however long) gives none.
            raise UserError(
                f"{self.out}: the val split came out empty: a text file gives val its text after "
                f"the first line break at or after {1 - val_fraction:.0%} of it (a file of one "
                f"line gives none), a record goes to val by a hash of its text (about "
                f"{val_fraction:.0%} of them); add text in more lines or records, or raise "
                f"data.val_fraction"
                + (f" ({counted(skipped, 'record')} skipped)" if skipped else ""))
        tok = self.tok
        return {
            "tokenizer": {
                "kind": kind, "identity": tok.identity, "vocab_size": tok.vocab_size,
                "eot_id": tok.eot_id,
            },
            "shards": self.written,
            "shard_checksum": shards.CHECKSUM,
            "tokens": counts,
            **self.tally,
        }

    def abort(self) -> None:
        for w in self.writers.values():
            if w is not None:
                w.abort()


def write_shards(
    out: Path, docs: list[Input], kind: str, vocab_size: int | None, shard_tokens: int,
    workers: int, total: int, settings: Settings, manifest_settings: dict[str, Any],
    tokenizer_blob: bytes | None, resume: dict[str, Any] | None,
) -> dict[str, Any]:
    """Encode every job and write the shards, recording progress whenever a shard fills, so a
    rerun after a crash continues from there: skipping the jobs before it and the tokens of its
    first job already written."""
    from tqdm import tqdm

    scratch = out / scratch_name()
    tok = _tokenizer(out, docs, kind, vocab_size, settings, tokenizer_blob, resume is not None,
                     scratch)
    dtype = shards.token_dtype(tok.vocab_size)
    progress = {"settings": manifest_settings, "job_rule": job_rule(),
                "tokenizer": {"kind": kind, "identity": tok.identity}}
    stream = ShardStream(out, shard_tokens, dtype, tok, progress, resume)
    start_job = stream.index
    drop = dict(resume["drop"]) if resume is not None else {s: 0 for s in SPLITS}
    if resume is not None and any(stream.written.values()):
        n = sum(e["tokens"] for s in SPLITS for e in stream.written[s])
        kept = counted(sum(map(len, stream.written.values())), "complete shard")
        print(f"{out}: resuming after {kept} ({n:,} tokens), from input job {start_job}",
              flush=True)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"prepare {out.name}", disable=None, smoothing=0.1)
    jobs = all_jobs(docs, settings.val_fraction, settings.text_field, start_job, scratch)
    encoded = encode_all(jobs, settings, tok, out, dtype.str, workers)
    try:
        for number, (job, result) in enumerate(encoded):
            bar.update(job.nbytes)
            if result is None:  # before the resume point
                continue
            tokens, job_tally = result
            stream.index, stream.consumed = number, {s: 0 for s in SPLITS}
            for split in SPLITS:
                ids = tokens[split]
                if number == start_job:  # already written before the interruption
                    ids, stream.consumed[split] = ids[drop[split]:], drop[split]
                stream.emit(split, ids)
            stream.tally["skipped_records"] += job_tally.skipped
            stream.tally["replaced_bytes"] += job_tally.replaced
        stream.close_open()
    except OSError as exc:
        if exc.filename is None and stream.writing is not None:  # a write(), not an open()
            exc.filename = str(stream.writing)
        raise
    finally:
        encoded.close()  # the worker pool ends here, not when the traceback is freed
        bar.close()
        stream.abort()
    return stream.manifest_part(kind, settings.val_fraction)
