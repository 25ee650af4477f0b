"""`andrea prepare` on real-corpus formats: JSON Lines (+gzip, zstd), Parquet, CSV, `datasets`
Arrow folders and mixes of them give the same tokens as the tokenizer on each document; the record
split is by document and independent of workers and chunking; a killed prepare resumes from its
last complete shard; bad input is a one-line error with nothing half-written."""

import csv
import gzip
import io
import json
import os
import random
import re
import shlex
import signal
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import andrea_main, assert_user_error, python_command

from andrea.data import documents, prepare, readers
from andrea.data.shards import open_shard, read_header
from andrea.data.tokenizer import Gpt2Tokenizer

WORDS = ["alpha", "beta", "café", "日本語", "the", "cat", "\n", "ROMEO:", "  ", "<|endoftext|>"]


def make_docs(n, seed=0):
    rng = random.Random(seed)
    return [f"Doc {i}. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 80)))
            for i in range(n)]


DOCS = make_docs(240)


def jsonl_bytes(docs, field="text"):
    return "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)).encode()


def csv_bytes(docs):
    """A header, then id,text rows (quoted where a text needs it; rows end in \r\n)."""
    out = io.StringIO(newline="")
    rows = csv.writer(out)
    rows.writerow(["id", "text", "n"])
    rows.writerows([i, d, len(d)] for i, d in enumerate(docs))
    return out.getvalue().encode()


def write_datasets_folder(folder, docs):
    """What `datasets.Dataset.save_to_disk` writes: Arrow stream files and state.json."""
    folder.mkdir()
    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=25):
                writer.write_batch(batch)
    (folder / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")


@pytest.fixture
def mixed(tmp_path):
    """The same 240 documents spread over every format, in sorted file order."""
    root = tmp_path / "in"
    root.mkdir()
    (root / "a.jsonl").write_bytes(jsonl_bytes(DOCS[:60]))
    (root / "b.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS[60:120])))
    (root / "c.json.zst").write_bytes(zstandard.ZstdCompressor().compress(
        jsonl_bytes(DOCS[120:180])))
    pq.write_table(pa.table({"id": list(range(30)), "text": DOCS[180:210]}),
                   root / "d.parquet", row_group_size=7)
    (root / "e.csv.zst").write_bytes(zstandard.ZstdCompressor().compress(csv_bytes(DOCS[210:])))
    return root


def split_tokens(out, split):
    manifest = prepare.read_manifest(out)
    return np.concatenate([open_shard(out / e["file"]) for e in manifest["shards"][split]])


def expected_tokens(docs, split, val_fraction=0.1):
    gpt2 = Gpt2Tokenizer()
    ids = []
    for d in docs:
        if documents.is_val_record(d.encode(), val_fraction) == (split == "val"):
            ids += gpt2.encode(d) + [gpt2.eot_id]
    return np.array(ids)


def test_every_format_gives_each_documents_tokens(mixed, tmp_path):
    r = andrea_main("prepare", "--input", str(mixed), "-t", "gpt2", "-o", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_tokens(out, split), expected_tokens(DOCS, split))
    n_val = sum(documents.is_val_record(d.encode(), 0.1) for d in DOCS)
    assert 10 < n_val < 40  # about 10% of 240 documents, whole documents each
    manifest = prepare.read_manifest(out)
    assert [i["name"].rsplit("/", 1)[1] for i in manifest["inputs"]] == [
        "a.jsonl", "b.jsonl.gz", "c.json.zst", "d.parquet", "e.csv.zst"]
    assert {"bytes", "mtime_ns", "sample_sha256"} <= set(manifest["inputs"][0])
    # A datasets save_to_disk folder holding the same documents gives the same tokens.
    write_datasets_folder(tmp_path / "ds", DOCS)
    ds = prepare.prepare_inputs(str(tmp_path / "ds"), "gpt2", tmp_path / "ds-out")
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_tokens(ds, split), split_tokens(out, split))


def test_record_split_ignores_workers_and_job_size(mixed, tmp_path, monkeypatch):
    one = prepare.prepare_inputs(str(mixed), "gpt2", tmp_path / "one", workers=1)
    monkeypatch.setattr(readers, "READ_BYTES", 300)  # many small jobs, row groups in batches
    two = prepare.prepare_inputs(str(mixed), "gpt2", tmp_path / "two", workers=2)
    write_datasets_folder(tmp_path / "ds", DOCS)  # Arrow batches cut into several jobs
    ds = prepare.prepare_inputs(str(tmp_path / "ds"), "gpt2", tmp_path / "ds-out", workers=2)
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_tokens(one, split), split_tokens(two, split))
        np.testing.assert_array_equal(split_tokens(one, split), split_tokens(ds, split))


