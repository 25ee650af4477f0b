"""Damaged token shards and data folders (issue 41): a shard's checksum, recorded as prepare
writes it, is checked by `andrea prepare --verify` and, on a thread, by every training; an id
out of range never reaches the embedding; a missing shard or an unreadable manifest is named
and prepared again, never in silence."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    Result,
    andrea_main,
    assert_user_error,
    python_command,
    tiny_config,
    wait_until,
    without_notes,
)
from test_cli import run_main
from test_prepare import corpus  # noqa: F401  (a fixture)

from andrea.config import load_config
from andrea.data import documents, encode, loader, prepare, verify
from andrea.data.shards import HEADER_BYTES, MANIFEST, ShardChanged, open_shard
from andrea.errors import UserError

# data_dir: the session fixture in conftest.py (the tiny preset's data), copied before damage.
FIRST_RUN = "(first run only)"


def copy_data(data_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "data"
    shutil.copytree(data_dir, out)
    return out


def set_token(shard: Path, position: int, value: int) -> int:
    """Write one uint16 token of a shard in place; returns the value it held."""
    tokens = open_shard(shard)
    old = int(tokens[position])
    with open(shard, "r+b") as f:
        f.seek(HEADER_BYTES + 2 * position)
        f.write(np.uint16(value).tobytes())
    return old


def drop_checksums(data: Path) -> None:
    """The manifest as a prepare before checksums wrote it."""
    manifest = json.loads((data / MANIFEST).read_text())
    manifest.pop("shard_checksum", None)
    for entries in manifest["shards"].values():
        for entry in entries:
            entry.pop("checksum", None)
    (data / MANIFEST).write_text(json.dumps(manifest))


def train_argv(data: Path, runs: Path, *sets: str) -> list[str]:
    argv = ["train", "--no-progress", "--config", "andrea-tiny", "--set", f"data.dir={data}",
            "--set", f"train.runs_dir={runs}", "--set", "train.name=t",
            "--set", "train.eval_every=0", "--set", "train.checkpoint_every=2"]
    for s in sets:
        argv += ["--set", s]
    return argv


def test_prepare_records_each_shards_checksum(data_dir):
    manifest = json.loads((data_dir / MANIFEST).read_text())
    assert manifest["shard_checksum"] == "crc32"
    for entries in manifest["shards"].values():
        for e in entries:
            assert e["checksum"] == verify.token_crc32(data_dir / e["file"])


def test_in_range_damage_stops_the_run_keeping_its_checkpoints(data_dir, tmp_path, capsys):
    """An id changed to another valid id trained silently before. Now the run stops with one
    line naming the shard, before another checkpoint; deleting the shard and resuming prepares
    the folder again and finishes the run."""
    data, runs = copy_data(data_dir, tmp_path), tmp_path / "runs"
    assert run_main(capsys, *train_argv(data, runs, "train.max_steps=4"))[0] == 0
    shard = data / "train_000000.bin"
    old = set_token(shard, 123_457, 0)
    assert old != 0
    code, out, err = run_main(capsys, *train_argv(data, runs, "train.max_steps=8"),
                              "--resume", "auto")
    assert code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {shard}: checksum mismatch (crc32 of its tokens is ")
    assert f"`rm {shard}`" in line and "--resume" in line
    assert sorted(p.name for p in (runs / "t").glob("step-*")) == ["step-000002", "step-000004"]
    shard.unlink()
    code, out, err = run_main(capsys, *train_argv(data, runs, "train.max_steps=8"),
                              "--resume", "auto")
    assert code == 0, err
    assert f"{shard}: token shard missing; preparing {data} again from the same inputs" in out
    assert FIRST_RUN not in out
    assert (runs / "t" / "latest").read_text().strip() == "step-000008"


def test_out_of_range_id_is_one_line_naming_shard_and_position(data_dir, tmp_path, capsys):
    """Before: `IndexError: index out of range in self`, a traceback naming no file. A folder
    without checksums (prepared before them) is caught by the loader's check of each batch."""
    data, runs = copy_data(data_dir, tmp_path), tmp_path / "runs"
    drop_checksums(data)
    shard = data / "train_000000.bin"
    tokens = np.array(open_shard(shard))
    with open(shard, "r+b") as f:  # every id of the shard out of range: step 1 reads one
        f.seek(HEADER_BYTES)
        f.write((tokens + 300).astype("<u2").tobytes())
    code, out, err = run_main(capsys, *train_argv(data, runs, "train.max_steps=2"))
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {shard}: token ")
    assert "at position " in err and "outside the tokenizer's 257 ids" in err


