"""What a prepare asks for, and what a data folder already holds: the settings that determine
the shards (recorded in the manifest and in progress.json), whether a folder holds complete shards
made with exactly them, and refusing a folder prepared with others (docs/data.md, "What prepare
locks and refuses").
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from andrea.data import shards
from andrea.data.documents import SHAKESPEARE, SPLITS, Input, identity
from andrea.data.folder import PROGRESS, foreign_files, is_andrea_folder, records
from andrea.data.inputs import names_anything
from andrea.data.readers import InputFile
from andrea.data.shards import MANIFEST, MANIFEST_VERSION, DamagedShard, read_manifest
from andrea.data.tokenizer import BPE_FILE, KINDS, load_tokenizer
from andrea.errors import UserError, listed

SPLIT_RULE = "tail-after-line-break-v1"
RECORD_SPLIT_RULE = "blake2b-8-of-text-v1"


def request_settings(
    source: str, docs: list[Input], kind: str, vocab_size: int | None, val_fraction: float,
    shard_tokens: int, errors: str, tokenizer_blob: bytes | None = None, text_field: str = "text",
) -> dict[str, Any]:
    """Everything that determines the shards' content: equal settings mean nothing to redo."""
    if source == SHAKESPEARE:
        from andrea.data.corpus import corpus_identity

        corpus = corpus_identity()
    else:
        corpus = "files"
    request: dict[str, Any] = {"kind": kind,
                               "vocab_size": vocab_size if KINDS[kind].trained else None}
    if tokenizer_blob is not None:  # a given tokenizer.json: its content, not its path, counts
        request = {"kind": kind, "vocab_size": None,
                   "file_sha256": hashlib.sha256(tokenizer_blob).hexdigest()}
    settings = {
        "manifest_version": MANIFEST_VERSION,
        "shard_format_version": shards.VERSION,
        "source": source,
        "corpus": corpus,
        "inputs": [identity(d) for d in docs],
        "tokenizer_request": request,
        "split": {"rule": SPLIT_RULE, "val_fraction": val_fraction},
        "shard_tokens": shard_tokens,
        "errors": errors,
    }
    if any(isinstance(d, InputFile) and d.reader.has_records for d in docs):
        # Records: the field read, and their own split rule (whole documents by hash).
        settings["text_field"] = text_field
        settings["split"]["record_rule"] = RECORD_SPLIT_RULE
    return settings


def is_current(out: Path, settings: dict[str, Any]) -> bool:
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


@dataclass(frozen=True)
class Stale:
    """Why a folder that was prepared before is prepared again (`line`, said before the work),
    and the tokenizer the new prepare keeps ({kind, identity}: the folder's own, when it was
    made for these same inputs and settings), or None."""

    line: str
    keep_tokenizer: dict[str, str] | None = None
    # Files andrea wrote that its records no longer tell (an unreadable manifest's folder).
    owned: frozenset[str] = frozenset()