CSV_DOCS = DOCS[:80] + ["with, commas", 'with "quotes" inside', "multi\nline\r\nfield", "", '"',
                        'a,"b"\n,c', "café 日本語"]


def test_csv_gives_the_shards_of_the_same_texts_as_json_lines(tmp_path, monkeypatch):
    (tmp_path / "a.csv").write_bytes(csv_bytes(CSV_DOCS))
    (tmp_path / "b.csv.gz").write_bytes(gzip.compress((tmp_path / "a.csv").read_bytes()))
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(CSV_DOCS))
    monkeypatch.setattr(readers, "READ_BYTES", 300)  # jobs cut between rows, inside none
    outs = {name: prepare.prepare_inputs(str(tmp_path / name), "byte", tmp_path / f"out-{name}")
            for name in ("a.jsonl", "a.csv", "b.csv.gz")}
    files = sorted(p.name for p in outs["a.jsonl"].glob("*.bin"))
    assert files == ["train_000000.bin", "val_000000.bin"]
    for name in ("a.csv", "b.csv.gz"):
        assert sorted(p.name for p in outs[name].glob("*.bin")) == files
        for file in files:
            assert (outs[name] / file).read_bytes() == (outs["a.jsonl"] / file).read_bytes()
        assert prepare.read_manifest(outs[name])["text_field"] == "text"
    r = andrea_main("prepare", "-i", "a.csv", "-t", "byte", "--text-field", "body", cwd=tmp_path)
    assert_user_error(r, "a.csv: no column 'body'; its header has: id, text, n",
                      "--text-field")
    assert not (tmp_path / "data").exists()


def test_csv_with_lone_cr_line_ends_reads_its_rows(tmp_path, monkeypatch):
    """Rows ended by a lone "\r" (old Mac files) are rows, as pyarrow.csv reads them; they were
    all taken as the header, and the file gave no text without a word."""
    (tmp_path / "mac.csv").write_bytes(csv_bytes(CSV_DOCS).replace(b"\r\n", b"\r"))
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes([d.replace("\r\n", "\r") for d in CSV_DOCS]))
    monkeypatch.setattr(readers, "READ_BYTES", 300)
    f = readers.InputFile(tmp_path / "mac.csv", "csv", "", 0, 0)
    assert len(list(readers.csv_jobs(f, "text", 0))) > 10  # cut in pieces, not read whole
    mac = prepare.prepare_inputs(str(tmp_path / "mac.csv"), "byte", tmp_path / "mac")
    lines = prepare.prepare_inputs(str(tmp_path / "a.jsonl"), "byte", tmp_path / "lines")
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_tokens(mac, split), split_tokens(lines, split))


