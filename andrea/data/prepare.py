"""`andrea prepare`: text in, token shards out (docs/data.md describes every rule here).

Inputs (andrea/data/readers.py): text files, whole documents each, or the embedded Shakespeare's
plays; JSON Lines, Parquet and `datasets` Arrow files, one document per record. A whole text's
tail goes to the val split (everything after the first line break at or after (1 - val_fraction)
of its bytes); a record goes to val by a hash of its text. Each split is written as shards of at
most `shard_tokens` tokens, every document (or document part) followed by end-of-text.

Memory stays bounded for any corpus size: inputs are cut into jobs of about 1 MiB, encoded in
worker processes with a bounded number in flight, and streamed to disk. Whenever a shard fills,
the open shards are closed and the position recorded (progress.json), so an interrupted prepare
continues from there. A manifest (inputs, tokenizer, split settings, shards) is written last, so
a directory without one was never completed; re-running with unchanged inputs does nothing.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from andrea.data import readers, shards
from andrea.data.readers import (
    InputFile,
    Job,
    arrow_jobs,
    input_files,
    input_identity,
    iter_blocks,
    parquet_jobs,
    record_jobs,
)
from andrea.data.shards import MANIFEST, MANIFEST_VERSION, read_manifest
from andrea.data.tokenizer import (
    BPE_FILE,
    EOT_TEXT,
    FIXED_VOCAB,
    KINDS,
    BpeTokenizer,
    load_tokenizer,
    train_bpe,
)
from andrea.errors import UserError
from andrea.fileio import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    from andrea.config import Config

PROGRESS = "progress.json"  # an unfinished prepare's complete shards and where to go on
SCRATCH = "decompressed.tmp"  # a compressed text file, decompressed so it can be split
SPLIT_RULE = "tail-after-line-break-v1"
RECORD_SPLIT_RULE = "blake2b-8-of-text-v1"
SPLITS = ("train", "val")
SHAKESPEARE = "shakespeare"
TEXT_SUFFIXES = readers.TEXT_SUFFIXES
CHUNK_BYTES = 1 << 20
BPE_TRAIN_MAX_BYTES = 256 << 20  # BPE learns from at most this much of the train split
PARALLEL_MIN_BYTES = 2 << 20  # below this, automatic `workers` encodes in-process


# ----------------------------------------------------------------------------- inputs


@dataclass
class Document:
    """A whole-text document (a text file, or one play of the embedded corpus)."""

    name: str  # a file path, or "shakespeare/<genre>/<play>"
    size: int
    open: Callable[[], BinaryIO]
    sha256: str


Input = Document | InputFile


def documents(source: str) -> list[Input]:
    """The inputs of `source`: "shakespeare" (the embedded corpus, one Document per play) or a
    file, directory, glob or `datasets` folder (one InputFile each)."""
    if source == SHAKESPEARE:
        from andrea.data.corpus import shakespeare

        docs: list[Input] = []
        for name, text in shakespeare():
            blob = text.encode("utf-8")
            docs.append(
                Document(
                    f"{SHAKESPEARE}/{name}",
                    len(blob),
                    lambda blob=blob: io.BytesIO(blob),
                    hashlib.sha256(blob).hexdigest(),
                )
            )
        return docs
    files: list[Input] = list(input_files(source))
    if sum(f.size for f in files) == 0:
        raise UserError(f"{source}: input is empty ({len(files)} file(s), 0 bytes)")
    return files


def _identity(item: Input) -> dict[str, Any]:
    if isinstance(item, Document):
        return {"name": item.name, "bytes": item.size, "sha256": item.sha256}
    return input_identity(item)


# ----------------------------------------------------------------------------- splitting


def val_start(f: BinaryIO, size: int, val_fraction: float) -> int:
    """Byte offset where a document's val tail begins: just after the first line break at or
    after (1 - val_fraction) * size; without one, the first character boundary there."""
    target = int(size * (1.0 - val_fraction))
    f.seek(target)
    pos = target
    while block := f.read(1 << 16):
        i = block.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(block)
    f.seek(target)
    block = f.read(4)
    for i, b in enumerate(block):
        if b & 0xC0 != 0x80:  # not a UTF-8 continuation byte
            return target + i
    return size


def is_val_record(text: bytes, val_fraction: float) -> bool:
    """A record's split: val when the first 8 bytes of its BLAKE2b hash, read as a fraction of
    2**64, fall below val_fraction. Depends on the text alone: not on order, chunks or workers."""
    h = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return h < val_fraction * 2.0**64


def _cut(data: bytes) -> int:
    """Where to end a chunk: after a line break between two non-space bytes, so the encoders'
    pre-tokenizers see the same boundaries as in the whole text; else a character boundary."""
    j = len(data) - 1
    while (i := data.rfind(b"\n", 1, j)) > 0:
        before = data[max(0, i - 4) : i].decode("utf-8", errors="ignore")[-1:]
        after = data[i + 1 : i + 5].decode("utf-8", errors="ignore")[:1]
        if before and after and not before.isspace() and not after.isspace():
            return i + 1
        j = i
    i = len(data) - 1
    while i > 0 and data[i] & 0xC0 == 0x80:
        i -= 1
    return i if i > 0 else len(data)


def read_span(f: BinaryIO, start: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) chunks of about CHUNK_BYTES covering [start, end), cut by `_cut`."""
    f.seek(start)
    pos, carry = start, b""
    while pos < end:
        block = f.read(min(CHUNK_BYTES, end - pos))
        if not block:
            break
        pos += len(block)
        data = carry + block
        if pos >= end:
            carry = b""
            yield pos - len(data), data
            break
        n = _cut(data)
        carry = data[n:]
        yield pos - len(data), data[:n]
    if carry:
        yield pos - len(carry), carry


