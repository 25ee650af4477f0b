"""Inputs as jobs, and jobs as documents: what `andrea prepare` reads and how it splits it.

`documents` lists the inputs of a source (the embedded plays, or files through
andrea/data/inputs.py). `all_jobs` cuts them into jobs of about CHUNK_BYTES in a fixed order (a
job number names the same piece of input in every run: what a resumed prepare skips to), each
file by its format's reader (andrea/data/readers.py).
`job_documents`, run in a worker, turns a job into (split, text) documents: a whole text's tail
goes to val, a record goes to val by a hash of its text.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from andrea.data.folder import is_andrea_folder
from andrea.data.inputs import input_files, input_identity
from andrea.data.readers import InputFile, Job, iter_blocks, refuse_binary
from andrea.data.shards import SPLITS
from andrea.errors import UserError, listed

SHAKESPEARE = "shakespeare"
CHUNK_BYTES = 1 << 20


# ----------------------------------------------------------------------------- inputs


@dataclass
class Document:
    """A whole-text document (a text file, or one play of the embedded corpus)."""

    name: str  # a file path, or "shakespeare/<genre>/<play>"
    size: int
    open: Callable[[], BinaryIO]
    sha256: str


Input = Document | InputFile


def documents(
    source: str, out: Path | None = None, say: Callable[[str], None] = print
) -> list[Input]:
    """The inputs of `source`: "shakespeare" (the embedded corpus, one Document per play) or a
    file, directory, glob or `datasets` folder (one InputFile each). Folders that hold prepared
    data, and the output folder `out`, are never input: skipped, and `say` says so once."""
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
    skipped: list[Path] = []
    target = out.resolve() if out is not None else None

    def prepared(folder: Path) -> bool:
        if folder.resolve() == target or is_andrea_folder(folder):
            skipped.append(folder)
            return True
        return False

    files: list[Input] = list(input_files(source, prepared))
    if skipped:
        say(f"{source}: skipping {listed([str(p) for p in skipped])}: prepared data or the "
            "output folder, not input")
    if sum(f.size for f in files) == 0:
        raise UserError(f"{source}: input is empty ({len(files)} file(s), 0 bytes); give a "
                        "file, folder or glob that holds text")
    return files


def identity(item: Input) -> dict[str, Any]:
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


REPLACE = "andrea-replace"  # Python's 'replace' that also counts what it replaced
_replaced = [0]


def _count_and_replace(exc: UnicodeError) -> tuple[str | bytes, int]:
    """U+FFFD for each invalid UTF-8 sequence (decoding), as errors='replace' does, and for each
    lone surrogate (encoding, where errors='replace' writes '?': U+FFFD is what we promise for
    input that is not Unicode); the replaced bytes or characters counted."""
    if isinstance(exc, UnicodeDecodeError):
        _replaced[0] += exc.end - exc.start
        return "\ufffd", exc.end
    if isinstance(exc, UnicodeEncodeError):
        # A run of surrogates is one error; the UTF-8 encoder takes only ASCII as a str, so
        # U+FFFD goes as its bytes.
        _replaced[0] += exc.end - exc.start
        return "\ufffd".encode() * (exc.end - exc.start), exc.end
    raise exc


codecs.register_error(REPLACE, _count_and_replace)


def _handler(errors: str) -> str:
    return REPLACE if errors == "replace" else errors


def _decode(chunk: bytes, offset: int, name: str, errors: str) -> str:
    try:
        return chunk.decode("utf-8", errors=_handler(errors))
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{name}: invalid UTF-8 at byte offset {offset + exc.start}; fix the file or "
            "pass --errors replace (data.errors=replace)"
        ) from None


# ----------------------------------------------------------------------------- jobs


def _as_document(f: InputFile, scratch: Path) -> Document:
    """A text file as a seekable Document; a compressed one is first decompressed (checked
    for truncation) to a scratch file in the output folder, removed once read."""
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
        refuse_binary(doc.name, f.read(8192))
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
    elif item.reader.jobs is None:
        try:
            yield from _text_jobs(_as_document(item, scratch), val_fraction, skip, item.size)
        finally:
            scratch.unlink(missing_ok=True)
    else:
        yield from item.reader.jobs(item, text_field, skip)


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


MISSING = object()  # a record without the text field


def field_value(obj: dict[str, Any], field: str) -> Any:
    """obj[field], or for a dotted path `doc.body` obj["doc"]["body"] (a key that itself holds
    the dots wins); MISSING when there is no such field."""
    if field in obj:
        return obj[field]
    value: Any = obj
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def _record_text(value: Any, where: str, field: str, keys: Any, s: Settings) -> str | None:
    """A record's text, or None (counted as skipped) when it has none and errors != strict."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8", errors=_handler(s.errors))
        except UnicodeDecodeError as exc:
            raise UserError(
                f"{where}: invalid UTF-8 in field '{field}' at byte {exc.start}; fix the input "
                "or pass --errors replace (data.errors=replace)"
            ) from None
    if isinstance(value, str):
        return value
    if s.errors == "strict":
        what = ("is missing" if value is MISSING else "is null, not a string" if value is None
                else f"is {type(value).__name__}, not a string")
        has = f" (fields: {', '.join(map(str, keys))})" if keys is not None else ""
        raise UserError(
            f"{where}: field '{field}' {what}{has}; choose the field with "
            "--text-field (data.text_field; a dotted path such as doc.body reaches into objects), "
            "or skip such records with --errors replace (data.errors=replace)"
        )
    return None


