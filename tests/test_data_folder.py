"""The data folder is never lost: another run's data is refused, an input folder never eats its
own output, two processes preparing one folder take turns, and files andrea did not write are
never deleted. Every case through the real `andrea` command; each fails on the code before the
folder lock and ownership rules (docs/data.md, "What prepare locks and refuses")."""

from __future__ import annotations

import codecs
import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    andrea_main,
    assert_user_error,
    make_checkpoint,
    python_command,
    wait_until,
)

from andrea.config import load_config
from andrea.data import prepare
from andrea.data.folder import LOCK, DataLock
from andrea.data.shards import open_shard, read_manifest

LINE = "Line {j} of {name}: the quick brown fox jumps over the lazy dog.\n"
# Byte tokens, 20,000 per shard: the ~100 KB corpus makes 5 train shards, so a prepare can be
# paused inside its third one with complete shards before it.
SHARDS = ("--set", "data.shard_tokens=20000")


def write_corpus(root: Path, lines: int = 800) -> Path:
    for name in ("a.txt", "sub/b.txt"):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(LINE.format(j=j, name=name) for j in range(lines)))
    return root


def snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file of the folder, as it is, but the lock file: each training that reads the
    folder names itself there (andrea/data/folder.py)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.iterdir()) if p.name != LOCK}


def tokens(folder: Path, split: str) -> np.ndarray:
    entries = read_manifest(folder)["shards"][split]
    return np.concatenate([open_shard(folder / e["file"]) for e in entries]).astype(np.int64)