def test_a_parquet_row_group_is_read_batch_by_batch_not_whole(tmp_path):
    """A row group's text column is streamed through a buffer of a block, not read whole first
    (pyarrow's default): a 200 MB row group held 120 MB more than a 50 MB one."""
    rows = [f"row {i} " + "word " * 400 for i in range(12_000)]  # 24 MB, one row group
    path = tmp_path / "one.parquet"
    pq.write_table(pa.table({"text": rows}), path, row_group_size=len(rows), compression="none")
    f = readers.InputFile(path, "parquet", "", path.stat().st_size, 0)
    base, peak, count = pa.total_allocated_bytes(), 0, 0
    for job in readers.parquet_jobs(f, "text", 0):
        peak = max(peak, pa.total_allocated_bytes() - base)
        count += len(job.data)
    assert count == len(rows)
    assert peak < 12_000_000  # a few batches and pages (the whole column: 24 MB)


def test_compressed_input_comes_in_blocks_however_well_it_compresses(tmp_path, monkeypatch):
    """Repetitive text compresses 10,000 to 1: read a block of file at a time, 500 MB of
    repeated JSON Lines (44 KB of zstd) came out of one call, and the prepare peaked at 6.7 GB.
    Fed to the decompressor a little at a time, it comes out in blocks of a READ_BYTES."""
    import tracemalloc

    monkeypatch.setattr(readers, "READ_BYTES", 1 << 16)
    monkeypatch.setattr(readers, "FEED_BYTES", 64, raising=False)
    blob = b'{"text": "the same line, again and again"}\n' * 100_000  # 4 MB
    for suffix, data in ((".gz", gzip.compress(blob, 9)),
                         (".zst", zstandard.ZstdCompressor(level=19).compress(blob))):
        path = tmp_path / f"a.jsonl{suffix}"
        path.write_bytes(data)
        f = readers.InputFile(path, "records", suffix, len(data), 0)
        tracemalloc.start()
        try:
            blocks = [(len(block), consumed) for block, consumed in readers.iter_blocks(f)]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert sum(n for n, _ in blocks) == len(blob) and sum(c for _, c in blocks) == len(data)
        assert max(n for n, _ in blocks) <= readers.READ_BYTES, suffix
        assert peak < 2_000_000, suffix
        assert len(list(readers.record_jobs(f, "text", 0))) >= len(blob) // 2 // (1 << 16)