def _decode(chunk: bytes, offset: int, name: str, errors: str) -> str:
    try:
        return chunk.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{name}: invalid UTF-8 at byte offset {offset + exc.start}; fix the file or "
            "pass --errors replace (data.errors=replace)"
        ) from None


# ----------------------------------------------------------------------------- jobs


def _as_document(f: InputFile, scratch: Path) -> Document:
    """A text file as a seekable Document; a compressed one is first decompressed (checked
    for truncation) to a scratch file in the output folder, which `_clear` removes."""
    if not f.compression:
        return Document(f.name, f.size, lambda: open(f.path, "rb"), "")
    with open(scratch, "wb") as out:
        for block, _ in iter_blocks(f):
            out.write(block)
    return Document(f.name, scratch.stat().st_size, lambda: open(scratch, "rb"), "")


def _text_jobs(doc: Document, val_fraction: float, skip: int, file_bytes: int) -> Iterator[Job]:
    """A whole-text document's train part then its val part, in chunks; the last chunk of a
    part is marked so end-of-text follows it. File bytes are apportioned for the progress bar."""
    index, done = 0, 0
    with doc.open() as f:
        head = f.read(8192)
        if b"\0" in head:
            raise UserError(
                f"{doc.name}: looks binary (NUL bytes), not text; give text, JSON Lines or "
                "Parquet files"
            )
        cut = val_start(f, doc.size, val_fraction)
        for split, (a, b) in zip(SPLITS, ((0, cut), (cut, doc.size)), strict=True):
            if a >= b:
                continue
            chunks = read_span(f, a, b)
            chunk = next(chunks, None)
            while chunk is not None:
                following = next(chunks, None)
                offset, data = chunk
                share = file_bytes * (offset + len(data)) // max(1, doc.size) - done
                done += share
                payload = (split, data, offset, following is None) if index >= skip else None
                yield Job("text", doc.name, share, payload)
                index += 1
                chunk = following


def input_jobs(
    item: Input, val_fraction: float, text_field: str, skip: int, scratch: Path
) -> Iterator[Job]:
    """The jobs of one input in their fixed order; the first `skip` carry no data."""
    if isinstance(item, Document):
        yield from _text_jobs(item, val_fraction, skip, item.size)
    elif item.kind == "text":
        try:
            yield from _text_jobs(_as_document(item, scratch), val_fraction, skip, item.size)
        finally:
            scratch.unlink(missing_ok=True)
    elif item.kind == "records":
        yield from record_jobs(item, skip)
    elif item.kind == "parquet":
        yield from parquet_jobs(item, text_field, skip)
    else:
        yield from arrow_jobs(item, text_field, skip)


def all_jobs(
    inputs: list[Input], val_fraction: float, text_field: str, start: int, scratch: Path
) -> Iterator[Job]:
    """Every input's jobs in order; jobs before number `start` carry no data."""
    index = 0
    for item in inputs:
        for job in input_jobs(item, val_fraction, text_field, max(0, start - index), scratch):
            yield job
            index += 1


# ----------------------------------------------------------------------------- documents


@dataclass
class Settings:
    """What a worker needs besides the job: fixed for a whole prepare."""

    val_fraction: float
    text_field: str
    errors: str


