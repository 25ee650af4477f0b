"""`andrea prepare`: text in, token shards out (docs/data.md describes every rule here).

Inputs are documents: each input file, or each play of the embedded Shakespeare corpus. A
document's tail goes to the val split: everything after the first line break at or after
(1 - val_fraction) of its bytes. Each split is written as shards of at most `shard_tokens`
tokens, every document (or document part) followed by end-of-text.

Memory stays bounded for any corpus size: files are read in ~1 MiB chunks cut at line breaks,
encoded in worker processes with a bounded number of chunks in flight, and streamed to disk.
A manifest (input hashes, tokenizer, split settings, shards) is written last, so a directory
without one was never completed; re-running with unchanged inputs and settings does nothing.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import io
import json
import multiprocessing
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from andrea import shards
from andrea.errors import UserError
from andrea.fileio import atomic_write_bytes, atomic_write_text
from andrea.tokenizer import (
    BPE_FILE,
    EOT_TEXT,
    FIXED_VOCAB,
    KINDS,
    BpeTokenizer,
    load_tokenizer,
    train_bpe,
)

if TYPE_CHECKING:
    from andrea.config import Config

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
SPLIT_RULE = "tail-after-line-break-v1"
SPLITS = ("train", "val")
SHAKESPEARE = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")  # what a directory input contributes
CHUNK_BYTES = 1 << 20
BPE_TRAIN_MAX_BYTES = 256 << 20  # BPE learns from at most this much of the train split
PARALLEL_MIN_BYTES = 2 << 20  # below this, automatic `workers` encodes in-process


# ----------------------------------------------------------------------------- inputs


@dataclass
class Document:
    name: str  # a file path, or "shakespeare/<genre>/<play>"
    size: int
    open: Callable[[], BinaryIO]
    sha256: str


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def input_files(spec: str) -> list[Path]:
    """A file, a directory (its *.txt/*.md/*.text/*.rst files, recursively) or a glob; sorted."""
    path = Path(spec)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in TEXT_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise UserError(
                f"{spec}: directory has no text files ({', '.join(TEXT_SUFFIXES)}); "
                "point --input at a file or a glob"
            )
    elif glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise UserError(f"{spec}: the pattern matches no files")
    else:
        raise UserError(f"{spec}: no such file or directory")
    return [p.resolve() for p in files]


def documents(source: str) -> list[Document]:
    """The documents of `source`: "shakespeare" (the embedded corpus) or a file/dir/glob."""
    if source == SHAKESPEARE:
        from andrea.corpus import shakespeare

        docs = []
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
    docs = []
    for path in input_files(source):
        try:
            size, sha = path.stat().st_size, _sha256_file(path)
        except OSError as exc:
            raise UserError(f"{path}: cannot read input: {exc.strerror}") from None
        docs.append(Document(str(path), size, lambda path=path: open(path, "rb"), sha))
    if sum(d.size for d in docs) == 0:
        raise UserError(f"{source}: input is empty ({len(docs)} file(s), 0 bytes)")
    return docs


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


# A piece is (split, text, source bytes); text None marks the end of a document part (end-of-text
# goes there).
Piece = tuple[str, str | None, int]


def pieces(docs: list[Document], val_fraction: float, errors: str) -> Iterator[Piece]:
    """Every document's train part then its val part, as decoded text chunks, in order."""
    for doc in docs:
        with doc.open() as f:
            cut = val_start(f, doc.size, val_fraction)
            for split, (a, b) in zip(SPLITS, ((0, cut), (cut, doc.size)), strict=True):
                if a >= b:
                    continue
                for offset, chunk in read_span(f, a, b):
                    yield split, _decode(chunk, offset, doc.name, errors), len(chunk)
                yield split, None, 0


def _train_texts(docs: list[Document], val_fraction: float, errors: str) -> Iterator[str]:
    seen = 0
    for split, text, nbytes in pieces(docs, val_fraction, errors):
        if split == "train" and text is not None:
            yield text
            seen += nbytes
            if seen >= BPE_TRAIN_MAX_BYTES:
                return


# ----------------------------------------------------------------------------- encoding

_worker_tokenizer: Any = None


def _init_worker(kind: str, data_dir: str | None, in_pool: bool = True) -> None:
    global _worker_tokenizer
    if in_pool:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tokenizer = load_tokenizer(kind, Path(data_dir) if data_dir else None)


def _encode(args: tuple[str, str]) -> np.ndarray:
    text, dtype = args
    return np.asarray(_worker_tokenizer.encode(text), dtype=dtype)


def _encode_all(
    items: Iterator[Piece], kind: str, data_dir: Path, dtype: str, workers: int
) -> Iterator[tuple[str, np.ndarray | None, int]]:
    """Encode pieces in order; at most 2 * workers chunks in flight, so memory is bounded."""
    if workers <= 1:
        _init_worker(kind, str(data_dir), in_pool=False)
        for split, text, n in items:
            yield split, None if text is None else _encode((text, dtype)), n
        return
    ctx = multiprocessing.get_context("spawn")  # no fork: HF tokenizers' threads dislike it
    with ctx.Pool(workers, _init_worker, (kind, str(data_dir))) as pool:
        pending: collections.deque = collections.deque()
        for split, text, n in items:
            job = None if text is None else pool.apply_async(_encode, ((text, dtype),))
            pending.append((split, job, n))
            while len(pending) > 2 * workers:
                s, j, m = pending.popleft()
                yield s, None if j is None else j.get(), m
        while pending:
            s, j, m = pending.popleft()
            yield s, None if j is None else j.get(), m


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


def read_manifest(data_dir: Path) -> dict[str, Any]:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise UserError(
            f"{data_dir}: no prepared data here ({MANIFEST} missing); run `andrea prepare`"
        )
    try:
        manifest = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{path}: unreadable manifest ({exc}); re-run `andrea prepare --force`"
        ) from None
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        raise UserError(f"{path}: manifest version differs; re-run `andrea prepare --force`")
    return manifest


def _settings(
    source: str, docs: list[Document], kind: str, vocab_size: int | None, val_fraction: float,
    shard_tokens: int, errors: str, tokenizer_blob: bytes | None = None,
) -> dict[str, Any]:
    """Everything that determines the shards' content: equal settings mean nothing to redo."""
    if source == SHAKESPEARE:
        from andrea.corpus import corpus_identity

        corpus = corpus_identity()
    else:
        corpus = "files"
    request: dict[str, Any] = {"kind": kind, "vocab_size": vocab_size if kind == "bpe" else None}
    if tokenizer_blob is not None:  # a given tokenizer.json: its content, not its path, counts
        request = {"kind": kind, "vocab_size": None,
                   "file_sha256": hashlib.sha256(tokenizer_blob).hexdigest()}
    return {
        "manifest_version": MANIFEST_VERSION,
        "shard_format_version": shards.VERSION,
        "source": source,
        "corpus": corpus,
        "inputs": [{"name": d.name, "bytes": d.size, "sha256": d.sha256} for d in docs],
        "tokenizer_request": request,
        "split": {"rule": SPLIT_RULE, "val_fraction": val_fraction},
        "shard_tokens": shard_tokens,
        "errors": errors,
    }


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
    for pattern in ("train_*.bin", "val_*.bin", "*.tmp", BPE_FILE):
        for p in out.glob(pattern):
            p.unlink()


# ----------------------------------------------------------------------------- prepare


def auto_workers(total_bytes: int) -> int:
    if total_bytes < PARALLEL_MIN_BYTES:
        return 1
    return max(1, min(os.cpu_count() or 1, 8))


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
) -> Path:
    """Tokenize `inputs` ("shakespeare", a file, a directory or a glob) into shards in `out`.

    `vocab_size` is the BPE's total id count (bpe only). `tokenizer_file` (bpe only): an
    existing tokenizer.json copied into `out` and used as is instead of training (then
    `vocab_size` is ignored). Returns `out`. Does nothing when `out`
    already holds shards from the same inputs and settings, unless `force`. `announce` is
    printed just before the work starts (not when there is nothing to do).
    """
    if tokenizer not in KINDS:
        raise UserError(f"--tokenizer: '{tokenizer}' is not one of {', '.join(KINDS)}")
    if errors not in ("strict", "replace"):
        raise UserError(f"--errors: '{errors}' is not one of strict, replace")
    if not 0 < val_fraction < 1:
        raise UserError(f"val fraction {val_fraction} must be in (0, 1)")
    if shard_tokens <= 0 or workers < 0:
        raise UserError("shard_tokens must be positive and workers non-negative")
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
        inputs, docs, tokenizer, vocab_size, val_fraction, shard_tokens, errors, blob
    )
    if not force and _is_current(out, settings):
        if verbose:
            print(f"{out}: up to date (inputs unchanged; --force redoes it)")
        return out
    if announce:
        print(announce, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    _clear(out)
    total = sum(d.size for d in docs)
    if workers == 0:
        workers = auto_workers(total)
    try:
        result = _write_shards(
            out, docs, tokenizer, vocab_size, val_fraction, shard_tokens, errors, workers, total,
            blob,
        )
    except BaseException:
        _clear(out)  # nothing half-written is left looking valid
        raise
    manifest = {**settings, **result}
    if tokenizer_file:
        manifest["tokenizer"]["copied_from"] = str(tokenizer_file)
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    if verbose:
        n = manifest["tokens"]
        print(
            f"{out}: {n['train']:,} train + {n['val']:,} val tokens, tokenizer "
            f"{manifest['tokenizer']['identity']} ({manifest['tokenizer']['vocab_size']:,} ids)"
        )
    return out


def _write_shards(
    out: Path, docs: list[Document], kind: str, vocab_size: int | None, val_fraction: float,
    shard_tokens: int, errors: str, workers: int, total: int, tokenizer_blob: bytes | None = None,
) -> dict[str, Any]:
    from tqdm import tqdm

    if tokenizer_blob is not None:  # byte for byte, so the identity is the file's
        atomic_write_bytes(out / BPE_FILE, tokenizer_blob)
        tok = BpeTokenizer(out / BPE_FILE)
    elif kind == "bpe":
        assert vocab_size is not None
        tok = train_bpe(_train_texts(docs, val_fraction, errors), vocab_size, out / BPE_FILE)
    else:
        tok = load_tokenizer(kind, out)
    dtype = shards.token_dtype(tok.vocab_size)
    eot = np.array([tok.eot_id], dtype=dtype)
    written: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    writers: dict[str, shards.ShardWriter | None] = {s: None for s in SPLITS}

    def emit(split: str, tokens: np.ndarray) -> None:
        while len(tokens):
            w = writers[split]
            if w is None:
                name = f"{split}_{len(written[split]):06d}.bin"
                w = writers[split] = shards.ShardWriter(out / name, dtype, tok.identity)
            room = shard_tokens - w.count
            w.write(tokens[:room])
            tokens = tokens[room:]
            if w.count == shard_tokens:
                written[split].append({"file": w.path.name, "tokens": w.close().count})
                writers[split] = None

    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"prepare {out.name}", disable=None)
    try:
        stream = _encode_all(pieces(docs, val_fraction, errors), kind, out, dtype.str, workers)
        for split, ids, nbytes in stream:
            emit(split, eot if ids is None else ids)
            bar.update(nbytes)
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
            f"{val_fraction}); add text or raise data.val_fraction"
        )
    return {
        "tokenizer": {
            "kind": kind, "identity": tok.identity, "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
        },
        "shards": written,
        "tokens": counts,
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
    d = cfg.data
    if d.dir:
        return Path(d.dir)
    return default_data_dir(d.source, d.tokenizer, cfg.model.vocab_size, d.tokenizer_file)


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
    out = prepare_inputs(
        d.source, d.tokenizer, data_dir_for(cfg),
        vocab_size=cfg.model.vocab_size if d.tokenizer == "bpe" else None,
        force=force, errors=d.errors, workers=d.workers, val_fraction=d.val_fraction,
        shard_tokens=d.shard_tokens, verbose=verbose, announce=announce,
        tokenizer_file=d.tokenizer_file if d.tokenizer == "bpe" else "",
    )
    check_vocab(read_manifest(out)["tokenizer"]["vocab_size"], cfg.model.vocab_size, str(out))
    return out


def ensure_prepared(cfg: Config) -> Path:
    """The data dir for `cfg`, preparing it first (with one line saying so) if missing or stale.

    Call it on one process only (rank 0) and let the others wait: two concurrent prepares of
    the same directory would clear each other's files.
    """
    d = cfg.data
    what = "the embedded Shakespeare corpus" if d.source == SHAKESPEARE else d.source
    announce = f"preparing {data_dir_for(cfg)} from {what} (first run only)"
    return prepare_from_config(cfg, verbose=False, announce=announce)


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
    )