def test_concatenated_members_are_read_on_and_jobs_know_their_lines(tmp_path, monkeypatch):
    """A .gz of several members (`cat a.gz b.gz`; bgzip writes them so) and a .zst of
    several frames read as all of their text; a JSON Lines job's first line is the file's line
    it names, however many jobs came before (what every message names). Mutation round 3:
    iter_blocks ending at the first member's end (the rest dropped without a word) and the
    line count one more a job both passed every test."""
    monkeypatch.setattr(readers, "READ_BYTES", 100)  # jobs of a few lines
    lines = [json.dumps({"text": f"line {i}"}).encode() for i in range(1, 61)]
    parts = [b"\n".join(lines[:20]) + b"\n", b"\n".join(lines[20:]) + b"\n"]
    compress = {".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}
    for suffix, pack in compress.items():
        blob = b"".join(pack(part) for part in parts)
        path = tmp_path / f"a.jsonl{suffix}"
        path.write_bytes(blob)
        f = readers.InputFile(path, "records", suffix, len(blob), 0)
        assert b"".join(block for block, _ in readers.iter_blocks(f)) == b"".join(parts)
        jobs = list(readers.record_jobs(f, "text", 0))
        assert len(jobs) > 5
        for job in jobs:
            assert job.data.split(b"\n")[0] == lines[job.start - 1], (suffix, job.start)


def test_a_row_of_many_blocks_is_searched_once_not_at_every_block(tmp_path, monkeypatch):
    """A JSON Lines record or CSV field longer than a block was searched for its end whole at
    every block: a 100 MB record took 9 s to cut, a 50 MB CSV field 30 s and 1 GB of memory.
    Now each block's bytes are searched once, so the bytes searched are about the file's (they
    were some 100 times the file's here: 200 blocks, half the piece on average each time)."""
    monkeypatch.setattr(readers, "READ_BYTES", 1024)
    searched: list[int] = []
    line_end = readers._last_line_end

    def counted_line_end(buf, start):
        searched.append(len(buf) - start)
        return line_end(buf, start)

    class CountedCsvRowEnd(readers._CsvRowEnd):
        def __call__(self, buf, start):
            searched.append(len(buf) - start)
            return super().__call__(buf, start)

    monkeypatch.setattr(readers, "_last_line_end", counted_line_end)
    monkeypatch.setattr(readers, "_CsvRowEnd", CountedCsvRowEnd)
    line = "word " * 200 + "\n"  # about a block
    for kind, reader in (("jsonl", "records"), ("csv", "csv")):
        blob = (jsonl_bytes if kind == "jsonl" else csv_bytes)([line * 200, 'b "q"'])
        (tmp_path / f"a.{kind}").write_bytes(blob)
        f = readers.InputFile(tmp_path / f"a.{kind}", reader, "", len(blob), 0)
        searched.clear()
        list(readers.BY_KIND[reader].jobs(f, "text", 0))
        assert len(searched) >= 150, (kind, len(searched))  # a search at each block
        assert sum(searched) <= 2 * len(blob), (kind, sum(searched), len(blob))


def test_csv_pieces_are_cut_where_a_search_of_the_whole_piece_cuts_them(tmp_path, monkeypatch):
    """A piece's row ends are searched in the new bytes alone, the quotes before them counted:
    the cuts are those of searching the whole piece (so a resumed prepare's jobs are the same),
    "\r" and "\r\n" at a block's edge and quoted line breaks included."""
    rng = random.Random(1)
    ends, inside = ["\n", "\r\n", "\r"], ["", "\n", "\r\n", "\r", '""', ","]
    rows = []
    for i in range(400):
        text = "x" * rng.randint(0, 40)
        if i % 3:  # quoted, with a line break, a doubled quote or a comma inside
            text = '"' + text + rng.choice(inside) + 'y"'
        rows.append(f"{i},{text}{rng.choice(ends)}")
    (tmp_path / "a.csv").write_bytes(("id,text\n" + "".join(rows)).encode())
    f = readers.InputFile(tmp_path / "a.csv", "csv", "", 0, 0)
    for read_bytes in (5, 16, 37, 64, 300):
        monkeypatch.setattr(readers, "READ_BYTES", read_bytes)
        whole, buf = [], b""
        for block, _ in readers.iter_blocks(f):
            buf += block
            ends = readers._csv_row_ends(buf) if len(buf) >= read_bytes else []
            if len(ends):
                whole.append(buf[: ends[-1]])
                buf = buf[ends[-1]:]
        whole += [buf] if buf else []
        got = [data for data, _ in readers._pieces(f, readers._CsvRowEnd)]
        assert got == whole, read_bytes


def test_the_stray_quote_check_holds_a_byte_a_byte():
    """The check of a piece's quotes copies it once as bytes: its edges as Python ints made the
    copy int64, 8 bytes a byte (400 MB for a 50 MB CSV field)."""
    import tracemalloc

    piece = csv_bytes(['a "quoted" text, with a comma' * 8] * 4000)  # 1 MB
    tracemalloc.start()
    try:
        assert readers._csv_stray_quote(piece) == -1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(piece)


@pytest.mark.parametrize("stray", ['12,a 12" pizza', '12,"a 12"" pizza" for two'])
def test_csv_quote_that_neither_opens_nor_closes_a_field_is_refused(tmp_path, monkeypatch,
                                                                     stray):
    """A " inside a field not quoted, or after a quoted field's closing one, is not RFC 4180:
    it flipped the quote parity that finds where a piece may be cut, so rows with line breaks
    after it were cut apart (text moved to the id column and lost) without a word. Refused
    naming its line and byte, whatever the size of the pieces."""
    rows = [f'{i},"Row {i} first line\nsecond line of row {i}, with comma"' for i in range(200)]
    blob = "\n".join(["id,text", *rows[:20], stray, *rows[20:]]).encode()
    (tmp_path / "q.csv").write_bytes(blob)
    at = blob.index(stray.encode()) + stray.rindex('" ')
    line = blob[:at].count(b"\n") + 1
    for read_bytes in (300, readers.READ_BYTES):
        monkeypatch.setattr(readers, "READ_BYTES", read_bytes)
        r = andrea_main("prepare", "-i", "q.csv", "-t", "byte", cwd=tmp_path)
        assert_user_error(r, f'q.csv: a " at line {line} (byte offset {at}) that neither opens '
                          'nor closes a quoted field', '"" for a " inside one')
        assert not (tmp_path / "data").exists()


def test_a_dictionary_encoded_text_column_reads_as_its_strings(tmp_path):
    """A Parquet (or Arrow) column of dictionary<values=string> (a pandas category column) is
    text; it was refused as 'holds dictionary<values=string, ...>, not strings'."""
    docs = DOCS[:40] * 3
    pq.write_table(pa.table({"text": docs}), tmp_path / "plain.parquet", row_group_size=50)
    pq.write_table(pa.table({"text": pa.array(docs).dictionary_encode()}),
                   tmp_path / "dict.parquet", row_group_size=50)
    write_datasets_folder(tmp_path / "ds", pa.array(docs).dictionary_encode())
    plain = prepare.prepare_inputs(str(tmp_path / "plain.parquet"), "byte", tmp_path / "plain")
    for name in ("dict.parquet", "ds"):
        encoded = prepare.prepare_inputs(str(tmp_path / name), "byte", tmp_path / f"out-{name}")
        for split in ("train", "val"):
            np.testing.assert_array_equal(split_tokens(encoded, split), split_tokens(plain, split))
    pq.write_table(pa.table({"text": pa.array([1, 2]).dictionary_encode()}), tmp_path / "n.parquet")
    r = andrea_main("prepare", "-i", "n.parquet", "-t", "byte", cwd=tmp_path)
    assert_user_error(r, "n.parquet: column 'text' holds", "not strings")


def test_text_field_and_skipped_records(tmp_path):
    lines = [json.dumps({"body": d}) for d in DOCS[:50]] + ['{"body": 5}', '{"other": "x"}']
    (tmp_path / "x.jsonl").write_text("\n".join(lines) + "\n")
    r = andrea_main("prepare", "-i", "x.jsonl", "-t", "byte", "-o", "strict", "--text-field",
                    "body", cwd=tmp_path)
    assert_user_error(r, "x.jsonl:51", "field 'body' is int", "--errors replace")
    assert not (tmp_path / "strict").exists()
    r = andrea_main("prepare", "-i", "x.jsonl", "-t", "byte", "-o", "out", "--text-field", "body",
                    "--errors", "replace", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "skipped 2 records without a string 'body'" in r.stdout
    assert prepare.read_manifest(tmp_path / "out")["skipped_records"] == 2
    r = andrea_main("prepare", "-i", "x.jsonl", "-t", "byte", "-o", "other", cwd=tmp_path)
    assert_user_error(r, "x.jsonl:1", "field 'text' is missing", "(fields: body)",
                      "--text-field")
    # Under `andrea train`, which has no --text-field or --errors: the keys it takes.
    train = ("train", "-c", "andrea-tiny", "--set", "data.source=x.jsonl", "--set",
             "train.max_steps=1", "--set", "train.runs_dir=runs", "--no-progress")
    line = assert_user_error(andrea_main(*train, cwd=tmp_path), "x.jsonl:1: field 'text' is "
                             "missing (fields: body); choose the field with --text-field "
                             "(data.text_field;", "--errors replace (data.errors=replace)")
    assert "not a string" not in line
    fixed = andrea_main(*train, "--set", "data.text_field=body", "--set", "data.errors=replace",
                        cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr


def test_a_record_field_and_its_replaced_bytes_as_documented(tmp_path):
    """A key that itself holds the dots wins over the dotted path (docs/data.md); the count of
    replaced bytes is of bytes: a character cut short after 2 of its 3 bytes is one U+FFFD for
    2 bytes. Mutation round 3: field_value without the whole-key lookup read "doc.body" as
    obj["doc"]["body"], and the count of sequences passed every test."""
    lines = [json.dumps({"doc.body": "the key", "doc": {"body": "the path"}}).encode(),
             json.dumps({"doc": {"body": "only the path"}}).encode(),
             b'{"doc.body": "cut \xe6\x97 short, bad \xff"}']
    job = readers.Job("records", "x.jsonl", 0, b"\n".join(lines), 1)
    out, tally = documents.job_documents(job, documents.Settings(0.0, "doc.body", "replace"))
    assert [text for _, text, _ in out] == ["the key", "only the path",
                                            "cut \ufffd short, bad \ufffd"]
    assert tally == documents.Tally(skipped=0, replaced=3)


def test_input_identity_is_size_mtime_and_sample(mixed, tmp_path, capsys):
    out = prepare.prepare_inputs(str(mixed), "byte", tmp_path / "out")
    prepare.prepare_inputs(str(mixed), "byte", out)
    assert "up to date" in capsys.readouterr().out
    stat = (mixed / "a.jsonl").stat()
    os.utime(mixed / "a.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    prepare.prepare_inputs(str(mixed), "byte", out)
    assert "changed since it was prepared" in capsys.readouterr().out


def test_input_identity_samples_the_middle_and_the_end(tmp_path):
    """An edit of a big file that keeps its size and modification time (`touch -r`, a copy
    that keeps times) is noticed in the middle and at the end, each 1 MiB hashed. Mutation
    round 3: hashing the start alone passed every test."""
    from andrea.data.inputs import input_files, input_identity

    path = tmp_path / "big.txt"
    blob = bytearray(b"some line of text\n" * 200_000)  # 3.6 MB
    path.write_bytes(blob)
    before = input_identity(input_files(str(path))[0])
    times = path.stat()
    for at in (len(blob) // 2, len(blob) - 2):
        edited = bytearray(blob)
        edited[at] = ord("X")
        path.write_bytes(edited)
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
        after = input_identity(input_files(str(path))[0])
        assert (after["bytes"], after["mtime_ns"]) == (before["bytes"], before["mtime_ns"])
        assert after["sample_sha256"] != before["sample_sha256"], at


def test_killed_prepare_resumes_from_its_last_complete_shard(tmp_path):
    """SIGKILL in the middle of the third train shard (a test hook pauses the real command
    there): the complete shards stay as they are, the partial one is only a .tmp that reads
    as incomplete, no manifest; the rerun keeps the complete shards and ends with the tokens
    of an uninterrupted prepare."""
    # About 3.7 MB of JSON, 2.5M train tokens: jobs of 1 MiB of JSON give about 620K tokens
    # each, so the second job fills train_000001 and _000002 and starts train_000003.
    (tmp_path / "big.jsonl").write_bytes(jsonl_bytes(make_docs(12_000, seed=1)))
    assert 2 * readers.READ_BYTES < (tmp_path / "big.jsonl").stat().st_size
    sets = ["-c", "andrea-tiny", "--set", "data.source=big.jsonl", "--set",
            "data.shard_tokens=400000", "--set", "data.workers=1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ANDREA_FAULTS": "prepare-pause@train_000003.bin"}
    proc = subprocess.Popen(python_command("-m", "andrea", "prepare", *sets, "-o", "out"),
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # blocks until the hook fires (or the command ends)
        assert line.strip() == "paused in train_000003.bin", (line, proc.stderr.read())
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert "manifest.json" not in names and "progress.json" in names
    (partial,) = [n for n in names if n.startswith("train_000003.bin.") and n.endswith(".tmp")]
    assert "train_000003.bin" not in names
    with pytest.raises(Exception, match="trailing bytes"):
        read_header(out / partial)  # its header still says 0 tokens
    complete = {n: (out / n).stat() for n in ("train_000000.bin", "train_000001.bin",
                                               "train_000002.bin", "val_000000.bin")}
    assert all(read_header(out / f"train_00000{k}.bin").count == 400_000 for k in range(3))
    r = andrea_main("prepare", *sets, "-o", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resuming after" in r.stdout and "from input job" in r.stdout
    for n, before in complete.items():
        after = (out / n).stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list(out.glob("*.tmp")) and not (out / "progress.json").exists()
    r = andrea_main("prepare", *sets, "-o", "clean", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_tokens(out, split),
                                      split_tokens(tmp_path / "clean", split))


def truncated(blob):
    return blob[: len(blob) * 2 // 3]


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path):
    docs = jsonl_bytes(DOCS[:80])
    (tmp_path / "cut.jsonl.gz").write_bytes(truncated(gzip.compress(docs)))
    (tmp_path / "cut.jsonl.zst").write_bytes(truncated(zstandard.ZstdCompressor().compress(docs)))
    (tmp_path / "fake.jsonl.gz").write_bytes(docs)
    pq.write_table(pa.table({"id": [1, 2], "body": ["a", "b"]}), tmp_path / "nofield.parquet")
    (tmp_path / "fake.parquet").write_bytes(docs)
    head = b"".join(docs.splitlines(keepends=True)[:3])
    (tmp_path / "broken.jsonl").write_bytes(head + b'{"text": "unclosed\n' + docs)
    bad_utf8 = '{"text": "ok"}\n{"text": "caf\xe9"}\n'.encode("latin-1")
    (tmp_path / "latin1.jsonl").write_bytes(bad_utf8)
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "latin1.csv").write_bytes("id,t\xeate,text\n1,a,b\n".encode("latin-1"))
    (tmp_path / "utf16.csv").write_bytes(csv_bytes(DOCS[:5]).decode().encode("utf-16"))
    png = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x10\0\0\0\x10\x08\x02"
    (tmp_path / "image.csv").write_bytes(png + bytes(range(256)) * 4)
    (tmp_path / "empty").mkdir()
    cases = [
        (["-i", "cut.jsonl.gz"], ["cut.jsonl.gz: truncated .gz file"]),
        (["-i", "cut.jsonl.zst"], ["cut.jsonl.zst: truncated .zst file"]),
        (["-i", "fake.jsonl.gz"], ["fake.jsonl.gz: not .gz data"]),
        (["-i", "nofield.parquet"], ["nofield.parquet: no column 'text'; it has: id, body"]),
        (["-i", "fake.parquet"], ["fake.parquet: not a readable Parquet file"]),
        (["-i", "broken.jsonl"], ["broken.jsonl:4: not a JSON object per line (Unterminated "
                                    "string starting at column 10)"]),
        (["-i", "latin1.jsonl", "--errors", "strict"], ["latin1.jsonl:2: invalid UTF-8"]),
        (["-i", "blob.bin"], ["blob.bin: looks binary", "text, JSON Lines, CSV, Parquet or "
                                                         "Arrow files"]),
        (["-i", "latin1.csv"], ["latin1.csv: invalid UTF-8 at byte offset 4, in its header row; "
                                "fix the file (CSV is read as UTF-8 text)"]),
        (["-i", "utf16.csv"], ["utf16.csv: looks binary (NUL bytes), not text"]),
        (["-i", "image.csv"], ["image.csv: looks binary (NUL bytes), not text"]),
        (["-i", "empty"], ["empty: directory has no input files"]),
        (["-i", "nothing/*.jsonl"], ["nothing/*.jsonl: the pattern matches no files"]),
    ]
    for args, fragments in cases:
        r = andrea_main("prepare", *args, "-t", "byte", cwd=tmp_path)
        assert_user_error(r, *fragments)
        # No output folder, not even an empty data/ (issue 11, item 7).
        assert not (tmp_path / "data").exists(), (args, list((tmp_path / "data").rglob("*")))


def test_mixture_errors_through_the_command(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(DOCS[:120]))
    (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(make_docs(120, seed=5)))
    weight0 = "data.sources=[{path: a.jsonl, weight: 1}, {path: b.jsonl, weight: 0}]"
    r = andrea_main("prepare", "-c", "andrea-tiny", "--set", weight0, cwd=tmp_path)
    assert_user_error(r, "data.sources[1].weight: must be a number > 0, got 0")
    r = andrea_main("prepare", "-c", "andrea-tiny", "--set", weight0.replace("0}", "-2}"),
                    cwd=tmp_path)
    assert_user_error(r, "data.sources[1].weight", "got -2")
    # A BPE trained per source: two tokenizers, which one mixture cannot use. Refused before
    # anything is prepared (it was refused after preparing both), naming the commands that
    # share one BPE; pasted, the mixture prepares.
    both = "data.sources=[{path: a.jsonl, weight: 1}, {path: b.jsonl, weight: 2}]"
    argv = ["prepare", "-c", "andrea-tiny", "--set", both, "--set", "data.tokenizer=bpe"]
    line = assert_user_error(andrea_main(*argv, cwd=tmp_path), "data.sources: 2 sources with "
                             "data.tokenizer bpe would each train a BPE of their own")
    assert not (tmp_path / "data").exists()
    first, extra = [shlex.split(c) for c in re.findall(r"`([^`]+)`", line)]
    assert first[:2] == ["andrea", "prepare"] and extra[0] == "--set"
    assert andrea_main(*first[1:], cwd=tmp_path).returncode == 0
    r = andrea_main(*argv, *extra, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    shared = (tmp_path / "data" / "a-bpe-320" / "tokenizer.json").read_bytes()
    prepared = sorted(p for p in (tmp_path / "data").glob("*-bpe-tok*"))
    assert [p.name[:2] for p in prepared] == ["a-", "b-"]
    assert all((p / "tokenizer.json").read_bytes() == shared for p in prepared)
    r = andrea_main("prepare", "-c", "andrea-tiny", "--set", both, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "data" / "a-byte" / "manifest.json").is_file()
    assert (tmp_path / "data" / "b-byte" / "manifest.json").is_file()



def test_train_on_a_mixture_reports_the_realised_share(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(make_docs(300, seed=2)))
    pq.write_table(pa.table({"text": make_docs(300, seed=3)}), tmp_path / "b.parquet")
    r = andrea_main(
        "train", "-c", "andrea-tiny",
        "--set", "data.sources=[{path: a.jsonl, weight: 3}, {path: b.parquet, weight: 1}]",
        "--set", "train.max_steps=2", "--set", "train.micro_batch_size=4",
        "--set", "train.eval_every=2", cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    share = [i for i, line in enumerate(lines) if line.startswith("data mixture, realised")]
    # among the start lines (the plan), before the first step's line
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert share and share[0] < first_step, lines
    assert "over steps 1-2: a.jsonl " in lines[share[0]] and "(weight 75.0%)" in lines[share[0]]
    records = [json.loads(line) for line in
               (tmp_path / "runs" / "andrea-tiny" / "metrics.jsonl").read_text().splitlines()]
    (mix,) = [rec for rec in records if rec["event"] == "data_mixture"]
    assert set(mix["share"]) == {"a.jsonl", "b.parquet"} and mix["steps"] == [1, 2]
    assert abs(sum(mix["share"].values()) - 1) < 1e-6
    assert mix["weight"] == {"a.jsonl": 0.75, "b.parquet": 0.25}