def _record_text(value: Any, where: str, field: str, keys: Any, s: Settings) -> str | None:
    """A record's text, or None (counted as skipped) when it has none and errors != strict."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8", errors=s.errors)
        except UnicodeDecodeError as exc:
            raise UserError(
                f"{where}: invalid UTF-8 in field '{field}' at byte {exc.start}; fix the input "
                "or pass --errors replace"
            ) from None
    if isinstance(value, str):
        return value
    if s.errors == "strict":
        what = "is missing" if value is None and keys is not None else f"is {type(value).__name__}"
        has = f" (fields: {', '.join(map(str, keys))})" if keys is not None else ""
        raise UserError(
            f"{where}: field '{field}' {what}, not a string{has}; choose the field with "
            "--text-field, or skip such records with --errors replace"
        )
    return None


def job_documents(job: Job, s: Settings) -> tuple[list[tuple[str, str, bool]], int]:
    """A job's text as (split, text, end-of-text after it) in order, and how many records
    were skipped for having no text."""
    if job.data is None:
        return [], 0
    if job.kind == "text":
        split, chunk, offset, last = job.data
        return [(split, _decode(chunk, offset, job.name, s.errors), last)], 0
    texts: list[str | None] = []
    if job.kind == "records":
        for i, line in enumerate(job.data.split(b"\n")):
            if not line.strip():
                continue
            where = f"{job.name}:{job.start + i}"
            try:
                obj = json.loads(line.decode("utf-8", errors=s.errors))
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"{where}: invalid UTF-8 at byte {exc.start} of the line; fix the input "
                    "or pass --errors replace"
                ) from None
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"{where}: not a JSON object per line ({exc.msg.removesuffix(' at')} at "
                    f"column {exc.colno}); "
                    "fix the line, or name the file .txt to read it as plain text"
                ) from None
            if not isinstance(obj, dict):
                raise UserError(f"{where}: a JSON {type(obj).__name__}, expected an object")
            texts.append(_record_text(obj.get(s.text_field), where, s.text_field, obj.keys(), s))
    else:
        for i, value in enumerate(job.data.to_pylist()):
            where = f"{job.name}: {job.where}, row {job.start + i}"
            texts.append(_record_text(value, where, s.text_field, None, s))
    out, skipped = [], 0
    for i, text in enumerate(texts):
        if text is None:
            skipped += 1
            continue
        try:
            blob = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from a JSON \\ud800 escape
            if s.errors == "strict":
                raise UserError(
                    f"{job.name}: record {job.start + i} holds invalid Unicode (a lone "
                    "surrogate); fix the input or pass --errors replace"
                ) from None
            blob = text.encode("utf-8", errors="replace")
            text = blob.decode("utf-8")
        out.append(("val" if is_val_record(blob, s.val_fraction) else "train", text, True))
    return out, skipped


# ----------------------------------------------------------------------------- encoding

_worker_tokenizer: Any = None


def _init_worker(kind: str, data_dir: str | None, in_pool: bool = True) -> None:
    global _worker_tokenizer
    if in_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tokenizer = load_tokenizer(kind, Path(data_dir) if data_dir else None)


JobResult = tuple[dict[str, np.ndarray], int]


def _encode_job(args: tuple[Job, Settings, str]) -> JobResult:
    """One job's tokens per split (each document followed by end-of-text), and its skip count."""
    job, settings, dtype = args
    docs, skipped = job_documents(job, settings)
    tok = _worker_tokenizer
    encode = getattr(tok, "encode_array", None) or tok.encode
    eot = np.array([tok.eot_id], dtype=dtype)
    parts: dict[str, list[Any]] = {s: [] for s in SPLITS}
    for split, text, end in docs:
        parts[split].append(np.asarray(encode(text), dtype=dtype))
        if end:
            parts[split].append(eot)
    tokens = {
        s: np.concatenate(p) if p else np.zeros(0, dtype=dtype) for s, p in parts.items()
    }
    return tokens, skipped


def _encode_all(
    jobs: Iterator[Job], settings: Settings, tok: Any, data_dir: Path, dtype: str, workers: int
) -> Iterator[tuple[Job, JobResult | None]]:
    """Encode jobs in order with `tok` (workers load their own copy); at most 2 * workers
    in flight, so memory is bounded. A job without data comes back with None."""
    global _worker_tokenizer
    kind = tok.name
    if workers <= 1:
        _worker_tokenizer = tok
        for job in jobs:
            yield job, None if job.data is None else _encode_job((job, settings, dtype))
        return
    ctx = multiprocessing.get_context("spawn")  # no fork: HF tokenizers' threads dislike it
    with ctx.Pool(workers, _init_worker, (kind, str(data_dir))) as pool:
        pending: collections.deque = collections.deque()
        for job in jobs:
            result = None
            if job.data is not None:
                result = pool.apply_async(_encode_job, ((job, settings, dtype),))
            pending.append((job, result))
            while len(pending) > 2 * workers:
                j, r = pending.popleft()
                yield j, None if r is None else r.get()
        while pending:
            j, r = pending.popleft()
            yield j, None if r is None else r.get()


