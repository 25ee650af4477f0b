"""`andrea prepare`: text in, token shards out (docs/data.md describes every rule here).

Inputs (andrea/data/readers.py): text files, whole documents each, or the embedded Shakespeare's
plays; JSON Lines, Parquet, CSV and `datasets` Arrow files, one document per record. A whole text's
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

import functools
import hashlib
import json
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from andrea.data.documents import (
    SHAKESPEARE,
    SPLITS,
    Settings,
    documents,
)
from andrea.data.encode import auto_workers, refuse_in_a_starting_worker
from andrea.data.folder import (
    PROGRESS,
    DataLock,
    FolderInUse,
    check_owned,
    clear,
    keep_complete,
    owned_files,
    remove_unlisted,
)
from andrea.data.request import (
    check_same_request,
    is_current,
    prepare_argv,
    request_settings,
    stale,
)
from andrea.data.shards import MANIFEST, read_manifest
from andrea.data.stops import (
    disk_full_error,
    estimate_bytes,
    kept_words,
    stop_on_signals,
    stopped_line,
    warn_if_short,
)
from andrea.data.tokenizer import BPE_FILE, KINDS, read_tokenizer_file
from andrea.data.writer import mark_started, resume_point, write_shards
from andrea.errors import UserError, counted
from andrea.fileio import atomic_write_text, is_disk_full

if TYPE_CHECKING:
    from andrea.config import Config, DataConfig


def _check_arguments(
    tokenizer: str, errors: str, val_fraction: float, shard_tokens: int, workers: int,
    text_field: str,
) -> None:
    if tokenizer not in KINDS:
        raise UserError(f"--tokenizer: '{tokenizer}' is not one of {', '.join(KINDS)}")
    if errors not in ("strict", "replace"):
        raise UserError(f"--errors: '{errors}' is not one of strict, replace")
    if not 0 < val_fraction < 1:
        raise UserError(f"val fraction {val_fraction} must be in (0, 1)")
    if shard_tokens <= 0:
        raise UserError(f"data.shard_tokens: {shard_tokens} must be a positive number of tokens")
    _check_workers(workers)
    if not text_field.strip():
        raise UserError("--text-field: give the name of the field that holds the text")


def _check_workers(workers: int) -> None:
    if workers < 0:
        raise UserError(
            f"--workers (data.workers): {workers} is negative; give 0 (automatic) or a number "
            "of encoding processes"
        )


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
    source_key: str = "data.source",
    fixed: bool = False,
) -> Path:
    """Tokenize `inputs` ("shakespeare", a file, a directory, a glob or a `datasets` folder)
    into shards in `out`.

    `vocab_size` is the BPE's total id count (bpe only). `tokenizer_file` (bpe only): an
    existing tokenizer.json copied into `out` and used as is instead of training (then
    `vocab_size` is ignored). `text_field`: the field (JSON) or column (Parquet, CSV, Arrow) that
    holds the text. Returns `out`. Does nothing when `out` already holds shards from the same
    inputs and settings, unless `force`; continues an interrupted prepare of the same inputs
    from its last complete shard. `announce` is printed just before the work starts.

    `out` must be empty or andrea's; one holding data prepared with other settings is refused
    unless `force` (the refusal names `source_key`, the config key that gave `inputs`, and
    with `fixed`, a resume's, no --set of the data keys it cannot change). The
    work holds the folder's lock: a second prepare of `out` waits for the first, then uses its
    result when it is what this one asks for.
    """
    refuse_in_a_starting_worker("andrea's prepare")
    blob, vocab_size = _given_tokenizer(
        tokenizer, errors, val_fraction, shard_tokens, workers, text_field, vocab_size,
        tokenizer_file)
    out = Path(out)
    docs = documents(inputs, out, say=lambda line: print(line, flush=True))
    settings = request_settings(
        inputs, docs, tokenizer, vocab_size, val_fraction, shard_tokens, errors, blob, text_field
    )
    if not force and is_current(out, settings):
        if verbose:
            print(f"{out}: up to date (inputs unchanged; --force redoes it)")
        return out
    check_owned(out)  # before anything is written there, the lock file included
    check_request = functools.partial(check_same_request, tokenizer_file=tokenizer_file,
                                      source_key=source_key, fixed=fixed)
    if not force:  # and again under the lock: a prepare may be running
        check_request(out, settings)
    total = sum(d.size for d in docs)
    write = functools.partial(
        write_shards, out, docs, tokenizer, vocab_size, shard_tokens,
        workers or auto_workers(docs), total, Settings(val_fraction, text_field, errors),
        settings, blob)
    _prepare_locked(out, settings, force, blob, verbose, announce, write, tokenizer_file,
                    text_field, estimate_bytes(docs, tokenizer, vocab_size), check_request)
    return out


def _given_tokenizer(
    tokenizer: str, errors: str, val_fraction: float, shard_tokens: int, workers: int,
    text_field: str, vocab_size: int | None, tokenizer_file: str,
) -> tuple[bytes | None, int | None]:
    """The arguments checked; (a given tokenizer.json's bytes, the BPE's vocab size to train:
    None with a given one)."""
    _check_arguments(tokenizer, errors, val_fraction, shard_tokens, workers, text_field)
    if tokenizer_file:
        if KINDS[tokenizer].file is None:
            raise UserError(f"--tokenizer-file applies to --tokenizer bpe only, not {tokenizer}")
        blob, _ = read_tokenizer_file(tokenizer_file)  # read before clear: it may be in `out`
        return blob, None
    if KINDS[tokenizer].trained and vocab_size is None:
        raise UserError("--tokenizer bpe needs --vocab-size (the BPE's id count incl. end-of-text)")
    return None, vocab_size


def _prepare_locked(
    out: Path, settings: dict[str, Any], force: bool, blob: bytes | None, verbose: bool,
    announce: str | None, write: Callable[[dict[str, Any] | None], dict[str, Any]],
    tokenizer_file: str, text_field: str, estimate: int,
    check_request: Callable[[Path, dict[str, Any]], None],
) -> None:
    """Holding the folder's lock: use what another process prepared meanwhile, or write the
    shards (`write(resume point)`, `estimate` bytes in all) and the manifest. Stopped
    short by anything (Ctrl-C, SIGTERM, a full disk, bad input), the complete shards stay, and
    the folder with them (`_stopped`)."""
    try:
        lock = DataLock(out).acquire()
    except FolderInUse as in_use:
        # Trainings read the folder: refused if this would rewrite it, not if it is what this
        # asks for (a sweep's second training, which waited for the first's prepare).
        if force or not is_current(out, settings):
            raise
        if in_use.waited or verbose:
            print(f"{out}: prepared by the other process meanwhile; using it", flush=True)
        return
    failed = True
    try:
        if not force and is_current(out, settings):  # another process prepared it meanwhile
            if lock.waited or verbose:
                print(f"{out}: prepared by the other process meanwhile; using it", flush=True)
        else:
            check_owned(out)
            resume = _start(out, settings, force, blob, announce, check_request)
            done = _written_bytes(out, resume)
            warn_if_short(out, estimate - done, settings["tokenizer_request"]["kind"],
                          resuming=resume is not None)
            try:
                result = write(resume)
            except BaseException as exc:
                count, tokens, size = keep_complete(out)
                failed = count == 0
                as_line = _stop_message(out, exc, count, tokens, max(0, estimate - size))
                if as_line is not None:
                    raise as_line from None
                raise
            _finish(out, {**settings, **result}, tokenizer_file, text_field, verbose)
        failed = False
    finally:
        lock.release(remove_created=failed)


def _written_bytes(out: Path, resume: dict[str, Any] | None) -> int:
    """The bytes of the complete shards a resumed prepare continues after."""
    if resume is None:
        return 0
    return sum((out / e["file"]).stat().st_size for s in SPLITS for e in resume["shards"][s])


def _start(
    out: Path, settings: dict[str, Any], force: bool, blob: bytes | None, announce: str | None,
    check_request: Callable[[Path, dict[str, Any]], None],
) -> dict[str, Any] | None:
    """Under the lock, before the work: refuse another run's data (unless `force`, by
    `check_request`), find the resume point, and leave the folder holding only what this
    prepare continues from."""
    if not force:
        check_request(out, settings)
    resume = None if force else resume_point(out, settings)
    if resume is not None:  # write_shards says what it continues after
        remove_unlisted(out, {e["file"] for s in SPLITS for e in resume["shards"][s]})
        return resume
    why = None if force else stale(out, settings)
    if why is not None:  # never "(first run only)" on a folder prepared before
        print(why.line, flush=True)
    elif announce:
        print(announce, flush=True)
    owned = owned_files(out) | (why.owned if why is not None else set())
    bpe = out / BPE_FILE
    if (KINDS[settings["tokenizer_request"]["kind"]].file and bpe.exists() and BPE_FILE not in owned
            and (blob is None or bpe.read_bytes() != blob)):
        raise UserError(
            f"{bpe}: a {BPE_FILE} andrea did not write is in the way of the BPE this prepare "
            "writes; move it, or choose another data folder (--out / data.dir)"
        )
    keep = why.keep_tokenizer if why is not None else None
    mark_started(out, settings, keep)  # the folder stays marked as andrea's while it is cleared
    clear(out, owned - {PROGRESS} - ({BPE_FILE} if keep else set()))
    # Kept, the folder's tokenizer makes the record a resume point with no shard written yet.
    return resume_point(out, settings) if keep else None


def _stop_message(
    out: Path, exc: BaseException, count: int, tokens: int, rest: int
) -> UserError | None:
    """What the user reads when the writing stopped short, `count` complete shards kept: a
    signal's one line (printed here), a full disk's (the UserError returned, to raise in place
    of the OSError); bad input keeps its own line; a crash gets what was kept above its
    traceback."""
    if isinstance(exc, KeyboardInterrupt):
        print(stopped_line(exc, out, count, tokens), file=sys.stderr, flush=True)
    elif is_disk_full(exc):
        assert isinstance(exc, OSError)
        return disk_full_error(exc, out, count, tokens, rest)
    elif count and not isinstance(exc, UserError):
        print(f"{kept_words(out, count, tokens)}; once the error below is fixed, the same "
              "command continues from there", file=sys.stderr, flush=True)
    return None


def _finish(
    out: Path, manifest: dict[str, Any], tokenizer_file: str, text_field: str, verbose: bool
) -> None:
    """Write the manifest (the 'complete' mark), drop the progress record, say what was made."""
    if tokenizer_file:
        manifest["tokenizer"]["copied_from"] = str(tokenizer_file)
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
    (out / PROGRESS).unlink(missing_ok=True)
    if verbose:
        n = manifest["tokens"]
        skipped, replaced = manifest["skipped_records"], manifest["replaced_bytes"]
        print(
            f"{out}: {n['train']:,} train + {n['val']:,} val tokens, tokenizer "
            f"{manifest['tokenizer']['identity']} ({manifest['tokenizer']['vocab_size']:,} ids)"
            + (f"; skipped {counted(skipped, 'record')} without a string '{text_field}' (or not "
               "JSON objects)" if skipped else "")
            + (f"; replaced {replaced:,} invalid UTF-8 byte{'s' if replaced != 1 else ''} with "
               "U+FFFD" if replaced else "")
        )


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
    suffix = f"-{vocab_size}" if KINDS[tokenizer].trained else ""
    if KINDS[tokenizer].file and tokenizer_file:
        suffix = f"-tok{_file_tag(tokenizer_file)}"
    return Path("data") / f"{name}-{tokenizer}{suffix}"


def data_dir_for(cfg: Config) -> Path:
    """The data dir of `cfg` (of its first source, for a mixture)."""
    return run_sources(cfg)[0][1]


def run_sources(cfg: Config) -> list[tuple[str, Path, float]]:
    """(input, data dir, weight) of each source a run reads: those of data.sources, or
    data.source's alone (weight 1) in data.dir or data/<name>-<tokenizer>..."""
    d = cfg.data
    if d.sources:
        return source_dirs(cfg)
    if d.dir:
        return [(d.source, Path(d.dir), 1.0)]
    return [(d.source, default_data_dir(d.source, d.tokenizer, cfg.model.vocab_size,
                                        d.tokenizer_file), 1.0)]