def stale(out: Path, settings: dict[str, Any]) -> Stale | None:
    """For a folder that is not current (is_current) and holds no prepare to continue: why it
    is prepared again, in one line; None when nothing was ever prepared there."""
    path = out / MANIFEST
    if not path.is_file():
        if (out / PROGRESS).is_file():
            return Stale(f"{out}: the interrupted prepare here cannot be continued "
                         f"({_unfinished_problem(out, settings)}); preparing it again")
        if is_andrea_folder(out):
            return Stale(f"{out}: holds shards but no {MANIFEST}; preparing it again")
        return None
    try:
        manifest = json.loads(path.read_text("utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
    except (OSError, ValueError) as exc:
        return Stale(f"{path}: unreadable ({exc}); preparing {out} again from its inputs, "
                     "nothing of it kept", owned=frozenset({MANIFEST, BPE_FILE}))
    if {k: manifest.get(k) for k in settings} != settings:
        return Stale(f"{out}: inputs or settings changed since it was prepared; preparing it "
                     "again")
    try:
        tok = manifest["tokenizer"]
        kind, identity = tok["kind"], tok["identity"]
        entries = [e for split in SPLITS for e in manifest["shards"][split]]
        names = [e["file"] for e in entries]
    except (KeyError, TypeError) as exc:
        return Stale(f"{path}: unreadable (no {exc}); preparing {out} again from its inputs, "
                     "nothing of it kept", owned=frozenset({MANIFEST, BPE_FILE}))
    try:
        own = load_tokenizer(kind, out).identity
    except UserError as exc:
        what = f"{out}: its tokenizer cannot be read ({exc})"
    else:
        if own == identity:
            keep = {"kind": kind, "identity": identity}
            kept = f"keeping its {BPE_FILE}" if (out / BPE_FILE).is_file() else "nothing kept"
            return Stale(f"{_damage(out, entries, names, identity)}; preparing {out} again "
                         f"from the same inputs ({kept})", keep)
        what = (f"{out / BPE_FILE}: changed since the shards were made (tokenizer {own}, "
                f"{MANIFEST} says {identity})")
    return Stale(f"{what}; preparing {out} again from the same inputs, nothing kept")


def _damage(out: Path, entries: list[dict[str, Any]], names: list[str], identity: str) -> str:
    """The first shard of a manifest that is missing or not what it lists, in words."""
    for entry, name in zip(entries, names, strict=True):
        try:
            info = shards.read_header(out / name)
        except DamagedShard as exc:
            return f"{exc.path}: {exc.what}"
        if info.count != entry.get("tokens"):
            return f"{out / name}: {info.count:,} tokens, {MANIFEST} says {entry.get('tokens')}"
        if info.identity != identity:
            return f"{out / name}: made with tokenizer {info.identity}, {MANIFEST} says {identity}"
    return f"{out / MANIFEST}: does not match its shards"


def _unfinished_problem(out: Path, settings: dict[str, Any]) -> str:
    """Why the progress record of an interrupted prepare is no resume point, in words."""
    try:
        progress = json.loads((out / PROGRESS).read_text("utf-8"))
        same = progress["settings"] == settings
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{PROGRESS} unreadable: {exc}"
    if not same:
        return "its inputs or settings changed"
    if not progress.get("tokenizer") or not any((progress.get("shards") or {}).values()):
        return "it had no complete shard yet"
    return "a shard it lists is missing or damaged, or its tokenizer changed"


def check_same_request(out: Path, settings: dict[str, Any], tokenizer_file: str = "",
                       source_key: str = "data.source", fixed: bool = False) -> None:
    """A folder holding data (complete or not) prepared from another source or with other
    settings is another run's: never rewritten without --force (`tokenizer_file`: the
    tokenizer.json this request gives, for the command that would; `source_key`: the config
    key that names this source, `data.sources[i].path` for a mixture's, `--input` for
    `prepare --input`'s; `fixed`: a resume, which cannot --set the keys that would take that
    data as it is)."""
    for record in records(out):
        differ = [k for k in REQUEST_KEYS if _request(record, k) != _request(settings, k)]
        names = {i.get("name") for i in record.get("inputs") or [] if isinstance(i, dict)}
        # Another source: spelled otherwise (`notes` and `notes/*.jsonl` derive one folder and
        # share files, but are two runs' data), or spelled the same with no input file in
        # common (renamed, or a folder of other files): no --set asks for those files again.
        if _same_path(record.get("source")) != _same_path(settings.get("source")):
            differ.insert(0, "source")
        elif not names & {i["name"] for i in settings["inputs"]}:
            differ.insert(0, "inputs")
        if differ:
            what = "data" if "tokenizer" in record else "an unfinished prepare"
            tokens = record.get("tokens") if isinstance(record.get("tokens"), dict) else {}
            # Data that holds out more for validation than it trains on (a val_fraction near 1:
            # a few hundred train tokens, or none) is nothing to train on as it is.
            train, val = tokens.get("train"), tokens.get("val")
            usable = what == "data" and "inputs" not in differ and not fixed and not (
                isinstance(train, int) and isinstance(val, int) and train < val)
            use = _sets_for(record, differ, out, source_key) if usable else ""
            # A training can use the data as it is: `prepare --input` names its --set options
            # for andrea train (they are no options of prepare's).
            how = ("train on that data as it is, add to andrea train" if source_key == "--input"
                   else "use that data as it is, add to the command"
                   if source_key == "data.source" or "source" not in differ
                   else "use that data as it is, give")
            raise UserError(
                f"{out}: holds {what} prepared with {_describe(record, differ)}, but this "
                f"{'prepare' if source_key == '--input' else 'run'} asks for "
                f"{_describe(settings, differ)}; andrea does not overwrite it: "
                + (f"to {how} what it was prepared with ({use}); else " if use else "")
                + "use another data folder (--out / data.dir), or replace that data by hand "
                f"with `{shlex.join(prepare_argv(settings, out, tokenizer_file) + ['--force'])}`"
            )


def _same_path(source: Any) -> Any:
    """A source as compared: `notes`, `notes/` and `./notes` are one."""
    return os.path.normpath(source) if isinstance(source, str) and source else source


def _sets_for(record: dict[str, Any], differ: list[str], out: Path,
              source_key: str = "data.source") -> str:
    """The --set options that ask for what `record` (a manifest) was prepared with, for each
    setting in `differ`: how to train on a folder a `prepare --input` made. A mixture's source
    (`source_key` data.sources[i].path) is no --set: the config's line is named instead."""
    sets, edits = [], []
    for key in differ:
        if key == "source" and source_key not in ("data.source", "--input"):
            edits.append(f"{source_key}: {record.get('source')} in the config")
        elif key == "source":
            sets.append(f"data.source={record.get('source')}")
        elif key == "tokenizer_request":
            request = record["tokenizer_request"]
            sets.append(f"data.tokenizer={request.get('kind')}")
            if request.get("file_sha256"):
                sets.append(f"data.tokenizer_file={_tokenizer_file(record, out)}")
            elif request.get("vocab_size"):
                sets.append(f"model.vocab_size={request['vocab_size']}")
        elif _request(record, key) is not None:  # None: a setting that record never used
            sets.append(f"data.{key}={_request(record, key)}")
    return "; ".join(edits + ([" ".join(shlex.join(["--set", one]) for one in sets)]
                              if sets else []))


REQUEST_KEYS = ("tokenizer_request", "val_fraction", "shard_tokens", "errors", "text_field")


def _request(record: dict[str, Any], key: str) -> Any:
    if key == "val_fraction":
        return (record.get("split") or {}).get("val_fraction")
    return record.get(key)


def _describe(record: dict[str, Any], keys: list[str]) -> str:
    """The named settings of a manifest or request, in words."""
    words = []
    for key in keys:
        value = _request(record, key) if key != "source" else record.get("source")
        if key == "tokenizer_request" and isinstance(value, dict):
            kind = value.get("kind")
            if value.get("file_sha256"):
                words.append(f"tokenizer {kind} from a tokenizer.json "
                             f"(sha256 {str(value['file_sha256'])[:8]})")
            elif value.get("vocab_size"):
                words.append(f"tokenizer {kind} ({value['vocab_size']} ids)")
            else:
                words.append(f"tokenizer {kind}")
        elif key == "inputs":
            words.append("the files " + listed(
                [str(i.get("name")) for i in record.get("inputs") or [] if isinstance(i, dict)]))
        else:  # None: a setting the request does not use (text_field without record files)
            words.append(f"{key} {'unused' if value is None else value}")
    return ", ".join(words)


def prepare_argv(record: dict[str, Any], out: Path, tokenizer_file: str = "") -> list[str]:
    """`andrea prepare` asking for what `record` (a manifest, a progress record's or a request's
    settings) records, into `out`: its input, tokenizer, and each setting that differs from the
    data section's default. A given tokenizer.json is `tokenizer_file`, else the one the record
    names (`copied_from`) or the folder's copy, whichever still has the recorded content.
    Raises KeyError or TypeError on a record that lacks what a prepare needs."""
    from andrea.config import DataConfig

    default, request = DataConfig(), record["tokenizer_request"]
    kind = request["kind"]
    argv = ["andrea", "prepare", "--input", str(record["source"]), "--tokenizer", kind]
    if request.get("file_sha256"):
        argv += ["--tokenizer-file", tokenizer_file or _tokenizer_file(record, out)]
    elif KINDS[kind].trained:
        argv += ["--vocab-size", str(int(request["vocab_size"]))]
    argv += ["--out", str(out)]
    if record["errors"] != default.errors:
        argv += ["--errors", str(record["errors"])]
    if record.get("text_field", default.text_field) != default.text_field:
        argv += ["--text-field", str(record["text_field"])]
    for key, value in (("val_fraction", record["split"]["val_fraction"]),
                       ("shard_tokens", record["shard_tokens"])):
        if value != getattr(default, key):
            argv += ["--set", f"data.{key}={value}"]
    return argv


def _tokenizer_file(record: dict[str, Any], out: Path) -> str:
    """The tokenizer.json a prepare of `record` was given: where it was copied from, or the
    folder's copy, whichever still has the content the record's request names."""
    want = record["tokenizer_request"]["file_sha256"]
    named = str((record.get("tokenizer") or {}).get("copied_from") or "")
    for path in filter(None, (named, str(out / BPE_FILE))):
        try:
            if hashlib.sha256(Path(path).read_bytes()).hexdigest() == want:
                return path
        except OSError:
            continue
    return named or str(out / BPE_FILE)


def recorded_command(folder: Path) -> str | None:
    """The command that prepares `folder` again from what it records (prepare_argv), quoted
    for a shell and in backticks; without --force, so a folder whose shards alone are damaged
    keeps its tokenizer and an interrupted prepare continues. It runs as printed from where
    its input is (said when that is not here). None when the folder records nothing readable."""
    found = records(folder)
    try:
        argv = prepare_argv(found[0], folder) if found else None
    except (KeyError, TypeError, ValueError, AttributeError):
        argv = None
    if argv is None:
        return None
    source = str(found[0]["source"])
    where = ""
    if source != SHAKESPEARE and not names_anything(source):
        where = f" (from the folder its input {source} is relative to: it is not here)"
    return f"`{shlex.join(argv)}`{where}"


def prepare_again(folder: Path) -> str:
    """How to prepare `folder` again, as the end of a one-line error: the command it records
    (recorded_command), or, when it records nothing readable, what to do instead."""
    command = recorded_command(folder)
    if command is not None:
        return f"prepare it again: {command}"
    if not (folder / MANIFEST).exists():
        held = foreign_files(folder)
        if held:  # the user's own files, which prepare never writes among
            return (f"it holds {held}; if that is the text to prepare: `andrea prepare --input "
                    f"{shlex.quote(str(folder))}` (it names the folder under data/ it writes)")
        return f"prepare text into it: andrea prepare --input PATH --out {shlex.quote(str(folder))}"
    return ("its inputs are not recorded anywhere readable: prepare it again with the command "
            "that made it, adding --force")


shards.prepare_again = prepare_again  # DamagedFolder's messages end with it