def _train_texts(
    inputs: list[Input], settings: Settings, scratch: Path
) -> Iterator[str]:
    """The train split's texts, in order, up to BPE_TRAIN_MAX_BYTES: what a BPE learns from."""
    seen = 0
    for job in all_jobs(inputs, settings.val_fraction, settings.text_field, 0, scratch):
        for split, text, _ in job_documents(job, settings)[0]:
            if split == "train":
                yield text
                seen += len(text)
                if seen >= BPE_TRAIN_MAX_BYTES:
                    return


# ----------------------------------------------------------------------------- given BPE


def _is_byte_level(pre: Any) -> bool:
    """A ByteLevel pre-tokenizer, alone or inside a Sequence (as newer HF BPEs have it)."""
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "ByteLevel":
        return True
    return pre.get("type") == "Sequence" and any(
        _is_byte_level(p) for p in pre.get("pretokenizers") or []
    )


def read_tokenizer_file(path: str | Path) -> tuple[bytes, BpeTokenizer]:
    """An existing HF tokenizer.json (data.tokenizer_file), checked to be a byte-level BPE
    with end-of-text as its last id: (its bytes, the tokenizer)."""
    path = Path(path)
    usable = f"needs a byte-level BPE tokenizer.json with {EOT_TEXT} as its last id"
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise UserError(
            f"data.tokenizer_file {path}: cannot read it ({exc.strerror}); {usable}"
        ) from None
    try:
        spec = json.loads(blob)
    except (UnicodeDecodeError, ValueError):
        raise UserError(f"data.tokenizer_file {path}: not JSON; {usable}") from None
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not _is_byte_level(
        spec.get("pre_tokenizer")
    ):
        raise UserError(f"data.tokenizer_file {path}: not a byte-level BPE; {usable}")
    try:
        tok = BpeTokenizer(path)
    except UserError:
        raise UserError(f"data.tokenizer_file {path}: unusable tokenizer; {usable}") from None
    return blob, tok


# ----------------------------------------------------------------------------- manifest


def _settings(
    source: str, docs: list[Input], kind: str, vocab_size: int | None, val_fraction: float,
    shard_tokens: int, errors: str, tokenizer_blob: bytes | None = None, text_field: str = "text",
) -> dict[str, Any]:
    """Everything that determines the shards' content: equal settings mean nothing to redo."""
    if source == SHAKESPEARE:
        from andrea.data.corpus import corpus_identity

        corpus = corpus_identity()
    else:
        corpus = "files"
    request: dict[str, Any] = {"kind": kind, "vocab_size": vocab_size if kind == "bpe" else None}
    if tokenizer_blob is not None:  # a given tokenizer.json: its content, not its path, counts
        request = {"kind": kind, "vocab_size": None,
                   "file_sha256": hashlib.sha256(tokenizer_blob).hexdigest()}
    settings = {
        "manifest_version": MANIFEST_VERSION,
        "shard_format_version": shards.VERSION,
        "source": source,
        "corpus": corpus,
        "inputs": [_identity(d) for d in docs],
        "tokenizer_request": request,
        "split": {"rule": SPLIT_RULE, "val_fraction": val_fraction},
        "shard_tokens": shard_tokens,
        "errors": errors,
    }
    if any(isinstance(d, InputFile) and d.kind != "text" for d in docs):
        # Records: the field read, and their own split rule (whole documents by hash).
        settings["text_field"] = text_field
        settings["split"]["record_rule"] = RECORD_SPLIT_RULE
    return settings


def _is_current(out: Path, settings: dict[str, Any]) -> bool:
    """True if `out` holds complete shards made from exactly these inputs and settings."""
    try:
        manifest = read_manifest(out)
        if {k: manifest.get(k) for k in settings} != settings:
            return False
        tok = load_tokenizer(manifest["tokenizer"]["kind"], out)
        if tok.identity != manifest["tokenizer"]["identity"]:
            return False
        for split in SPLITS:
            for entry in manifest["shards"][split]:
                info = shards.read_header(out / entry["file"])
                if info.count != entry["tokens"] or info.identity != tok.identity:
                    return False
    except (UserError, KeyError, TypeError):
        return False
    return True