def test_loader_checks_ids_of_train_batches_and_val_windows(data_dir, tmp_path):
    """The check is on the host-side batch: the position named is the damaged token's."""
    data = copy_data(data_dir, tmp_path)
    set_token(data / "val_000000.bin", 1000, 40_000)
    val = loader.TokenSplit(data, "val")
    windows = loader.val_windows(val, 64)
    with pytest.raises(UserError, match=r"val_000000.bin: token 40000 at position 1,000 is "
                                        r"outside the tokenizer's 257 ids"):
        for group in loader.window_groups(windows, 8):
            loader.read_batch(val, group)
    train = loader.TokenSplit(data, "train")
    args = dict(seed=0, step=0, micro_step=0, rank=0, accum_steps=1, world_size=1,
                micro_batch_size=8, block_size=64)
    x, _ = loader.train_batch(train, **args)
    rng = np.random.default_rng([0, 0])
    offset = int(rng.integers(0, 64))
    position = int(offset + 64 * loader._draw_windows(
        train, rng, np.cumsum(train.window_counts(64, offset)), 8)[0]) + 3
    assert int(x[0, 3]) == int(open_shard(data / "train_000000.bin")[position])
    set_token(data / "train_000000.bin", position, 9999)
    with pytest.raises(UserError, match=rf"train_000000.bin: token 9999 at position "
                                        rf"{position:,} is outside"):
        loader.train_batch(loader.TokenSplit(data, "train"), **args)


def test_checksums_are_checked_on_a_thread_without_delaying_the_first_batch(
        data_dir, tmp_path, monkeypatch):
    """However long the checksums take (here: until released), the first batch is served at
    once; the damage found stops the next batch, and wait_checked (before a checkpoint)."""
    data = copy_data(data_dir, tmp_path)
    release = threading.Event()
    real = verify.token_crc32

    def slow(path):
        release.wait(30)
        return "00000000" if path.name == "val_000000.bin" else real(path)

    monkeypatch.setattr(verify, "token_crc32", slow)
    train, val = loader.TokenSplit(data, "train"), loader.TokenSplit(data, "val")
    check = loader.check_in_background(train, val)
    args = dict(seed=0, step=0, micro_step=0, rank=0, accum_steps=1, world_size=1,
                micro_batch_size=8, block_size=64)
    t0 = time.perf_counter()
    loader.train_batch(train, **args)
    assert time.perf_counter() - t0 < 1.0 and not check.done
    release.set()
    with pytest.raises(UserError, match=r"val_000000.bin: checksum mismatch .* records "):
        loader.wait_checked(train)
    with pytest.raises(UserError, match=r"val_000000.bin: checksum mismatch"):
        loader.train_batch(train, **args)


def test_prepare_verify_a_good_and_a_damaged_folder(data_dir, tmp_path, capsys):
    data = copy_data(data_dir, tmp_path)
    code, out, err = run_main(capsys, "prepare", "--verify", str(data))
    assert code == 0 and err == ""
    assert out.startswith(f"{data}: 2 shards (") and "intact, crc32 checksums match" in out
    assert len(out.splitlines()) == 1
    set_token(data / "train_000000.bin", 5, 7)
    val = data / "val_000000.bin"
    val.write_bytes(val.read_bytes()[:-2])
    code, out, err = run_main(capsys, "prepare", "--verify", str(data))
    assert code == 2
    assert out.splitlines() == [
        f"{data / 'train_000000.bin'}: checksum mismatch (crc32 of its tokens is "
        + out.split("is ")[1].split(",")[0] + ", manifest.json records "
        + json.loads((data / MANIFEST).read_text())["shards"]["train"][0]["checksum"]
        + "): the shard is damaged",
        f"{val}: token shard truncated: {val.stat().st_size} bytes, header says "
        f"{(val.stat().st_size + 2 - HEADER_BYTES) // 2} tokens = {val.stat().st_size + 2} "
        "bytes"]
    assert err.startswith(f"error: {data}: 2 of 2 shards damaged; delete them (`rm ")