def source_dirs(cfg: Config) -> list[tuple[str, Path, float]]:
    """(path, data dir, weight) of each of data.sources: each prepared on its own, in
    data/<name>-<tokenizer>... (or under data.dir when it is set)."""
    d = cfg.data
    out = []
    for entry in d.sources:
        path = entry["path"]
        derived = default_data_dir(path, d.tokenizer, cfg.model.vocab_size, d.tokenizer_file)
        out.append((path, Path(d.dir) / derived.name if d.dir else derived, entry["weight"]))
    first: dict[Path, int] = {}
    for j, (path, folder, weight) in enumerate(out):
        i = first.setdefault(folder, j)
        if i == j:
            continue
        where = f"{cfg.source}: data.sources[{i}] and data.sources[{j}]"
        if os.path.realpath(out[i][0]) == os.path.realpath(path):
            # Renaming files cannot part one input listed twice (`a`, `./a`, `a/`).
            raise UserError(f"{where} both name {out[i][0]}; list it once, with their weights "
                            f"added (weight: {out[i][2] + weight:g})")
        raise UserError(
            f"{where} ({out[i][0]}, {path}) would share the data dir {folder}, which is named "
            f"after a source's file or folder (up to any glob character); rename one of the "
            f"files, or move one source's files into a folder of another name and give that"
        )
    return out