def _clear(out: Path) -> None:
    """Remove what a previous prepare wrote (the manifest first: it is the 'complete' mark)."""
    (out / MANIFEST).unlink(missing_ok=True)
    (out / PROGRESS).unlink(missing_ok=True)
    for pattern in ("train_*.bin", "val_*.bin", "*.tmp", BPE_FILE, SCRATCH):
        for p in out.glob(pattern):
            p.unlink()


def _remove_unlisted(out: Path, keep: set[str]) -> None:
    """Before resuming: drop partial shards (*.tmp) and shards no progress record lists."""
    for pattern in ("train_*.bin", "val_*.bin", "*.tmp", SCRATCH):
        for p in out.glob(pattern):
            if p.name not in keep:
                p.unlink()


def _resume_point(out: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The progress record of an interrupted prepare of these same inputs and settings, whose
    listed shards are all intact; None when there is nothing to resume."""
    try:
        progress = json.loads((out / PROGRESS).read_text("utf-8"))
        if progress["settings"] != settings or progress["job_rule"] != _job_rule():
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


def _job_rule() -> dict[str, int]:
    """What fixes the job boundaries: a resumed run must cut its input the same way."""
    return {"chunk_bytes": CHUNK_BYTES, "read_bytes": readers.READ_BYTES}


# ----------------------------------------------------------------------------- prepare


def auto_workers(total_bytes: int) -> int:
    if total_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(os.cpu_count() or 1, 8))


def _missing_dirs(out: Path) -> list[Path]:
    """`out` and those of its parents that do not exist yet, deepest first."""
    missing = []
    for p in (out, *out.absolute().parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def prepare_inputs(
    inputs: str,
    tokenizer: str,
    out: Path,
    vocab_size: int | None = None,
    force: bool = False,
    errors: str = "strict",
    workers: int = 0,
    val_fraction: float = 0.1,
    shard_tokens: int = 50_000_000,
    verbose: bool = True,
    announce: str | None = None,
    tokenizer_file: str = "",
    text_field: str = "text",
) -> Path:
    """Tokenize `inputs` ("shakespeare", a file, a directory, a glob or a `datasets` folder)
    into shards in `out`.

    `vocab_size` is the BPE's total id count (bpe only). `tokenizer_file` (bpe only): an
    existing tokenizer.json copied into `out` and used as is instead of training (then
    `vocab_size` is ignored). `text_field`: the field (JSON) or column (Parquet, Arrow) that
    holds the text. Returns `out`. Does nothing when `out` already holds shards from the same
    inputs and settings, unless `force`; continues an interrupted prepare of the same inputs
    from its last complete shard. `announce` is printed just before the work starts.
    """
    if tokenizer not in KINDS:
        raise UserError(f"--tokenizer: '{tokenizer}' is not one of {', '.join(KINDS)}")
    if errors not in ("strict", "replace"):
        raise UserError(f"--errors: '{errors}' is not one of strict, replace")
    if not 0 < val_fraction < 1:
        raise UserError(f"val fraction {val_fraction} must be in (0, 1)")
    if shard_tokens <= 0 or workers < 0:
        raise UserError("shard_tokens must be positive and workers non-negative")
    if not text_field:
        raise UserError("--text-field: give the name of the field that holds the text")
    blob = None
    if tokenizer_file:
        if tokenizer != "bpe":
            raise UserError(f"--tokenizer-file applies to --tokenizer bpe only, not {tokenizer}")
        blob, _ = read_tokenizer_file(tokenizer_file)  # read before _clear: it may be in `out`
        vocab_size = None
    elif tokenizer == "bpe" and vocab_size is None:
        raise UserError("--tokenizer bpe needs --vocab-size (the BPE's id count incl. end-of-text)")
    out = Path(out)
    docs = documents(inputs)
    settings = _settings(
        inputs, docs, tokenizer, vocab_size, val_fraction, shard_tokens, errors, blob, text_field
    )
    if not force and _is_current(out, settings):
        if verbose:
            print(f"{out}: up to date (inputs unchanged; --force redoes it)")
        return out
    resume = None if force else _resume_point(out, settings)
    if announce:
        print(announce, flush=True)
    elif verbose and resume is None and (out / MANIFEST).is_file():
        print(f"{out}: inputs or settings changed since it was prepared; preparing it again",
              flush=True)
    created = _missing_dirs(out)
    out.mkdir(parents=True, exist_ok=True)
    if resume is None:
        _clear(out)
    else:
        _remove_unlisted(out, {e["file"] for s in SPLITS for e in resume["shards"][s]})
    total = sum(d.size for d in docs)
    if workers == 0:
        workers = auto_workers(total)
    try:
        result = _write_shards(
            out, docs, tokenizer, vocab_size, shard_tokens, workers, total,
            Settings(val_fraction, text_field, errors), settings, blob, resume, verbose,
        )
    except KeyboardInterrupt:
        # Complete shards and their progress record stay: the next run continues from them.
        for p in out.glob("*.tmp"):
            p.unlink()
        (out / SCRATCH).unlink(missing_ok=True)
        if not (out / PROGRESS).is_file():
            _clear(out)
            _remove_empty(created)
        raise
    except BaseException:
        _clear(out)  # nothing half-written is left looking valid
        _remove_empty(created)
        raise
    manifest = {**settings, **result}
    if tokenizer_file:
        manifest["tokenizer"]["copied_from"] = str(tokenizer_file)
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    (out / PROGRESS).unlink(missing_ok=True)
    if verbose:
        n = manifest["tokens"]
        skipped = manifest.get("skipped_records", 0)
        print(
            f"{out}: {n['train']:,} train + {n['val']:,} val tokens, tokenizer "
            f"{manifest['tokenizer']['identity']} ({manifest['tokenizer']['vocab_size']:,} ids)"
            + (f"; skipped {skipped:,} records without a string '{text_field}'"
               if skipped else "")
        )
    return out


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the folders a failed prepare created, deepest first, if they are empty."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def _pause_hook(name: str) -> None:
    """Test hook: ANDREA_PREPARE_PAUSE_IN=<shard file> stops here, mid-shard, for a SIGKILL."""
    if os.environ.get("ANDREA_PREPARE_PAUSE_IN") == name:
        print(f"paused in {name}", file=sys.stderr, flush=True)
        while True:
            time.sleep(60)


def _write_shards(
    out: Path, docs: list[Input], kind: str, vocab_size: int | None, shard_tokens: int,
    workers: int, total: int, settings: Settings, manifest_settings: dict[str, Any],
    tokenizer_blob: bytes | None, resume: dict[str, Any] | None, verbose: bool,
) -> dict[str, Any]:
    """Encode every job and write the shards. Whenever a shard fills, every open shard is
    closed and the position recorded (progress.json), so a rerun after a crash continues from
    there: skipping the jobs before it and the tokens of its first job already written."""
    from tqdm import tqdm

    scratch = out / SCRATCH
    if resume is not None:
        tok = load_tokenizer(kind, out)
    elif tokenizer_blob is not None:  # byte for byte, so the identity is the file's
        atomic_write_bytes(out / BPE_FILE, tokenizer_blob)
        tok = BpeTokenizer(out / BPE_FILE)
    elif kind == "bpe":
        assert vocab_size is not None
        tok = train_bpe(_train_texts(docs, settings, scratch), vocab_size, out / BPE_FILE)
    else:
        tok = load_tokenizer(kind, out)
    dtype = shards.token_dtype(tok.vocab_size)
    written: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    writers: dict[str, shards.ShardWriter | None] = {s: None for s in SPLITS}
    start_job, drop, skipped_before = 0, {s: 0 for s in SPLITS}, 0
    if resume is not None:
        written = resume["shards"]
        start_job = resume["job"]
        drop = dict(resume["drop"])
        skipped_before = resume["skipped_records"]
        if verbose:
            n = sum(e["tokens"] for s in SPLITS for e in written[s])
            print(f"{out}: resuming after {sum(map(len, written.values()))} complete shards "
                  f"({n:,} tokens), from input job {start_job}", flush=True)
    index = start_job  # the job being written
    consumed = {s: 0 for s in SPLITS}  # of its tokens per split, already in shards

    def checkpoint() -> None:
        for s in SPLITS:
            w = writers[s]
            if w is not None:
                written[s].append({"file": w.path.name, "tokens": w.close().count})
                writers[s] = None
        progress = {
            "settings": manifest_settings, "job_rule": _job_rule(),
            "tokenizer": {"kind": kind, "identity": tok.identity},
            "shards": written, "job": index, "drop": dict(consumed),
            "skipped_records": skipped_before,
        }
        atomic_write_text(out / PROGRESS, json.dumps(progress))

    def emit(split: str, tokens: np.ndarray) -> None:
        while len(tokens):
            w = writers[split]
            if w is None:
                name = f"{split}_{len(written[split]):06d}.bin"
                w = writers[split] = shards.ShardWriter(out / name, dtype, tok.identity)
            room = shard_tokens - w.count
            w.write(tokens[:room])
            consumed[split] += min(room, len(tokens))
            tokens = tokens[room:]
            if w.count == shard_tokens:
                checkpoint()
            else:
                _pause_hook(w.path.name)

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"prepare {out.name}", disable=None, smoothing=0.1)
    try:
        jobs = all_jobs(docs, settings.val_fraction, settings.text_field, start_job, scratch)
        stream = _encode_all(jobs, settings, tok, out, dtype.str, workers)
        for number, (job, result) in enumerate(stream):
            bar.update(job.nbytes)
            if result is None:  # before the resume point
                continue
            tokens, skipped = result
            index, consumed = number, {s: 0 for s in SPLITS}
            for split in SPLITS:
                ids = tokens[split]
                if number == start_job:  # already written before the interruption
                    ids, consumed[split] = ids[drop[split]:], drop[split]
                emit(split, ids)
            skipped_before += skipped
        for split in SPLITS:
            w = writers[split]
            if w is not None:
                written[split].append({"file": w.path.name, "tokens": w.close().count})
                writers[split] = None
    finally:
        bar.close()
        for w in writers.values():
            if w is not None:
                w.abort()
    counts = {s: sum(e["tokens"] for e in written[s]) for s in SPLITS}
    if counts["val"] == 0:
        raise UserError(
            f"{out}: the val split came out empty (inputs too small for val fraction "
            f"{settings.val_fraction}); add text or raise data.val_fraction"
        )
    return {
        "tokenizer": {
            "kind": kind, "identity": tok.identity, "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
        },
        "shards": written,
        "tokens": counts,
        "skipped_records": skipped_before,
    }


# ----------------------------------------------------------------------------- from a config


def _file_tag(path: str) -> str:
    """8 hex of the file's sha256 (of its path when unreadable: a name must never fail)."""
    try:
        blob = Path(path).read_bytes()
    except OSError:
        blob = str(Path(path).resolve()).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:8]