def test_verify_holds_each_shard_to_its_manifest_count(data_dir, tmp_path, capsys):
    """A manifest whose count for a shard is not the shard's (the shard whole, its checksum
    matching) is named, as a training's loader names it. Mutation round 3: verify without the
    count check called the folder intact."""
    data = copy_data(data_dir, tmp_path)
    manifest = json.loads((data / MANIFEST).read_text())
    entry = manifest["shards"]["val"][0]
    entry["tokens"] += 1
    (data / MANIFEST).write_text(json.dumps(manifest))
    code, out, _ = run_main(capsys, "prepare", "--verify", str(data))
    assert code == 2 and out == (f"{data / 'val_000000.bin'}: {entry['tokens'] - 1:,} tokens, "
                                 f"manifest.json says {entry['tokens']}\n")


def test_old_manifest_without_checksums_still_trains_and_verifies(data_dir, tmp_path, capsys):
    data, runs = copy_data(data_dir, tmp_path), tmp_path / "runs"
    drop_checksums(data)
    assert run_main(capsys, *train_argv(data, runs, "train.max_steps=2"))[0] == 0
    code, out, _ = run_main(capsys, "prepare", "--verify", str(data))
    assert code == 0 and "no checksums recorded" in out
    # 257, the first id past the byte tokenizer's (mutation round 3: the range check as
    # `<=` passed every test at 258).
    set_token(data / "train_000000.bin", 77, 257)
    code, out, _ = run_main(capsys, "prepare", "--verify", str(data))
    assert code == 2 and out == (f"{data / 'train_000000.bin'}: token 257 at position 77 is "
                                 "outside the tokenizer's 257 ids: the shard is damaged\n")


@pytest.mark.parametrize("damage", ["deleted shard", "garbage", "truncated", "not an object"])
def test_a_damaged_folder_is_named_and_prepared_again(data_dir, tmp_path, capsys, damage):
    """Before: prepared again under "preparing ... (first run only)", nothing said why."""
    data = copy_data(data_dir, tmp_path)
    manifest = data / MANIFEST
    if damage == "deleted shard":
        (data / "val_000000.bin").unlink()
    elif damage == "garbage":
        manifest.write_bytes(b"\x00\x17garbage")
    elif damage == "truncated":
        manifest.write_text(manifest.read_text()[:100])
    else:
        manifest.write_text("[1, 2]")
    cfg = load_config("andrea-tiny", [f"data.dir={data}"])
    assert prepare.ensure_prepared(cfg) == data
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and FIRST_RUN not in lines[0]
    if damage == "deleted shard":
        assert lines == [f"{data / 'val_000000.bin'}: token shard missing; preparing {data} "
                         "again from the same inputs (nothing kept)"]
    else:
        assert lines[0].startswith(f"{manifest}: unreadable (")
        assert lines[0].endswith(f"); preparing {data} again from its inputs, nothing of it kept")
    assert verify.verify_folder(data).endswith(")")  # intact again
    assert json.loads(manifest.read_text())["shards"] == json.loads(
        (data_dir / MANIFEST).read_text())["shards"]


