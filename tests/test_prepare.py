"""`andrea prepare`: shards reproduce the text, chunking and workers change nothing, the manifest
makes re-runs free, and bad input is a one-line error with exit code 2."""

import io
import json
import os
import socket

import numpy as np
import pytest
from conftest import andrea_main, assert_user_error

from andrea.config import load_config
from andrea.data import documents, encode, prepare
from andrea.data.inputs import input_files
from andrea.data.readers import Job
from andrea.data.shards import open_shard
from andrea.data.tokenizer import EOT_TEXT, ByteTokenizer, Gpt2Tokenizer, train_bpe
from andrea.errors import UserError

DOCS = {
    "a.txt": "First line of a.\nSecond line, café.\n" * 40,
    "sub/b.md": "ROMEO:\nBut soft! what light through yonder window breaks?\n\n" * 30,
    "c.txt": "日本語のテキスト。\n" * 25 + "no final newline",
}


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "in"
    for name, text in DOCS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "ignored.bin").write_bytes(b"\xff\xfe")  # not a text suffix: a directory skips it
    return root


def split_tokens(out, split):
    manifest = prepare.read_manifest(out)
    parts = [open_shard(out / e["file"]) for e in manifest["shards"][split]]
    return np.concatenate(parts).astype(np.int64)


def test_shards_reproduce_the_documents(corpus, tmp_path):
    out = prepare.prepare_inputs(str(corpus), "byte", tmp_path / "out", shard_tokens=500)
    tok = ByteTokenizer()
    train = tok.decode(split_tokens(out, "train")).split(EOT_TEXT)
    val = tok.decode(split_tokens(out, "val")).split(EOT_TEXT)
    assert train[-1] == "" and val[-1] == ""
    names = sorted(DOCS)  # files come in sorted path order
    for name, head, tail in zip(names, train[:-1], val[:-1], strict=True):
        assert head + tail == DOCS[name]
        assert head.endswith("\n") or not tail  # val starts at a line
        assert 0.05 < len(tail.encode()) / len(DOCS[name].encode()) < 0.2
    manifest = prepare.read_manifest(out)
    assert len(manifest["shards"]["train"]) == -(-manifest["tokens"]["train"] // 500)


def test_chunk_cuts_do_not_change_tokens(corpus, tmp_path, monkeypatch):
    whole = prepare.prepare_inputs(str(corpus), "gpt2", tmp_path / "whole", workers=1)
    monkeypatch.setattr(documents, "CHUNK_BYTES", 64)  # many chunk cuts per document
    small = prepare.prepare_inputs(str(corpus), "gpt2", tmp_path / "small", workers=1)
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_tokens(whole, split), split_tokens(small, split))
    # The same, document part by document part, from the tokenizer on the whole text.
    gpt2 = Gpt2Tokenizer()
    expected = []
    for name in sorted(DOCS):
        blob = DOCS[name].encode()
        cut = documents.val_start(io.BytesIO(blob), len(blob), 0.1)
        expected += gpt2.encode(blob[:cut].decode()) + [gpt2.eot_id]
    np.testing.assert_array_equal(split_tokens(whole, "train"), expected)


def test_parallel_workers_match_one_worker(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "CHUNK_BYTES", 256)
    one = prepare.prepare_inputs(str(corpus), "bpe", tmp_path / "one", vocab_size=300, workers=1)
    two = prepare.prepare_inputs(str(corpus), "bpe", tmp_path / "two", vocab_size=300, workers=2)
    assert (one / "tokenizer.json").read_bytes() == (two / "tokenizer.json").read_bytes()
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_tokens(one, split), split_tokens(two, split))