def default_data_dir(
    source: str, tokenizer: str, vocab_size: int, tokenizer_file: str = ""
) -> Path:
    """data/<source-name>-<tokenizer>[-<vocab>] under the working directory; with a given
    tokenizer.json, data/<source-name>-bpe-tok<8 hex of its sha256> (never a trained BPE's)."""
    if source == SHAKESPEARE:
        name = SHAKESPEARE
    else:
        base = Path(re.split(r"[*?\[]", source, maxsplit=1)[0].rstrip("/\\") or ".")
        name = (base.stem if base.suffix else base.name) or base.resolve().name or "input"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name)
    suffix = f"-{vocab_size}" if tokenizer == "bpe" else ""
    if tokenizer == "bpe" and tokenizer_file:
        suffix = f"-tok{_file_tag(tokenizer_file)}"
    return Path("data") / f"{name}-{tokenizer}{suffix}"


def data_dir_for(cfg: Config) -> Path:
    """The data dir of `cfg` (of its first source, for a mixture)."""
    d = cfg.data
    if d.sources:
        return source_dirs(cfg)[0][1]
    if d.dir:
        return Path(d.dir)
    return default_data_dir(d.source, d.tokenizer, cfg.model.vocab_size, d.tokenizer_file)


def source_dirs(cfg: Config) -> list[tuple[str, Path, float]]:
    """(path, data dir, weight) of each of data.sources: each prepared on its own, in
    data/<name>-<tokenizer>... (or under data.dir when it is set)."""
    d = cfg.data
    out = []
    for entry in d.sources:
        path = entry["path"]
        derived = default_data_dir(path, d.tokenizer, cfg.model.vocab_size, d.tokenizer_file)
        out.append((path, Path(d.dir) / derived.name if d.dir else derived, entry["weight"]))
    names = [p.as_posix() for _, p, _ in out]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice:
        raise UserError(
            f"{cfg.source}: data.sources: two sources would share the data dir {twice}; "
            "give their files different names"
        )
    return out