def test_a_bpe_folder_prepared_again_keeps_its_tokenizer(corpus, tmp_path, capsys):  # noqa: F811
    """A run's checkpoint names its tokenizer: after a shard is lost, the folder prepared again
    keeps the same tokenizer.json (not a BPE trained anew), so a resume still matches."""
    out = prepare.prepare_inputs(str(corpus), "bpe", tmp_path / "out", vocab_size=300,
                                 shard_tokens=300)
    tok = (out / "tokenizer.json").stat()
    before = json.loads((out / MANIFEST).read_text())
    (out / "train_000001.bin").unlink()
    capsys.readouterr()
    prepare.prepare_inputs(str(corpus), "bpe", out, vocab_size=300, shard_tokens=300,
                           verbose=False, announce=f"preparing {out} {FIRST_RUN}")
    assert capsys.readouterr().out.splitlines() == [
        f"{out / 'train_000001.bin'}: token shard missing; preparing {out} again from the same "
        "inputs (keeping its tokenizer.json)"]
    again = (out / "tokenizer.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (tok.st_ino, tok.st_mtime_ns)
    assert json.loads((out / MANIFEST).read_text())["shards"] == before["shards"]
    assert not (out / "progress.json").exists()


def test_an_interrupted_prepare_continues_without_first_run_only(corpus, tmp_path,  # noqa: F811
                                                                monkeypatch, capsys):
    """A folder holding an interrupted prepare's progress.json was prepared before: the next
    prepare says what it continues after, never "(first run only)"."""
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
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_inputs(str(corpus), "byte", out, shard_tokens=300, workers=1)
    assert (out / "progress.json").is_file()
    monkeypatch.setattr(encode, "encode_job", real)
    capsys.readouterr()
    prepare.prepare_inputs(str(corpus), "byte", out, shard_tokens=300, workers=1,
                           verbose=False, announce=f"preparing {out} {FIRST_RUN}")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{out}: resuming after 4 complete shards")


# ----------------------------------------------------------------------------- changed under a run
# (issue 51) A shard changed while a training reads it: shards are read with os.pread and each
# shard a batch read is checked (inode, size, modification time) once the batch is read.


def train_events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_shard_cut_short_under_a_running_training_is_one_line_with_a_checkpoint(
        data_dir, tmp_path):
    """Before: np.memmap read past the new end and the process died of SIGBUS (the shell's
    `Bus error`, exit 135), no andrea line, the steps since the last checkpoint lost. Now: one
    line naming the shard and the command that goes on, exit 2, the last completed step
    checkpointed; the pasted command prepares the folder again and continues."""
    data, runs = copy_data(data_dir, tmp_path), tmp_path / "runs"
    run = runs / "t"
    argv = train_argv(data, runs, "train.max_steps=100000", "train.checkpoint_every=0",
                      "train.log_every=1", "train.precision=fp32")
    proc = subprocess.Popen(python_command("-m", "andrea", *argv), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_until(lambda: (run / "metrics.jsonl").exists()
                   and any(e.get("step", 0) >= 3 for e in train_events(run)),
                   what="step 3's record", timeout=120, proc=proc)
        shard = data / "train_000000.bin"
        os.truncate(shard, shard.stat().st_size - 8192)  # as the run was cut
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    line = assert_user_error(Result(proc.returncode, out, without_notes(err)),
                             f"{shard}: token shard changed while the training read it (cut "
                             "short to ")
    done = max(e["step"] for e in train_events(run) if e["event"] == "train")
    assert f"stopped after step {done}, checkpoint {run / f'step-{done:06d}'}; " in line
    assert (run / "latest").read_text().strip() == f"step-{done:06d}"
    end = train_events(run)[-1]
    assert (end["event"], end["state"], end["checkpoint"]) == ("end", "stopped",
                                                                 f"step-{done:06d}")
    pasted = shlex.split(line.split("continue: ")[1].split(" (it names")[0])
    assert pasted[:3] == ["andrea", "train", "--resume"]
    again = andrea_main(*pasted[1:], "--no-progress", "--stop-after", "2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"{shard}: token shard truncated: " in again.stdout
    assert (run / "latest").read_text().strip() == f"step-{done + 2:06d}"


@pytest.mark.parametrize("change, says", [
    ("truncate", "cut short to "), ("rewrite", "rewritten in place: its modification time "
                                               "moved"),
    ("replace", "replaced by another file"), ("delete", "deleted"), ("grow", "grown to "),
])
def test_each_change_of_a_shard_read_is_named_at_the_next_batch(data_dir, tmp_path, change,
                                                                 says):
    """The checks a batch makes once read: the shard's inode, size and modification time as
    when the split opened it. A same-size rewrite is seen by its modification time (one that
    keeps it is not: a documented limit)."""
    data = copy_data(data_dir, tmp_path)
    split = loader.TokenSplit(data, "train")
    args = dict(seed=0, step=0, micro_step=0, rank=0, accum_steps=1, world_size=1,
                micro_batch_size=8, block_size=64)
    loader.train_batch(split, **args)
    shard = data / "train_000000.bin"
    blob = shard.read_bytes()
    if change == "truncate":
        os.truncate(shard, len(blob) - 8192)
    elif change == "rewrite":
        before = shard.stat().st_mtime_ns
        with open(shard, "r+b") as f:  # the same bytes: only the time says it was written
            f.write(blob[:4096])
        os.utime(shard, ns=(before + 1_000_000, before + 1_000_000))  # a coarse clock's tick
    elif change == "replace":
        (data / "other.bin").write_bytes(blob)
        os.replace(data / "other.bin", shard)
    elif change == "delete":
        shard.unlink()
    else:
        with open(shard, "ab") as f:
            f.write(b"\0\0")
    with pytest.raises(ShardChanged, match=re.escape(f"{shard}: token shard changed while "
                                                     f"andrea read it ({says}")) as caught:
        loader.train_batch(split, **{**args, "step": 1})
    assert caught.value.split == "train"


def test_a_read_past_a_new_end_is_named_never_a_bus_error(data_dir, tmp_path):
    """The race a check alone cannot close: the file cut short between the check and the
    read. os.pread comes back short; np.memmap would have raised SIGBUS."""
    data = copy_data(data_dir, tmp_path)
    val = loader.TokenSplit(data, "val")
    shard = data / "val_000000.bin"
    os.truncate(shard, HEADER_BYTES + 1000)
    with pytest.raises(ShardChanged, match=r"val_000000.bin: token shard changed while andrea "
                                           r"read it \(cut short: a read at byte 1,256 found its "
                                           r"end\)"):
        val.tokens(0, 500, 1000)
    with pytest.raises(ShardChanged, match=r"val_000000.bin: .*\(cut short to 1,256 bytes from "):
        loader.read_batch(val, [(0, 0, 64)])


def test_windows_read_with_pread_are_the_shards_bytes(data_dir):
    """Batches are what np.memmap read before, bit for bit (an exact resume depends on it)."""
    split = loader.TokenSplit(data_dir, "train")
    mapped = np.memmap(data_dir / "train_000000.bin", dtype="<u2", mode="r",
                       offset=HEADER_BYTES)
    for start in (0, 1, 12_345, len(mapped) - 65):
        assert np.array_equal(split.tokens(0, start, 65), np.asarray(mapped[start:start + 65],
                                                                     dtype=np.int64))


@pytest.mark.parametrize("where", ["train", "val"])
def test_a_stop_for_a_changed_shard_resumes_as_the_uninterrupted_run(
        data_dir, tmp_path, monkeypatch, where):
    """A train shard rewritten in place (its bytes the same, its time moved) during step 4's
    second micro-batch: that step is dropped, step 3 checkpointed with the generator states
    step 4 began with, so the resume equals the uninterrupted run exactly (dropout draws from
    them). A val shard changed during step 2's evaluation: step 2 is complete and checkpointed."""

    from andrea.train import loop

    sets = ("train.max_steps=6", "train.precision=fp32", "model.dropout=0.1",
            "train.global_batch_tokens=1024", "train.eval_every=2", "train.eval_tokens=256")
    whole = loop.train(tiny_config(tmp_path / "a" / "runs", data_dir, *sets), progress=False)
    data = copy_data(data_dir, tmp_path)
    cfg = tiny_config(tmp_path / "b" / "runs", data, *sets)
    shard = data / f"{where}_000000.bin"

    def touch() -> None:
        t = shard.stat().st_mtime_ns + 1_000_000
        os.utime(shard, ns=(t, t))

    real_batch, real_score = loop.train_batch, loop.score_val

    def batch(*args, **kwargs):
        if where == "train" and kwargs["step"] == 3 and kwargs["micro_step"] == 1:
            touch()
        return real_batch(*args, **kwargs)

    def score(*args, **kwargs):
        if where == "val" and not score.calls:
            touch()
        score.calls += 1
        return real_score(*args, **kwargs)

    score.calls = 0
    monkeypatch.setattr(loop, "train_batch", batch)
    monkeypatch.setattr(loop, "score_val", score)
    first = loop.train(cfg, progress=False)
    done = 3 if where == "train" else 2
    assert (first.exit_code, first.state, first.steps) == (2, "stopped", done)
    assert first.checkpoint == first.run_dir / f"step-{done:06d}"
    assert first.message.startswith(f"{shard}: token shard changed while the training read it "
                                    f"(rewritten in place")
    monkeypatch.undo()
    rest = loop.train(cfg, resume=str(first.run_dir), progress=False)
    assert rest.steps == 6 and {**first.losses, **rest.losses} == whole.losses
    assert rest.best_val_loss == whole.best_val_loss