def _record_line(line: bytes, where: str, s: Settings) -> str | None:
    """The text of one JSON Lines record; None (skipped) for a record without a string text,
    or, with --errors replace, for a line that is not a JSON object."""
    try:
        obj = json.loads(line.decode("utf-8", errors=_handler(s.errors)))
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{where}: invalid UTF-8 at byte {exc.start} of the line; fix the input "
            "or pass --errors replace (data.errors=replace)"
        ) from None
    except json.JSONDecodeError as exc:
        if s.errors == "replace":
            return None
        raise UserError(
            f"{where}: not a JSON object per line ({exc.msg.removesuffix(' at')} at "
            f"column {exc.colno}); fix the line, skip such lines with --errors replace "
            "(data.errors=replace), "
            "or name the file .txt to read it as plain text"
        ) from None
    if not isinstance(obj, dict):
        if s.errors == "replace":
            return None
        raise UserError(
            f"{where}: a JSON {type(obj).__name__}, expected an object; fix the line or skip "
            "such lines with --errors replace (data.errors=replace)"
        )
    return _record_text(field_value(obj, s.text_field), where, s.text_field, obj.keys(), s)


class Tally(NamedTuple):
    """What a job's documents left out or changed, for the manifest and the last line."""

    skipped: int = 0  # records without a string text (or bad lines), under --errors replace
    replaced: int = 0  # invalid UTF-8 bytes (and lone surrogates) replaced, ditto


def job_documents(job: Job, s: Settings) -> tuple[list[tuple[str, str, bool]], Tally]:
    """A job's text as (split, text, end-of-text after it) in order, and its tally."""
    if job.data is None:
        return [], Tally()
    _replaced[0] = 0
    if job.kind == "text":
        split, chunk, offset, last = job.data
        return [(split, _decode(chunk, offset, job.name, s.errors), last)], Tally(0, _replaced[0])
    texts: list[tuple[str, str | None]] = []  # (where it is, for messages; its text)
    if job.kind == "records":
        for i, line in enumerate(job.data.split(b"\n")):
            if line.strip():
                where = f"{job.name}:{job.start + i}"
                texts.append((where, _record_line(line, where, s)))
    else:
        for i, value in enumerate(job.data.to_pylist()):
            where = f"{job.name}: {job.where}, row {job.start + i}"
            texts.append((where, _record_text(value, where, s.text_field, None, s)))
    out, skipped = [], 0
    for where, text in texts:
        if text is None:
            skipped += 1
            continue
        try:
            blob = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from a JSON \\ud800 escape
            if s.errors == "strict":
                raise UserError(
                    f"{where}: field '{s.text_field}' holds invalid Unicode (a lone surrogate); "
                    "fix the input or pass --errors replace (data.errors=replace)"
                ) from None
            blob = text.encode("utf-8", errors=REPLACE)
            text = blob.decode("utf-8")
        out.append(("val" if is_val_record(blob, s.val_fraction) else "train", text, True))
    return out, Tally(skipped, _replaced[0])