def check_vocab(tokenizer_vocab: int, model_vocab: int, where: str) -> None:
    """The model's embedding must have a row for every id the tokenizer can produce."""
    if tokenizer_vocab > model_vocab:
        raise UserError(
            f"{where}: the tokenizer has {tokenizer_vocab:,} ids but model.vocab_size is "
            f"{model_vocab:,}; set model.vocab_size >= {tokenizer_vocab}"
        )


def prepare_from_config(
    cfg: Config, force: bool = False, verbose: bool = True, announce: str | None = None
) -> Path:
    """Prepare the shards that `cfg.data` describes (BPE vocab = model.vocab_size, unless
    data.tokenizer_file gives the BPE)."""
    d = cfg.data
    if d.tokenizer in FIXED_VOCAB:
        check_vocab(FIXED_VOCAB[d.tokenizer], cfg.model.vocab_size, cfg.source)
    if d.tokenizer == "bpe" and d.tokenizer_file:
        given = read_tokenizer_file(d.tokenizer_file)[1]
        where = f"data.tokenizer_file {d.tokenizer_file}"
        check_vocab(given.vocab_size, cfg.model.vocab_size, where)
    targets = [(p, out) for p, out, _ in source_dirs(cfg)] or [(d.source, data_dir_for(cfg))]
    identities: dict[str, Path] = {}
    for source, target in targets:
        out = prepare_inputs(
            source, d.tokenizer, target,
            vocab_size=cfg.model.vocab_size if d.tokenizer == "bpe" else None,
            force=force, errors=d.errors, workers=d.workers, val_fraction=d.val_fraction,
            shard_tokens=d.shard_tokens, verbose=verbose,
            announce=announce if not d.sources or announce is None
            else f"preparing {target} from {source} (first run only)",
            tokenizer_file=d.tokenizer_file if d.tokenizer == "bpe" else "",
            text_field=d.text_field,
        )
        tok = read_manifest(out)["tokenizer"]
        check_vocab(tok["vocab_size"], cfg.model.vocab_size, str(out))
        identities.setdefault(tok["identity"], out)
    check_one_tokenizer(identities)
    return data_dir_for(cfg)