def start(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`andrea ARGS` started in a process of its own."""
    return subprocess.Popen(
        python_command("-m", "andrea", *args), cwd=cwd, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # Ctrl-C as at a terminal: a suite started in the background (`cmd &` in a script) hands
        # its children SIGINT ignored, and Python then never raises KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(*procs: subprocess.Popen | None, timeout: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of each started command (empty for None); all killed if they have not
    ended by `timeout` (a failing test must not leave a paused prepare behind)."""
    try:
        return [p.communicate(timeout=timeout) if p else ("", "") for p in procs]
    finally:
        for p in procs:
            if p:
                p.kill()


def wait_for_line(stream, pattern: str, timeout: float = 120) -> tuple[str | None, list[str]]:
    """Read `stream` until a line matches `pattern` (returned) or it ends (None); with the lines
    read. A thread reads, so a silent process cannot hang the test past `timeout`."""
    seen: list[str] = []
    found: list[str] = []

    def read() -> None:
        for line in stream:
            seen.append(line)
            if re.search(pattern, line):
                found.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return (found[0] if found else None), seen


def take_turns(
    first_args: tuple[str, ...], second_args: tuple[str, ...], cwd: Path, second_says_on: str,
    timeout: float = 120,
) -> tuple[str, subprocess.Popen, subprocess.Popen, list[tuple[str, str]]]:
    """Two andrea commands on one data folder at once: the first is paused in its third shard,
    holding the folder's lock, until the second says it is waiting (on its stdout or stderr,
    `second_says_on`); then both run to the end. Returns the second's "waiting" line, both
    processes and their (stdout, stderr), the lines already read left out."""
    go = cwd / "go"
    first = start(*first_args, cwd=cwd,
                  env={"ANDREA_FAULTS": f"prepare-pause@train_000002.bin:{go}"})
    second = None
    try:
        paused, seen = wait_for_line(first.stderr, "paused in")
        assert paused, seen
        second = start(*second_args, cwd=cwd)
        waiting, seen = wait_for_line(getattr(second, second_says_on), "waiting")
        assert waiting, seen
    finally:
        go.touch()
        outputs = finish(first, second, timeout=timeout)
    return waiting, first, second, outputs


def test_training_on_a_folder_prepare_made_names_what_it_was_prepared_with(tmp_path):
    """`prepare --input FILE --out X`, then `train --set data.dir=X`: the refusal (the config's
    source is the embedded corpus) offered only `prepare ... --force` of the corpus, which
    replaces the user's data. It now names the --set that trains on X as it is, and that
    command trains."""
    (tmp_path / "mine.txt").write_text(LINE.format(j=0, name="mine") * 3000)
    r = andrea_main("prepare", "--input", "mine.txt", "--tokenizer", "byte", "--out", "mydata",
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    train = ["train", "-c", "andrea-tiny", "--set", "data.dir=mydata", "--set",
             "train.runs_dir=runs", "--set", "train.max_steps=2", "--no-progress"]
    line = assert_user_error(andrea_main(*train, cwd=tmp_path), "asks for source shakespeare",
                             "to use that data as it is, add to the command what it was "
                             "prepared with (--set data.source=mine.txt); else")
    assert "(--set data.source=mine.txt)" in line
    assert andrea_main(*train, "--set", "data.source=mine.txt", cwd=tmp_path).returncode == 0


def test_data_with_no_train_tokens_is_not_offered_as_it_is(tmp_path):
    """A val_fraction near 1 prepares a folder with an empty train split. Before: the next run
    at the default val_fraction was told to use that data as it is (`--set
    data.val_fraction=0.999999`), which, pasted, failed on the empty split again."""
    (tmp_path / "docs.jsonl").write_text("".join(
        json.dumps({"text": LINE.format(j=j, name="doc") * 20}) + "\n" for j in range(400)))
    train = ["train", "-c", "andrea-tiny", "--set", "data.source=docs.jsonl", "--set",
             "data.tokenizer=byte", "--set", "train.max_steps=2", "--no-progress"]
    assert_user_error(andrea_main(*train, "--set", "data.val_fraction=0.999", cwd=tmp_path),
                      "the train split has ",
                      "hold less out for validation (data.val_fraction, prepared anew)")
    # (Not only an empty train split: a review found a few hundred train tokens looped too.)
    line = assert_user_error(andrea_main(*train, cwd=tmp_path),
                             "prepared with val_fraction 0.999")
    assert "as it is" not in line
    command = shlex.split(line.split("replace that data by hand with `")[1].rstrip("`"))
    assert andrea_main(*command[1:], cwd=tmp_path).returncode == 0
    assert andrea_main(*train, cwd=tmp_path).returncode == 0


def test_a_mixture_source_on_a_folder_prepared_otherwise_names_its_config_line(tmp_path):
    """A mixture's source `notes.txt` derives data/notes-byte, which `prepare --input notes/`
    made: the refusal named `--set data.source=notes/`, which a mixture never reads, so the
    command it gave was refused again. It now names the mixture's own line; as it says, the
    folder is used as it is."""
    (tmp_path / "notes").mkdir()
    for where in ("notes/a.txt", "notes.txt", "b.txt"):
        (tmp_path / where).write_text(LINE.format(j=0, name=where) * 1500)
    r = andrea_main("prepare", "--input", "notes/", "--tokenizer", "byte", "--errors", "replace",
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    before = snapshot(tmp_path / "data" / "notes-byte")
    config = tmp_path / "mix.yaml"
    mixture = "data: {{tokenizer: byte, sources: [{{path: {}, weight: 3}}, {{path: b.txt}}]}}\n"
    config.write_text(mixture.format("notes.txt"))
    line = assert_user_error(andrea_main("prepare", "-c", "mix.yaml", cwd=tmp_path),
                             "to use that data as it is, give what it was prepared with "
                             "(data.sources[0].path: notes/ in the config; --set "
                             "data.errors=replace); else")
    assert "data.source=" not in line
    config.write_text(mixture.format("notes/"))
    r = andrea_main("prepare", "-c", "mix.yaml", "--set", "data.errors=replace", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert snapshot(tmp_path / "data" / "notes-byte") == before
    # `prepare --input` over it: its --set options are for andrea train (prepare refuses
    # --set data.source beside --input), and the line says so.
    assert_user_error(andrea_main("prepare", "--input", "b.txt", "--tokenizer", "byte", "--out",
                                  "data/notes-byte", cwd=tmp_path),
                      "but this prepare asks for source b.txt", "to train on that data as it is, "
                      "add to andrea train what it was prepared with (--set data.source=notes/",
                      "use another data folder")
    assert snapshot(tmp_path / "data" / "notes-byte") == before


def test_a_glob_inside_a_sources_folder_is_another_source(tmp_path):
    """`data.source=notes` and `notes/*.jsonl` derive one folder, data/notes-byte, and share
    files. The second was taken for the first with changed inputs: it prepared the folder again
    over the first run's data, and `andrea eval` of the first run then scored the second's val
    split without a word. Now it is another source: refused, the folder as it was."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text(LINE.format(j=0, name="a") * 1500)
    (notes / "b.jsonl").write_text("".join(
        json.dumps({"text": LINE.format(j=j, name="b") * 20}) + "\n" for j in range(60)))
    train = ["train", "-c", "andrea-tiny", "--set", "train.max_steps=2", "--set",
             "train.runs_dir=runs", "--no-progress"]
    first = andrea_main(*train, "--set", "data.source=notes", "--set", "train.name=all",
                        cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = snapshot(tmp_path / "data" / "notes-byte")
    scored = andrea_main("eval", "--checkpoint", "runs/all", "--json", cwd=tmp_path)
    r = andrea_main(*train, "--set", "data.source=notes/*.jsonl", "--set", "train.name=jsonl",
                    cwd=tmp_path)
    assert_user_error(r, "data/notes-byte: holds data prepared with source notes",
                      "asks for source notes/*.jsonl", "(--set data.source=notes)")
    assert snapshot(tmp_path / "data" / "notes-byte") == before
    again = andrea_main("eval", "--checkpoint", "runs/all", "--json", cwd=tmp_path)
    assert json.loads(again.stdout)[0]["tokens"] == json.loads(scored.stdout)[0]["tokens"]


def test_a_source_whose_files_were_all_renamed_names_them_and_a_way_that_works(tmp_path):
    """A folder source whose one file was renamed has no input file in common with its data:
    refused as another source's, which it may be. The line said it was prepared with `source
    notes` but the run asks for `source notes`, and offered `--set data.source=notes`, already
    on the command: pasted, it changed nothing. Now it names the files on each side and offers
    only what works (the --force command, pasted, prepares the renamed file)."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "draft.txt").write_text(LINE.format(j=0, name="a") * 1500)
    train = ["train", "-c", "andrea-tiny", "--set", "data.source=notes", "--set",
             "data.dir=data", "--set", "train.max_steps=2", "--set", "train.runs_dir=runs",
             "--no-progress"]
    assert andrea_main(*train, "--set", "train.name=a", cwd=tmp_path).returncode == 0
    (tmp_path / "notes" / "draft.txt").rename(tmp_path / "notes" / "final.txt")
    before = snapshot(tmp_path / "data")
    line = assert_user_error(
        andrea_main(*train, "--set", "train.name=b", cwd=tmp_path),
        f"data: holds data prepared with the files {tmp_path / 'notes' / 'draft.txt'}, but this "
        f"run asks for the files {tmp_path / 'notes' / 'final.txt'}", "another data folder")
    assert "--set data.source" not in line and snapshot(tmp_path / "data") == before
    force = shlex.split(line[line.index("`") + 1:line.rindex("`")])
    assert force[0] == "andrea" and force[-1] == "--force"
    assert andrea_main(*force[1:], cwd=tmp_path).returncode == 0
    assert andrea_main(*train, "--set", "train.name=b", cwd=tmp_path).returncode == 0


def test_train_refuses_a_folder_prepared_with_another_tokenizer(tmp_path):
    """Case 1: `train --set data.dir=X` where X holds another run's gpt2 data is one line, exit
    2, naming the folder and both tokenizers, and X stays byte for byte (the old code prepared
    it again with bytes). `andrea prepare` refuses too; only --force replaces it."""
    write_corpus(tmp_path / "in")
    r = andrea_main("prepare", "-i", "in", "-t", "gpt2", "-o", "data/x", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    before = snapshot(tmp_path / "data/x")
    r = andrea_main("train", "-c", "andrea-tiny", "--set", "data.source=in", "--set",
                    "data.dir=data/x", "--set", "train.runs_dir=runs", cwd=tmp_path)
    assert_user_error(r, "data/x: holds data prepared with tokenizer gpt2", "asks for tokenizer "
                      "byte", "another data folder", "`andrea prepare --input in --tokenizer byte "
                      "--out data/x --force`")
    assert snapshot(tmp_path / "data/x") == before
    r = andrea_main("prepare", "-c", "andrea-tiny", "--set", "data.source=in", "-o", "data/x",
                    cwd=tmp_path)
    assert_user_error(r, "data/x", "tokenizer gpt2", "tokenizer byte")
    assert snapshot(tmp_path / "data/x") == before
    r = andrea_main("prepare", "-c", "andrea-tiny", "--set", "data.source=in", "-o", "data/x",
                    "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert read_manifest(tmp_path / "data/x")["tokenizer"]["identity"] == "byte:v1"


def test_prepare_of_a_folder_that_holds_its_output_twice(tmp_path):
    """Case 2: `prepare --input data/` puts its output in data/data-bpe-300; the second run
    skips that folder (saying so once), finds everything up to date and changes nothing (the
    old code read its own manifest as input and deleted the shards)."""
    write_corpus(tmp_path / "data")
    args = ("prepare", "--input", "data/", "--tokenizer", "bpe", "--vocab-size", "300")
    r = andrea_main(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "data/data-bpe-300"
    before = snapshot(out)
    names = [Path(i["name"]).name for i in read_manifest(out)["inputs"]]
    assert names == ["a.txt", "b.txt"]
    r = andrea_main(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines == ["data/: skipping data/data-bpe-300: prepared data or the output folder, "
                     "not input",
                     "data/data-bpe-300: up to date (inputs unchanged; --force redoes it)"]
    assert snapshot(out) == before
    # Pointed at prepared data itself, it says what that folder is.
    r = andrea_main("prepare", "--input", "data/data-bpe-300", "-t", "byte", "-o", "y",
                    cwd=tmp_path)
    assert_user_error(r, "data/data-bpe-300: this folder is prepared data")
    assert not (tmp_path / "y").exists()


def test_two_prepares_of_one_folder_take_turns(tmp_path):
    """Case 3: while one prepare is paused in its third shard (holding the lock), a second
    prepare of the same input into the same folder waits, then uses the first's result; both
    succeed and the shards equal a lone prepare's (the old code let the second clear the
    first's files)."""
    write_corpus(tmp_path / "in")
    args = ("prepare", "-c", "andrea-tiny", "--set", "data.source=in", *SHARDS, "-o", "data/x")
    waiting, first, second, [(out1, err1), (out2, err2)] = take_turns(args, args, tmp_path,
                                                                      "stdout")
    assert waiting == (f"data/x: another andrea process (pid {first.pid}) is preparing this "
                       "folder; waiting for it to finish\n"), waiting
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    assert out2.strip() == "data/x: prepared by the other process meanwhile; using it"
    clean = prepare.prepare_from_config(load_config("andrea-tiny", [
        f"data.source={tmp_path / 'in'}", "data.shard_tokens=20000",
        f"data.dir={tmp_path / 'clean'}"]), verbose=False)
    assert read_manifest(tmp_path / "data/x")["shards"] == read_manifest(clean)["shards"]
    for split in ("train", "val"):
        np.testing.assert_array_equal(tokens(tmp_path / "data/x", split), tokens(clean, split))
    assert sorted(p.name for p in (tmp_path / "data/x").iterdir() if ".tmp" in p.name) == []


def test_two_evals_of_a_run_without_its_data_take_turns(tmp_path):
    """Case 3 for eval: two `andrea eval` of a run whose data folder is not prepared yet; one
    prepares it (paused in its third shard), the other waits (saying so on stderr, stdout being
    the result), and both report the same loss on the same data. The folder is the one derived
    under ./data (data/in-byte), never the data.dir the checkpoint names (data/x)."""
    write_corpus(tmp_path / "in")
    make_checkpoint(tmp_path, f"data.source={tmp_path / 'in'}", "data.shard_tokens=20000",
                    "data.dir=data/x")
    args = ("eval", "--checkpoint", "runs/r", "--max-tokens", "1024")
    waiting, first, second, [(out1, err1), (out2, err2)] = take_turns(args, args, tmp_path,
                                                                      "stderr")
    assert "data/in-byte: another andrea process" in waiting, waiting
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    assert "data/in-byte: prepared by the other process meanwhile; using it" in err2
    assert out1 == out2 and " on data/in-byte (val split, 1,024 tokens spread " in out1
    assert not (tmp_path / "data/x").exists()


def test_prepare_never_deletes_files_it_did_not_write(tmp_path):
    """Case 4: a non-empty folder without a manifest is refused, its files untouched (the old
    code left only main.py of tokenizer.json, draft.tmp, main.py); in andrea's own folder a
    user's files outlive --force and a failed prepare."""
    write_corpus(tmp_path / "in")
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, text in {"tokenizer.json": "{}", "draft.tmp": "notes", "main.py": "print()"}.items():
        (mine / name).write_text(text)
    before = snapshot(mine)
    r = andrea_main("prepare", "-i", "in", "-t", "byte", "-o", "mine", cwd=tmp_path)
    assert_user_error(r, "mine: the folder holds files andrea did not write (draft.tmp, main.py, "
                      "tokenizer.json) and no manifest.json", "choose another data folder")
    assert snapshot(mine) == before

    r = andrea_main("prepare", "-i", "in", "-t", "byte", "-o", "data/x", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "data/x"
    (out / "draft.tmp").write_text("mine")
    (out / "notes.md").write_text("mine too")
    r = andrea_main("prepare", "-i", "in", "-t", "byte", "-o", "data/x", "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (tmp_path / "in/c.txt").write_bytes(b"\0\1binary")  # makes the next prepare fail
    r = andrea_main("prepare", "-i", "in", "-t", "byte", "-o", "data/x", "--force", cwd=tmp_path)
    assert_user_error(r, "c.txt: looks binary")
    assert (out / "draft.tmp").read_text() == "mine" and (out / "notes.md").read_text() == \
        "mine too"
    assert not list(out.glob("*.bin")) and not (out / "manifest.json").exists()


def test_a_record_naming_a_path_elsewhere_deletes_nothing_there(tmp_path):
    """A manifest or progress record is untrusted: a shard entry "../notes.txt" or an
    absolute path names the file of that name in the folder, never the file it points at.
    Mutation round 3: owned_files taking the entry as it is written passed every test, and
    clearing the folder (a --force, a failed first prepare) deleted the files outside it."""
    from andrea.data import folder

    out, outside = tmp_path / "out", tmp_path / "notes.txt"
    out.mkdir()
    outside.write_text("mine")
    (tmp_path / "other.txt").write_text("mine too")
    entries = [{"file": "../notes.txt"}, {"file": str(tmp_path / "other.txt")}]
    (out / "manifest.json").write_text(json.dumps(
        {"manifest_version": 1, "shards": {"train": entries, "val": []}}))
    (out / "progress.json").write_text(json.dumps(
        {"settings": {}, "shards": {"train": entries, "val": []}}))
    folder.clear(out)
    assert outside.read_text() == "mine" and (tmp_path / "other.txt").read_text() == "mine too"
    assert sorted(p.name for p in out.iterdir()) == []


def test_a_file_named_like_a_shard_is_andreas_only_by_its_magic(tmp_path):
    """A user's train_000000.bin (another tool's tokens) does not make a folder andrea's: a
    prepare into it is refused, the file kept. Mutation round 3: _is_shard by the name alone
    passed every test: such a folder was prepared into, the file replaced."""
    from andrea.data import folder
    from andrea.errors import UserError

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "train_000000.bin").write_bytes(b"NOTANDREA" + bytes(300))
    assert not folder.is_andrea_folder(theirs)
    with pytest.raises(UserError, match=r"holds files andrea did not write \(train_000000\.bin\)"):
        folder.check_owned(theirs)
    assert "train_000000.bin" not in folder.owned_files(theirs)


def test_ctrl_c_says_what_it_kept_and_the_rerun_resumes(tmp_path):
    write_corpus(tmp_path / "in")
    args = ("prepare", "-c", "andrea-tiny", "--set", "data.source=in", *SHARDS, "-o", "data/x")
    proc = start(*args, cwd=tmp_path, env={"ANDREA_FAULTS": "prepare-pause@train_000002.bin"})
    try:
        paused, seen = wait_for_line(proc.stderr, "paused in")
        assert paused, seen
        proc.send_signal(signal.SIGINT)
    finally:
        ((_, err),) = finish(proc, timeout=60)
    kept = re.search(r"interrupted: data/x keeps (\d+) complete shards \(([\d,]+) tokens\); run "
                     r"the same command again to continue from there", err)
    assert kept, err
    assert "Traceback" not in err
    r = andrea_main(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"resuming after {kept[1]} complete shards ({kept[2]} tokens)" in r.stdout


def test_workers_must_not_be_negative(tmp_path):
    write_corpus(tmp_path / "in")
    r = andrea_main("prepare", "-i", "in", "-t", "byte", "--workers", "-1", "-o", "x",
                    cwd=tmp_path)
    assert_user_error(r, "--workers", "-1 is negative")
    r = andrea_main("prepare", "-c", "andrea-tiny", "--workers", "-1", "-o", "x", cwd=tmp_path)
    assert_user_error(r, "--workers", "-1 is negative")
    assert not (tmp_path / "x").exists()


def jsonl(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_jsonl_as_datasets_ship_it(tmp_path):
    """--errors replace skips a malformed line and a non-object line and counts them with the
    records without text; strict names the line; a dotted --text-field reaches into objects;
    null is 'is null'; replaced invalid UTF-8 bytes are counted."""
    good = [json.dumps({"id": i, "doc": {"body": f"record {i}: some text here"}}).encode()
            for i in range(300)]
    bad = [b'{"doc": {"body": "cut', b"[1, 2]", b'{"doc": {"body": null}}',
           b'{"doc": {"body": "caf\xff\xfe au lait"}}']
    jsonl(tmp_path / "x.jsonl", good[:100] + bad + good[100:])
    base = ("prepare", "-i", "x.jsonl", "-t", "byte", "--text-field", "doc.body")
    r = andrea_main(*base, "-o", "strict", cwd=tmp_path)
    assert_user_error(r, "x.jsonl:101: not a JSON object per line", "--errors replace")
    r = andrea_main(*base, "-o", "out", "--errors", "replace", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "skipped 3 records without a string 'doc.body' (or not JSON objects)" in r.stdout
    assert "replaced 2 invalid UTF-8 bytes with U+FFFD" in r.stdout
    manifest = read_manifest(tmp_path / "out")
    assert (manifest["skipped_records"], manifest["replaced_bytes"]) == (3, 2)
    ids = np.concatenate([tokens(tmp_path / "out", s) for s in ("train", "val")])
    text = bytes(int(t) for t in ids if t < 256)  # byte tokens; 256 is end-of-text
    assert "caf\ufffd\ufffd au lait".encode() in text
    assert b"record 299: some text here" in text
    jsonl(tmp_path / "n.jsonl", [b'{"text": null}', b'{"text": "x"}'])
    r = andrea_main("prepare", "-i", "n.jsonl", "-t", "byte", "-o", "n", cwd=tmp_path)
    assert_user_error(r, "n.jsonl:1: field 'text' is null, not a string (fields: text)")
    jsonl(tmp_path / "l.jsonl", [b'{"text": "x"}', b"[1, 2]"])
    r = andrea_main("prepare", "-i", "l.jsonl", "-t", "byte", "-o", "l", cwd=tmp_path)
    assert_user_error(r, "l.jsonl:2: a JSON list, expected an object", "--errors replace")


def test_jsonl_that_starts_with_a_bom_reads_its_first_record(tmp_path):
    """A UTF-8 byte order mark (some Windows editors write one) is skipped, as in a CSV: it
    failed line 1 with Python's "Unexpected UTF-8 BOM" (or, under --errors replace, lost the
    first record)."""
    lines = [json.dumps({"text": f"record {i}: some text here"}).encode() for i in range(300)]
    jsonl(tmp_path / "plain.jsonl", lines)
    (tmp_path / "bom.jsonl").write_bytes(codecs.BOM_UTF8 + (tmp_path / "plain.jsonl").read_bytes())
    outs = [tmp_path / name for name in ("plain", "bom")]
    for out in outs:
        r = andrea_main("prepare", "-i", f"{out.name}.jsonl", "-t", "byte", "-o", out.name,
                        cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    for split in ("train", "val"):
        np.testing.assert_array_equal(tokens(outs[0], split), tokens(outs[1], split))


def test_lone_surrogates_are_replaced_with_u_fffd(tmp_path):
    """A JSON \\ud800 escape (a lone surrogate: no UTF-8 for it) under --errors replace is
    written as U+FFFD, one for each, as the last line and docs/data.md say; it was '?'."""
    good = [json.dumps({"text": f"record {i}: some text here"}).encode() for i in range(300)]
    jsonl(tmp_path / "s.jsonl", good + [rb'{"text": "bad \ud800 here"}',
                                        rb'{"text": "two \udfff\ud800 lone"}'])
    r = andrea_main("prepare", "-i", "s.jsonl", "-t", "byte", "-o", "out", "--errors", "replace",
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "replaced 3 invalid UTF-8 bytes with U+FFFD" in r.stdout
    ids = np.concatenate([tokens(tmp_path / "out", s) for s in ("train", "val")])
    text = bytes(int(t) for t in ids if t < 256).decode()  # byte tokens; 256 is end-of-text
    assert "bad \ufffd here" in text and "two \ufffd\ufffd lone" in text
    assert "?" not in text


def test_a_lone_surrogate_under_strict_errors_names_its_line(tmp_path):
    """The file's line, as every other error of a JSON Lines record names it: it was the
    record's number among the non-blank lines ("record 2")."""
    jsonl(tmp_path / "s.jsonl", [b'{"text": "fine"}', b"", b"  ", rb'{"text": "bad \ud800 here"}'])
    r = andrea_main("prepare", "-i", "s.jsonl", "-t", "byte", "-o", "out", cwd=tmp_path)
    assert_user_error(r, "s.jsonl:4: field 'text' holds invalid Unicode (a lone surrogate)",
                      "--errors replace")


def test_dotted_text_field_reaches_into_parquet_structs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": i, "doc": {"title": f"t{i}", "body": f"record {i}: parquet body"}}
            for i in range(300)]
    rows[5]["doc"] = None  # a null struct: its text is null, not some other row's
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "x.parquet", row_group_size=100)
    base = ("prepare", "-i", "x.parquet", "-t", "byte", "--text-field")
    r = andrea_main(*base, "doc.body", "-o", "strict", cwd=tmp_path)
    assert_user_error(r, "row group 0, row 5: field 'doc.body' is null")
    r = andrea_main(*base, "doc.body", "--errors", "replace", "-o", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ids = np.concatenate([tokens(tmp_path / "out", s) for s in ("train", "val")])
    text = bytes(int(t) if t < 256 else 10 for t in ids).decode()  # end-of-text as a line break
    texts = sorted(filter(None, text.split("\n")))
    assert texts == sorted(f"record {i}: parquet body" for i in range(300) if i != 5)
    r = andrea_main(*base, "doc.nope", "-o", "nope", cwd=tmp_path)
    assert_user_error(r, "column 'doc' has no field 'nope'")


def test_a_holder_that_has_not_written_its_pid_yet_is_named_without_one(tmp_path):
    """Before: `another andrea process (pid ?) is preparing this folder` when the lock was
    taken but its pid not yet written (the holder emptied the file, then wrote). Now the line
    names no pid it does not know, and a holder's file is never empty once it holds the lock."""
    out = tmp_path / "x"
    out.mkdir()
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # held, nothing written yet
    fcntl.flock(fd, fcntl.LOCK_EX)
    said: list[str] = []
    lock = DataLock(out, say=said.append)
    waiter = threading.Thread(target=lock.acquire)
    waiter.start()
    wait_until(lambda: said, what="the waiter's line")
    assert said == [f"{out}: another andrea process is preparing this folder; waiting for it "
                    "to finish"]
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    waiter.join(30)
    assert (out / LOCK).read_text() == f"{os.getpid()}\n"
    lock.release()


UNGUARDED = """
from andrea.config import load_config
from andrea.train.loop import train
SETS = ["data.source=in", "data.workers=2", "train.max_steps=1", "train.eval_every=0"]
def config(name):
    return load_config("andrea-tiny", [*SETS, f"data.dir=data/{{name}}", f"train.name={{name}}"])
{call}
"""
CALL = 'print({name!r}, train(config({name!r}), progress=False).state)'


# Guards as people write them, each of which keeps the workers from calling train again.
GUARDS = {
    "plain": 'if __name__ == "__main__":\n    {call}',
    "in a try": ('try:\n    if __name__ == "__main__":\n        {call}\n'
                 'except KeyboardInterrupt:\n    pass'),
    "an else": 'if __name__ != "__main__":\n    pass\nelse:\n    {call}',
}


@pytest.fixture(scope="module")
def guarded_script(tmp_path_factory) -> subprocess.CompletedProcess:
    """One script holding every guard of GUARDS in turn, each training a run of its own on a
    data folder of its own: each of its trainings prepares, so the check before the pool reads
    each guard's line, and each pool's workers import the whole script, every guard included.
    One process for the three guards: the script and its workers are what the test is about,
    not a process per guard."""
    folder = tmp_path_factory.mktemp("guarded")
    write_corpus(folder / "in")
    (folder / "script.py").write_text(UNGUARDED.format(call="\n".join(
        guard.format(call=CALL.format(name=name.replace(" ", "-")))
        for name, guard in GUARDS.items())))
    return subprocess.run(python_command(str(folder / "script.py")), cwd=folder, text=True,
                          capture_output=True, timeout=300, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_script_that_calls_train_unguarded_is_told_to_guard_it(tmp_path):
    """Python's spawn starts each tokenizing worker by importing the user's script: one that
    called train() at its top level trained again in every worker, which the run's lock refused,
    and the pool replaced the worker, forever, with the lock's error each time. Now the script
    is refused before any worker starts, naming its line and the missing guard."""
    write_corpus(tmp_path / "in")
    (tmp_path / "script.py").write_text(UNGUARDED.format(call=CALL.format(name="in")))
    proc = subprocess.run(python_command(str(tmp_path / "script.py")), cwd=tmp_path, text=True,
                          capture_output=True, timeout=300, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1 and proc.stdout == "preparing data/in from in (first run only)\n"
    assert proc.stderr.splitlines()[-1] == (
        f"andrea.errors.UserError: {tmp_path / 'script.py'}:7: calls andrea outside `if "
        f"__name__ == \"__main__\":`; the workers that tokenize (data.workers) start by "
        f"importing the script, which would call it again in each: put the call under that "
        f"guard, or set data.workers=1"), proc.stderr[-3000:]
    assert not list((tmp_path / "data" / "in").glob("*.bin"))  # refused before any shard


@pytest.mark.parametrize("guard", list(GUARDS))
def test_a_script_that_calls_train_guarded_trains_with_its_workers(guarded_script, guard):
    """Each guard as people write it passes the check, and the workers that import the script
    never call train again: its run finishes, with its data prepared by the workers."""
    proc = guarded_script
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = guard.replace(" ", "-")
    lines = proc.stdout.splitlines()
    assert f"preparing data/{name} from in (first run only)" in lines, proc.stdout
    assert f"{name} finished" in lines, proc.stdout


def test_a_package_run_with_dash_m_needs_no_guard(tmp_path):
    """`python -m pkg`: spawn never imports a `__main__` module again, so an unguarded call in
    pkg/__main__.py is safe and is not refused (the check refused it at first)."""
    write_corpus(tmp_path / "in")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text(UNGUARDED.format(call=CALL.format(name="in")))
    proc = subprocess.run(python_command("-m", "pkg"), cwd=tmp_path, text=True,
                          capture_output=True, timeout=300, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.endswith("finished\n"), proc.stderr[-3000:]


def test_a_worker_that_imports_an_unguarded_script_says_so(monkeypatch):
    """What the check before the pool cannot see (a call through exec): the worker importing the
    script raises at andrea's entry points, naming the guard, instead of the run lock's error."""
    import multiprocessing

    from andrea.data.prepare import prepare_inputs
    from andrea.train.loop import train

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    for call in (lambda: train(load_config("andrea-tiny")),
                 lambda: prepare_inputs("shakespeare", "byte", Path("unused"))):
        with pytest.raises(RuntimeError, match='under `if __name__ == "__main__":` in a script'):
            call()