def check_vocab(tokenizer_vocab: int, model_vocab: int, where: str) -> None:
    """The model's embedding must have a row for every id the tokenizer can produce."""
    if tokenizer_vocab > model_vocab:
        raise UserError(
            f"{where}: the tokenizer has {tokenizer_vocab:,} ids but model.vocab_size is "
            f"{model_vocab:,}; give the model a row per id: --set model.vocab_size="
            f"{tokenizer_vocab} (or more; in a config, model: {{vocab_size: {tokenizer_vocab}}})"
        )


def prepare_from_config(
    cfg: Config, force: bool = False, verbose: bool = True, announce: str | None = None,
    fixed: bool = False,
) -> Path:
    """Prepare the shards that `cfg.data` describes (BPE vocab = model.vocab_size, unless
    data.tokenizer_file gives the BPE); `fixed`: for a resume, whose data keys cannot change."""
    d = cfg.data
    kind = KINDS[d.tokenizer]
    if kind.fixed_vocab is not None:
        check_vocab(kind.fixed_vocab, cfg.model.vocab_size, cfg.source)
    if kind.file and d.tokenizer_file:
        given = read_tokenizer_file(d.tokenizer_file)[1]
        where = f"data.tokenizer_file {d.tokenizer_file}"
        check_vocab(given.vocab_size, cfg.model.vocab_size, where)
    sources = run_sources(cfg)
    if kind.trained and not d.tokenizer_file and len(sources) > 1:
        first, folder, _ = sources[0]  # where the config would prepare it: a BPE to share
        argv = prepare_argv({  # the first source's request, as a command
            "source": first, "errors": d.errors, "text_field": d.text_field,
            "tokenizer_request": {"kind": d.tokenizer, "vocab_size": cfg.model.vocab_size},
            "split": {"val_fraction": d.val_fraction}, "shard_tokens": d.shard_tokens,
        }, folder)
        raise UserError(
            f"{cfg.source}: data.sources: {len(sources)} sources with data.tokenizer "
            f"{d.tokenizer} would each train a BPE of their own, and a mixture needs one; "
            f"train it on one source, `{shlex.join(argv)}`, then add `--set "
            f"data.tokenizer_file={folder / str(kind.file)}` to this command")
    identities: dict[str, Path] = {}
    for i, (source, target, _) in enumerate(sources):
        out = prepare_inputs(
            source, d.tokenizer, target,
            vocab_size=cfg.model.vocab_size if kind.trained else None,
            force=force, errors=d.errors, workers=d.workers, val_fraction=d.val_fraction,
            shard_tokens=d.shard_tokens, verbose=verbose,
            announce=announce if not d.sources or announce is None
            else f"preparing {target} from {source} (first run only)",
            tokenizer_file=d.tokenizer_file if kind.file else "",
            text_field=d.text_field,
            source_key=f"data.sources[{i}].path" if d.sources else "data.source",
            fixed=fixed,
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


def ensure_prepared(cfg: Config, fixed: bool = False) -> Path:
    """The data dir for `cfg`, preparing it first (with one line saying so) if missing or stale.

    In multi-process training call it on rank 0 alone and let the others wait for it and hear
    its error (train.collectives.from_rank0). Separate commands take turns on the folder's
    lock; a folder holding data prepared with other settings is refused, never rewritten
    (docs/data.md, "What prepare locks and refuses"); `fixed`: a resume's, which names no
    --set of the data keys it cannot change.
    """
    announce = f"preparing {data_dir_for(cfg)} from {source_words(cfg)} (first run only)"
    return prepare_from_config(cfg, verbose=False, announce=announce, fixed=fixed)


def source_words(cfg: Config) -> str:
    """What data.source names, in words for a message."""
    source = cfg.data.source
    return "the embedded Shakespeare corpus" if source == SHAKESPEARE else source


@stop_on_signals()  # SIGTERM stops it as Ctrl-C does: the complete shards kept, one line
def prepare_command(
    config: str | None = None,
    overrides: list[str] | None = None,
    *,
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
    if workers is not None:
        _check_workers(workers)
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
    if input is None or not input.strip():
        raise UserError("prepare: give --config X (e.g. andrea-12m) or --input FILE|DIR|GLOB")
    d = input_settings(overrides, dict(
        tokenizer=tokenizer, dir=out, errors=errors, workers=workers,
        tokenizer_file=tokenizer_file, text_field=text_field))
    kind, tokenizer_file = d.tokenizer, d.tokenizer_file or None
    if tokenizer_file is not None:
        if vocab_size is not None:
            raise UserError(f"--vocab-size {vocab_size}: the tokenizer file {tokenizer_file} "
                            "gives the vocab size; drop --vocab-size")
        if kind not in KINDS or KINDS[kind].file is None:
            raise UserError(f"--tokenizer {kind}: --tokenizer-file {tokenizer_file} is a BPE "
                            "tokenizer; drop --tokenizer (or give --tokenizer bpe)")
    elif kind in KINDS and KINDS[kind].trained and vocab_size is None:
        vocab_size = 4096
    if not (kind in KINDS and KINDS[kind].trained) and vocab_size is not None:
        raise UserError(f"--vocab-size applies to --tokenizer bpe only, not {kind}")
    target = Path(d.dir) if d.dir else default_data_dir(
        input, kind, vocab_size or 0, tokenizer_file or "")
    return prepare_inputs(
        input, kind, target, vocab_size=vocab_size, force=force, errors=d.errors,
        workers=d.workers, val_fraction=d.val_fraction, shard_tokens=d.shard_tokens,
        tokenizer_file=tokenizer_file or "", text_field=d.text_field, source_key="--input",
    )


def input_settings(overrides: list[str] | None, flags: dict[str, Any]) -> DataConfig:
    """`prepare --input`'s data settings: `--set data.KEY=VALUE` checked as in a config (the
    data section's declarations), then the flags given, which name the same keys and win (as
    with --config); prepare_inputs checks their values. --input names the input, so
    data.source and data.sources have no place here."""
    from andrea.config import load_config, parse_override

    for text in overrides or []:
        section, key, _ = parse_override(text)
        if key in ("source", "sources"):
            raise UserError(f"--set {text}: --input names the input; give one of the two")
        if section != "data":
            raise UserError(f"--set {text}: prepare --input takes data keys only (shard_tokens, "
                            f"val_fraction, text_field, ...); {section} keys go with --config")
    cfg = load_config(None, overrides or [])
    for key, value in flags.items():
        if value is not None:
            setattr(cfg.data, key, value)
    return cfg.data