def check_one_tokenizer(identities: dict[str, Path]) -> None:
    """Sources of one mixture must share a tokenizer: {identity: a data dir that has it}."""
    if len(identities) > 1:
        (a, dir_a), (b, dir_b) = list(identities.items())[:2]
        raise UserError(
            f"data.sources: {dir_a} was prepared with tokenizer {a} but {dir_b} with {b}; "
            "a mixture needs one tokenizer (gpt2, byte, or bpe with data.tokenizer_file)"
        )


def ensure_prepared(cfg: Config) -> Path:
    """The data dir for `cfg`, preparing it first (with one line saying so) if missing or stale.

    Call it on one process only (rank 0) and let the others wait: two concurrent prepares of
    the same directory would clear each other's files.
    """
    announce = f"preparing {data_dir_for(cfg)} from {source_words(cfg)} (first run only)"
    return prepare_from_config(cfg, verbose=False, announce=announce)


def source_words(cfg: Config) -> str:
    """What data.source names, in words for a message."""
    source = cfg.data.source
    return "the embedded Shakespeare corpus" if source == SHAKESPEARE else source


def prepare_command(
    config: str | None = None,
    overrides: list[str] | None = None,
    input: str | None = None,
    tokenizer: str | None = None,
    out: str | None = None,
    vocab_size: int | None = None,
    force: bool = False,
    errors: str | None = None,
    workers: int | None = None,
    tokenizer_file: str | None = None,
    text_field: str | None = None,
) -> Path:
    """What `andrea prepare` does: from a config's data section, or ad hoc from --input."""
    if config is not None:
        if input is not None or tokenizer is not None or vocab_size is not None:
            raise UserError(
                "prepare: --config takes its input, tokenizer and vocab size from the config; "
                "drop --input/--tokenizer/--vocab-size or use --set data.source=..."
            )
        from andrea.config import load_config, validate

        sets = list(overrides or [])
        sets += [f"data.dir={out}"] if out is not None else []
        sets += [f"data.errors={errors}"] if errors is not None else []
        sets += [f"data.workers={workers}"] if workers is not None else []
        sets += [f"data.text_field={text_field}"] if text_field is not None else []
        cfg = load_config(config, sets)
        if tokenizer_file is not None:
            cfg.data.tokenizer_file = tokenizer_file
            validate(cfg, f"{cfg.source} (with --tokenizer-file)")
        return prepare_from_config(cfg, force=force)
    if input is None:
        raise UserError("prepare: give --config X (e.g. andrea-12m) or --input FILE|DIR|GLOB")
    if overrides:
        raise UserError("prepare: --set needs --config")
    kind = tokenizer or "bpe"
    if tokenizer_file is not None:
        if kind != "bpe" or vocab_size is not None:
            raise UserError(
                "--tokenizer-file gives the BPE and its vocab size; drop --tokenizer/--vocab-size"
            )
    elif kind == "bpe" and vocab_size is None:
        vocab_size = 4096
    if kind != "bpe" and vocab_size is not None:
        raise UserError(f"--vocab-size applies to --tokenizer bpe only, not {kind}")
    target = Path(out) if out else default_data_dir(input, kind, vocab_size or 0,
                                                    tokenizer_file or "")
    return prepare_inputs(
        input, kind, target, vocab_size=vocab_size, force=force, errors=errors or "strict",
        workers=workers or 0, tokenizer_file=tokenizer_file or "",
        text_field=text_field or "text",
    )