@pytest.mark.parametrize("suffix", [".zst", ".gz", ".zst, streamed"])
def test_automatic_workers_judge_a_compressed_input_by_what_it_holds(tmp_path, monkeypatch,
                                                                    suffix):
    """data.workers 0 gives small inputs one process, as a pool's start costs more than it
    saves; a compressed file was judged by its size on disk: 4.3 MB of repetitive JSON Lines is
    826 bytes as .zst (28 KB as .gz) and was encoded by one process however many cores there
    were. Now by the bytes it holds, read through its decompressor until they are enough,
    also where its header records no size (a stream compressed from a pipe)."""
    import gzip

    import zstandard

    rows = "".join(json.dumps({"text": f"record {i % 50} of a repetitive corpus " * 4}) + "\n"
                   for i in range(30_000)).encode()
    assert len(rows) > encode.PARALLEL_MIN_BYTES
    path = tmp_path / f"big.jsonl{suffix[:4]}"
    if suffix == ".gz":
        path.write_bytes(gzip.compress(rows))
    elif suffix == ".zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(rows))
    else:
        with zstandard.ZstdCompressor().stream_writer(path.open("wb")) as stream:
            stream.write(rows)
    assert path.stat().st_size < 64_000
    chosen = []

    def write_shards(*args, **kwargs):  # the workers chosen, then one: no pool in a test
        chosen.append(args[5])
        return real(*args[:5], 1, *args[6:], **kwargs)

    real = prepare.write_shards
    monkeypatch.setattr(prepare, "write_shards", write_shards)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    proc = andrea_main("prepare", "-i", str(path), "-t", "byte", "-o", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert chosen == [4]
    small = tmp_path / "small.jsonl.zst"
    small.write_bytes(zstandard.ZstdCompressor().compress(rows[:rows.index(b"\n", 100_000) + 1]))
    proc = andrea_main("prepare", "-i", str(small), "-t", "byte", "-o", str(tmp_path / "small"))
    assert proc.returncode == 0, proc.stderr
    assert chosen == [4, 1]


def test_byte_encoding_holds_no_python_int_per_byte(monkeypatch):
    """A job's byte ids are the text's bytes as an array: a list of Python ints would take 8
    bytes a byte of text (a 100 MB JSON Lines record peaked at 1.2 GB), and its conversion was
    a fifth of a byte prepare's time."""
    import tracemalloc

    text = ("Hello big corpus\n" * (1 << 16)).encode()  # 1.1 MB, one text job
    monkeypatch.setattr(encode, "_worker_tokenizer", ByteTokenizer())
    job = Job("text", "big.txt", len(text), ("train", text, 0, True))
    settings = documents.Settings(0.1, "text", "strict")
    tracemalloc.start()
    try:
        tokens, _ = encode.encode_job((job, settings, "<u2"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tokens["train"].tolist() == [*text, ByteTokenizer.eot_id]
    # The text decoded and encoded again, its uint16 ids and those with end-of-text: 5 bytes
    # a byte (a list made it 11).
    assert peak < 7 * len(text)


def test_a_bpe_learns_from_the_train_split_alone(corpus, tmp_path):
    """The texts a BPE is trained on are the train split's: the val tail of each text file is
    held out of the tokenizer as it is of the model. Mutation round 3: train_texts yielding
    every document passed every test."""
    inputs = documents.documents(str(corpus))
    settings = documents.Settings(0.1, "text", "strict")
    learned = "".join(encode.train_texts(inputs, settings, tmp_path / "scratch"))
    expected = ""
    for name in sorted(DOCS):
        blob = DOCS[name].encode()
        expected += blob[:documents.val_start(io.BytesIO(blob), len(blob), 0.1)].decode()
    assert learned == expected


def test_rerun_is_free_and_changes_redo(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    prepare.prepare_inputs(str(corpus), "byte", out)
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    prepare.prepare_inputs(str(corpus), "byte", out)
    assert "up to date" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
    before = prepare.read_manifest(out)["tokens"]["train"]
    (corpus / "a.txt").write_text(DOCS["a.txt"] + "more\n" * 10, encoding="utf-8")
    prepare.prepare_inputs(str(corpus), "byte", out)
    assert prepare.read_manifest(out)["tokens"]["train"] > before
    prepare.prepare_inputs(str(corpus), "byte", out, force=True)
    assert "up to date" not in capsys.readouterr().out.splitlines()[-1]
    # A shard damaged behind the manifest's back is noticed and redone.
    shard = out / "train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    prepare.prepare_inputs(str(corpus), "byte", out)
    assert "up to date" not in capsys.readouterr().out
    open_shard(shard)


def test_interrupted_prepare_keeps_complete_shards_and_resumes(corpus, tmp_path, monkeypatch,
                                                              capsys):
    """Ctrl-C: no manifest (nothing reads as complete), no partial shard, and the complete
    shards stay; the rerun continues after them and ends with a clean run's tokens."""
    clean = prepare.prepare_inputs(str(corpus), "byte", tmp_path / "clean", shard_tokens=300,
                                   workers=1)
    out = tmp_path / "out"
    calls = 0

    def flaky(args):
        nonlocal calls
        calls += 1
        if calls == 5:
            raise KeyboardInterrupt
        return real(args)

    real = encode.encode_job
    monkeypatch.setattr(documents, "CHUNK_BYTES", 512)
    monkeypatch.setattr(encode, "encode_job", flaky)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_inputs(str(corpus), "byte", out, shard_tokens=300, workers=1)
    kept = sorted(p.name for p in out.iterdir())
    assert "manifest.json" not in kept and not [n for n in kept if n.endswith(".tmp")]
    assert "progress.json" in kept and "train_000000.bin" in kept
    with pytest.raises(UserError, match="manifest.json missing"):
        prepare.read_manifest(out)
    first = (out / "train_000000.bin").stat()
    monkeypatch.setattr(encode, "encode_job", real)
    capsys.readouterr()
    prepare.prepare_inputs(str(corpus), "byte", out, shard_tokens=300, workers=1)
    assert "resuming after" in capsys.readouterr().out
    again = (out / "train_000000.bin").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert not (out / "progress.json").exists()
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_tokens(out, split), split_tokens(clean, split))


def test_a_resume_trusts_only_shards_of_the_count_it_recorded(tmp_path):
    """A progress record's shard whose header gives another count than the record's (rewritten
    behind its back, whole and valid) is no point to resume from: the prepare starts afresh.
    Mutation round 3: resume_point comparing the tokenizer alone passed every test."""
    from andrea.data import writer
    from andrea.data.shards import ShardWriter

    out = tmp_path / "out"
    out.mkdir()
    settings = {"source": "x.txt"}
    writer.mark_started(out, settings, {"kind": "byte", "identity": ByteTokenizer.identity})

    def shard_of(count: int) -> None:
        w = ShardWriter(out / "train_000000.bin", np.dtype("<u2"), ByteTokenizer.identity)
        w.write(np.arange(count) % 256)
        w.close()

    shard_of(10)
    progress = json.loads((out / "progress.json").read_text())
    progress["shards"]["train"] = [{"file": "train_000000.bin", "tokens": 10}]
    progress["job"] = 1
    (out / "progress.json").write_text(json.dumps(progress))
    assert writer.resume_point(out, settings)["job"] == 1
    shard_of(9)
    assert writer.resume_point(out, settings) is None


def test_a_resumed_prepare_counts_what_was_skipped_before_it(tmp_path, monkeypatch, capsys):
    """--errors replace: the manifest of a prepare interrupted and resumed counts the records
    skipped and the bytes replaced in the jobs before its resume point, as a clean prepare
    does. Mutation round 3: a progress record without the tally passed every test (the resumed
    run counted only its own jobs)."""
    from andrea.data import readers

    lines = [b'{"text": null}' if i % 10 == 0 else b'{"text": "bad \xff byte"}' if i % 10 == 5
             else json.dumps({"text": f"record {i}: " + "words " * 20}).encode()
             for i in range(200)]
    (tmp_path / "x.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    monkeypatch.setattr(readers, "READ_BYTES", 2048)  # jobs of about 14 records
    args = dict(errors="replace", shard_tokens=1000, workers=1)
    clean = prepare.read_manifest(
        prepare.prepare_inputs(str(tmp_path / "x.jsonl"), "byte", tmp_path / "clean", **args))
    assert (clean["skipped_records"], clean["replaced_bytes"]) == (20, 20)
    calls = 0

    def flaky(job_args):
        nonlocal calls
        calls += 1
        if calls == 8:
            raise KeyboardInterrupt
        return real(job_args)

    real = encode.encode_job
    monkeypatch.setattr(encode, "encode_job", flaky)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_inputs(str(tmp_path / "x.jsonl"), "byte", tmp_path / "out", **args)
    monkeypatch.setattr(encode, "encode_job", real)
    capsys.readouterr()
    out = prepare.prepare_inputs(str(tmp_path / "x.jsonl"), "byte", tmp_path / "out", **args)
    assert "resuming after" in capsys.readouterr().out
    resumed = prepare.read_manifest(out)
    assert (resumed["skipped_records"], resumed["replaced_bytes"]) == (20, 20)


def test_shakespeare_default_dir_and_ensure_prepared(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("andrea-tiny", ["data.val_fraction=0.5"])
    assert prepare.data_dir_for(cfg).as_posix() == "data/shakespeare-byte"
    out = prepare.ensure_prepared(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["preparing data/shakespeare-byte from the embedded Shakespeare corpus "
                     "(first run only)"]
    manifest = prepare.read_manifest(out)
    assert len(manifest["inputs"]) == 38
    assert 0.45 < manifest["tokens"]["val"] / sum(manifest["tokens"].values()) < 0.55
    assert prepare.ensure_prepared(cfg) == out and capsys.readouterr().out == ""


def test_default_dir_names():
    assert prepare.default_data_dir("shakespeare", "bpe", 4096).as_posix() == (
        "data/shakespeare-bpe-4096"
    )
    assert prepare.default_data_dir("texts/*.txt", "gpt2", 0).as_posix() == "data/texts-gpt2"
    assert prepare.default_data_dir("x/my book.txt", "byte", 0).as_posix() == "data/my_book-byte"


def test_a_run_reads_its_one_source_or_each_of_data_sources():
    one = load_config("andrea-tiny", [])
    assert [(i, d.as_posix(), w) for i, d, w in prepare.run_sources(one)] == [
        ("shakespeare", "data/shakespeare-byte", 1.0)]
    in_dir = load_config("andrea-tiny", ["data.dir=x/y"])
    assert prepare.run_sources(in_dir)[0][1].as_posix() == "x/y"
    two = load_config("andrea-tiny", ["data.sources=[{path: a/b.jsonl, weight: 3}, {path: c.txt}]"])
    assert [(i, d.as_posix(), w) for i, d, w in prepare.run_sources(two)] == [
        ("a/b.jsonl", "data/b-byte", 3.0), ("c.txt", "data/c-byte", 1.0)]
    assert prepare.data_dir_for(two).as_posix() == "data/b-byte"


def test_sources_that_would_share_a_data_dir_are_refused_with_a_way_out():
    # One input listed twice: renaming files (the old advice) cannot part it.
    for twice in ("[{path: a/n.txt, weight: 2}, {path: ./a/n.txt}]",
                  "[{path: code/, weight: 2}, {path: code}]"):
        cfg = load_config("andrea-tiny", [f"data.sources={twice}"])
        with pytest.raises(UserError, match=r"data.sources\[0\] and data.sources\[1\] both "
                                            r"name .*; list it once, with their weights added "
                                            r"\(weight: 3\)$"):
            prepare.run_sources(cfg)
    # Two inputs: both named, with what names the folder (two globs of one folder: the folder).
    for two, shared in (("[{path: a/notes.txt}, {path: b/notes.txt}]", "data/notes-byte"),
                        ("[{path: 'code/*.txt'}, {path: 'code/*.md'}]", "data/code-byte")):
        cfg = load_config("andrea-tiny", [f"data.sources={two}"])
        with pytest.raises(UserError, match=rf"data.sources\[0\] and data.sources\[1\] \(.+, "
                                            rf".+\) would share the data dir {shared}, .*rename"):
            prepare.run_sources(cfg)


def test_given_tokenizer_file_is_used_as_is(corpus, tmp_path, capsys):
    """data.tokenizer_file: the shards use that tokenizer.json byte for byte (same identity as
    the file, so an imported model's data matches it), and a new file redoes the prepare."""
    given = tmp_path / "model" / "tokenizer.json"
    given.parent.mkdir()
    bpe = train_bpe(iter(["the cat sat on the mat, café\n"] * 50), 300, given)
    out = prepare.prepare_inputs(str(corpus), "bpe", tmp_path / "out", tokenizer_file=str(given))
    assert (out / "tokenizer.json").read_bytes() == given.read_bytes()
    manifest = prepare.read_manifest(out)
    assert manifest["tokenizer"]["identity"] == bpe.identity
    assert manifest["tokenizer"]["vocab_size"] == bpe.vocab_size
    train = bpe.decode(split_tokens(out, "train")).split(EOT_TEXT)
    val = bpe.decode(split_tokens(out, "val")).split(EOT_TEXT)
    for name, head, tail in zip(sorted(DOCS), train[:-1], val[:-1], strict=True):
        assert head + tail == DOCS[name]
    prepare.prepare_inputs(str(corpus), "bpe", out, tokenizer_file=str(given))
    assert "up to date" in capsys.readouterr().out
    other = train_bpe(iter(["ROMEO: But soft!\n"] * 50), 290, tmp_path / "other.json")
    # Another tokenizer never rewrites the folder unasked; --force replaces it.
    with pytest.raises(UserError, match=r"sha256 [0-9a-f]{8}\), but this run asks for .*--force"):
        prepare.prepare_inputs(str(corpus), "bpe", out, tokenizer_file=str(tmp_path / "other.json"))
    assert prepare.read_manifest(out)["tokenizer"]["identity"] == bpe.identity
    prepare.prepare_inputs(str(corpus), "bpe", out, tokenizer_file=str(tmp_path / "other.json"),
                           force=True)
    assert prepare.read_manifest(out)["tokenizer"]["identity"] == other.identity
    # A given tokenizer never shares the derived dir of a trained BPE of the same size.
    cfg = load_config("andrea-tiny", ["data.tokenizer=bpe", f"data.tokenizer_file={given}"])
    name = prepare.data_dir_for(cfg).as_posix()
    assert name == f"data/shakespeare-bpe-tok{bpe.identity[4:12]}"
    with pytest.raises(UserError, match=r"tokenizer_file .* model.vocab_size is 260"):
        prepare.prepare_from_config(
            load_config("andrea-tiny", ["data.tokenizer=bpe", f"data.tokenizer_file={given}",
                                        "model.vocab_size=260"])
        )
    with pytest.raises(UserError, match="data.tokenizer_file applies to data.tokenizer bpe"):
        load_config("andrea-tiny", [f"data.tokenizer_file={given}"])  # tokenizer: byte


def test_bad_tokenizer_file(corpus, tmp_path):
    from tokenizers import Tokenizer, models

    (tmp_path / "text.json").write_text("not json")
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "wordlevel.json"))
    no_eot = json.loads(train_bpe(iter(["abc abd\n"] * 9), 260, tmp_path / "ok.json").path
                        .read_text())
    no_eot["added_tokens"] = []
    (tmp_path / "no_eot.json").write_text(json.dumps(no_eot))
    for name, problem in [("missing.json", "cannot read"), ("wordlevel.json", "not a byte-level"),
                          ("no_eot.json", "unusable tokenizer")]:
        with pytest.raises(UserError) as err:
            prepare.prepare_inputs(str(corpus), "bpe", tmp_path / "out",
                                   tokenizer_file=str(tmp_path / name))
        message = str(err.value)
        assert "\n" not in message and name in message and problem in message, message
        assert f"needs a byte-level BPE tokenizer.json with {EOT_TEXT} as its last id" in message
    r = run_cli("--input", str(corpus), "--tokenizer-file", "text.json", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: data.tokenizer_file text.json: not JSON; needs a byte-level BPE tokenizer.json "
        f"with {EOT_TEXT} as its last id"
    ]
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()
    # A file beside another tokenizer or a vocab size: the one option that conflicts is named;
    # --tokenizer bpe (the file's kind) is not a conflict.
    for given, said in [(["-t", "byte"], "--tokenizer byte: --tokenizer-file ok.json is a BPE "
                                         "tokenizer; drop --tokenizer (or give --tokenizer bpe)"),
                        (["--vocab-size", "300"], "--vocab-size 300: the tokenizer file ok.json "
                                                  "gives the vocab size; drop --vocab-size")]:
        r = run_cli("--input", str(corpus), "--tokenizer-file", "ok.json", *given, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: {said}"]
    r = run_cli("--input", str(corpus), "--tokenizer-file", "ok.json", "-t", "bpe", "--out",
                "given", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "given" / "tokenizer.json").read_bytes() == (
        tmp_path / "ok.json").read_bytes()


def run_cli(*args, cwd):
    return andrea_main("prepare", *args, cwd=cwd)


def test_cli_bad_input(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "x.bin").write_bytes(b"x")
    (tmp_path / "bad.txt").write_bytes(b"good line\n" * 3 + b"caf\xe9\n" + b"more\n" * 20)
    cases = [
        (["--input", "missing.txt", "-t", "byte"], "missing.txt: no such file or directory"),
        (["--input", "empty.txt", "-t", "byte"], "empty.txt: input is empty (1 file(s), 0 "
                                                 "bytes); give a file, folder or glob that "
                                                 "holds text"),
        (["--input", "nothing", "-t", "byte"], "nothing: directory has no input files"),
        (["--input", "*.nope", "-t", "byte"], "matches no files"),
        (["--input", "bad.txt", "-t", "byte"], "bad.txt: invalid UTF-8 at byte offset 33"),
        (["-c", "andrea-tiny", "--set", "data.tokenizer=gpt2"], "50,257 ids but model.vocab_size"),
        (["-c", "andrea-tiny", "--input", "bad.txt"], "--config takes its input"),
    ]
    for args, message in cases:
        r = run_cli(*args, cwd=tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").rglob("manifest.json"))
    # The documented way past invalid bytes: replace them with U+FFFD.
    args = ("--input", "bad.txt", "-t", "byte", "--errors", "replace", "-o", "out")
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["errors"] == "replace" and manifest["tokens"]["train"] > 0


def test_a_folder_takes_regular_files_only(corpus, tmp_path):
    # A FIFO with a text name beside the corpus: opening it would wait forever for a writer.
    os.mkfifo(corpus / "sub" / "pipe.txt")
    # Hidden files and folders are no input (an editor's .swp.txt, a .git folder's notes);
    # mutation round 3: the walk without its test of a file's leading dot passed every test.
    (corpus / ".notes.txt").write_text("hidden\n")
    (corpus / ".git").mkdir()
    (corpus / ".git" / "msg.txt").write_text("hidden too\n")
    root = corpus.resolve()
    names = sorted(f.path.relative_to(root).as_posix() for f in input_files(str(corpus)))
    assert names == sorted(DOCS)
    # So the command prepares the folder (old code blocked here), as a glob always did.
    r = run_cli("--input", str(corpus), "-t", "byte", "-o", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli("--input", f"{corpus}/**/*.txt", "-t", "byte", "-o", "globbed", cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_a_named_input_that_is_no_file_is_named_as_what_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a socket's path is short when relative (108 bytes at most)
    os.mkfifo(tmp_path / "fifo.txt")
    r = run_cli("--input", "fifo.txt", "-t", "byte", cwd=tmp_path)
    assert_user_error(r, "fifo.txt: not a regular file: a FIFO")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind("sock.txt")
        r = run_cli("--input", "sock.txt", "-t", "byte", cwd=tmp_path)
    assert_user_error(r, "sock.txt: not a regular file: a socket")
    r = run_cli("--input", "/dev/null", "-t", "byte", cwd=tmp_path)
    assert_user_error(r, "/dev/null: not a regular file: a device")
    assert not (tmp_path / "data").exists()


def test_an_empty_val_split_says_why_and_what_helps(tmp_path):
    """Before: "the val split came out empty (inputs too small for val fraction 0.1); add text
    or raise data.val_fraction", for a 1 MB file of one line too, where neither helps (its one
    line break is its last byte, the tail after it empty), and for records all skipped. Now
    the line gives the rule, and for skipped records says so."""
    (tmp_path / "one.txt").write_text("word " * 200_000 + "\n")
    r = andrea_main("prepare", "--input", "one.txt", "-t", "byte", "-o", "o1", cwd=tmp_path)
    assert_user_error(r, "o1: the val split came out empty: a text file gives val its text "
                      "after the first line break at or after 90% of it (a file of one line "
                      "gives none)", "add text in more lines or records")
    (tmp_path / "bad.jsonl").write_text('{"title": "no text"}\n' * 20)
    r = andrea_main("prepare", "--input", "bad.jsonl", "-t", "byte", "--errors", "replace",
                    "-o", "o2", cwd=tmp_path)
    assert_user_error(r, "o2: no text came out of the inputs: every record was skipped (20 "
                      "records, data.errors replace)")
