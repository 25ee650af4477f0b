"""A full disk at a checkpoint: the run stops in one line before or after a failed write, with
`latest` and the older checkpoints intact and nothing partial left; resumed on a disk with room
it equals an uninterrupted run. The room is checked at start (a warning) and before each
checkpoint (a clean stop before anything is written)."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import run_torchrun, small_disk, tiny_config
from test_cli import run_main

from andrea.config import load_config
from andrea.model.transformer import Andrea
from andrea.runs import format_table, list_runs
from andrea.train import checkpoint as ckpt_io
from andrea.train.loop import train
from andrea.train.optim import build_optimizer
from andrea.train.rundir import OPTIMIZER_FILE, checkpoint_problem

# data_dir: the session fixture in conftest.py. Checkpoints at steps 2, 4 and 6 (~1.5 MB each).
SETS = ("train.max_steps=6", "train.checkpoint_every=2", "train.keep_last=3")


def steps_logged(run_dir: Path) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad norm); a resumed step's newer record replaces the older one."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if r["event"] == "train"}


def final_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    weights = ckpt_io.read_model_checkpoint(ckpt)[0]
    moments = ckpt_io.read_safetensors(ckpt / OPTIMIZER_FILE)[0]
    return {**weights, **{f"optimizer.{k}": v for k, v in moments.items()}}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_dir) -> tuple[dict, dict, Path]:
    result = train(tiny_config(tmp_path_factory.mktemp("whole"), data_dir, *SETS), progress=False)
    return steps_logged(result.run_dir), final_tensors(result.checkpoint), result.checkpoint


def assert_resumes_as_uninterrupted(run_dir: Path, data_dir: Path, uninterrupted) -> None:
    """Resume `run_dir` (on a disk with room) to the end: every step's loss and grad norm and
    the final weights and optimizer state equal the uninterrupted run's, exactly."""
    rest = train(tiny_config(run_dir.parent, data_dir, *SETS), resume=str(run_dir), progress=False)
    assert rest.state == "finished" and rest.steps == 6, rest.message
    logged, tensors, _ = uninterrupted
    assert steps_logged(run_dir) == logged
    got = final_tensors(rest.checkpoint)
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def assert_stopped_at_4(run_dir: Path) -> None:
    assert (run_dir / "latest").read_text().strip() == "step-000002"
    assert [p.name for p in run_dir.iterdir() if p.name.startswith("step-")] == ["step-000002"]
    assert checkpoint_problem(run_dir / "step-000002", for_resume=True) is None


def test_the_estimate_is_within_two_percent_of_a_real_checkpoint(uninterrupted):
    cfg = load_config("andrea-tiny")
    model = Andrea(cfg.model)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))  # no state yet: estimated
    estimate = ckpt_io.checkpoint_nbytes(model, optimizer, False, 1, "cpu")
    real = sum(f.stat().st_size for f in uninterrupted[2].iterdir())
    assert real <= estimate <= 1.02 * real, (estimate, real)


def test_a_failed_checkpoint_write_stops_cleanly(tmp_path, data_dir, inject_faults):
    inject_faults("disk-full@checkpoint:step-000004")  # ENOSPC after its model file is written
    cut = train(tiny_config(tmp_path, data_dir, *SETS), progress=False)
    inject_faults(None)
    run_dir = tmp_path / "t"
    assert (cut.state, cut.exit_code, cut.steps) == ("stopped", 2, 4)
    assert cut.message.startswith(f"disk full at step 4: writing {run_dir}/step-000004 failed "
                                  f"(No space left on device"), cut.message
    assert "its partial folder is removed" in cut.message
    assert f"latest is still {run_dir}/step-000002" in cut.message
    assert cut.message.endswith(f"andrea train --resume {run_dir} (its new path if moved)")
    assert_stopped_at_4(run_dir)  # no step-000004.partial-* either
    (note,) = [line for line in format_table(list_runs(tmp_path)).splitlines()
               if line.startswith("  t: ")]
    assert note.startswith("  t: disk full at step 4: ")


def test_a_failed_write_not_about_room_does_not_say_to_free_space(tmp_path, data_dir):
    """A file where the checkpoint's folder goes (ENOTDIR), with gigabytes free. Before: `...;
    free space there, or move RUN to a disk with room, then continue`."""
    run_dir = train(tiny_config(tmp_path, data_dir, *SETS, "train.max_steps=2"),
                    progress=False).run_dir
    (run_dir / "step-000004").write_text("the user's notes\n")
    cut = train(tiny_config(tmp_path, data_dir, *SETS, "train.max_steps=4"),
                resume=str(run_dir), progress=False)
    assert (cut.state, cut.exit_code) == ("stopped", 2), cut.message
    assert cut.message.startswith(f"checkpoint write failed at step 4: writing "
                                  f"{run_dir}/step-000004 failed (a file, not a checkpoint "
                                  f"folder, is in the way: {run_dir}/step-000004;"), cut.message
    assert cut.message.endswith(f"latest is still {run_dir}/step-000002; fix that, then "
                                f"continue: andrea train --resume {run_dir}"), cut.message
    # The file is the user's: left as it was, under its own name (it was renamed to
    # step-000004.stale-PID for good, and that name was in the message).
    assert (run_dir / "step-000004").read_text() == "the user's notes\n"
    assert not list(run_dir.glob("*.stale-*"))
    # Another rank's failure has no cause here: the disk is the likely one, and said so.
    from andrea.train.checkpoint_room import describe_failure
    assert describe_failure(None) == ("a write failed on another rank", None)


def test_a_write_the_disk_refuses_leaves_the_file_as_it_was_and_nothing_beside_it(
        tmp_path, monkeypatch):
    """Every file andrea writes in a run (`latest`, config.yaml, a checkpoint's files) is
    written beside its name and renamed over it: a full disk mid-write (here at the flush, as
    a network or quota filesystem reports it) leaves the old bytes under the name, and no
    half-written temporary file beside it, in a folder a user backs up or copies."""
    import errno
    import os

    from andrea.fileio import atomic_write_text

    latest = tmp_path / "latest"
    atomic_write_text(latest, "step-000002\n")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(latest, "step-000004\n")
    assert latest.read_text() == "step-000002\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


@contextlib.contextmanager
def disk_of(disk: Path, kib: int, monkeypatch) -> Iterator[Path]:
    """A folder on a filesystem of `kib` KiB: a real tmpfs where this process may mount one
    (root), else one shutil.disk_usage says is that small (its files counted against it)."""
    with small_disk(disk, f"{kib}k") as mounted:
        if not mounted:
            real = shutil.disk_usage

            def usage(path):
                if not Path(path).resolve().is_relative_to(disk.resolve()):
                    return real(path)
                used = sum(f.stat().st_size for f in disk.rglob("*") if f.is_file())
                return real(path)._replace(free=kib * 1024 - used)

            monkeypatch.setattr(shutil, "disk_usage", usage)
        yield disk


@pytest.fixture
def small_disk_dir(tmp_path, monkeypatch):
    """A folder on a 2.5 MB filesystem (room for one tiny checkpoint, not two)."""
    with disk_of(tmp_path / "disk", 2441, monkeypatch) as disk:
        yield disk


def test_a_disk_smaller_than_one_checkpoint_stops_before_step_1(
    tmp_path, data_dir, monkeypatch, capsys
):
    """The 12M preset (on the tiny's bytes: 10.8M parameters) on a 12 MiB disk stops in set-up
    with one line naming the size, the room and the folder, writing nothing; its command, on
    the disk with room it names, trains the same config there."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where the line finds room
    with disk_of(tmp_path / "disk", 12 * 1024, monkeypatch) as disk:
        sets = [f"data.dir={data_dir}", "data.tokenizer=byte", "model.vocab_size=320",
                f"train.runs_dir={disk / 'runs'}", "train.micro_batch_size=4",
                "train.max_steps=2", "train.name=m"]
        code, out, err = run_main(capsys, "train", "--config", "andrea-12m", "--no-progress",
                                  *(x for kv in sets for x in ("--set", kv)))
        assert code == 2 and "step 1" not in out and not (disk / "runs").exists(), out + err
        (line,) = err.splitlines()
        needed = re.match(rf"error: {disk}/runs/m: a checkpoint of this run needs about "
                          r"([\d.]+) MiB, its disk has ([\d.]+) MiB free; nothing was trained "
                          r"or written; train on a disk with room: (andrea train .*)$", line)
        assert needed, line
        size, free, command = float(needed[1]), float(needed[2]), shlex.split(needed[3])
        # 10.8M weights of 4 bytes, Muon's momentum as large and AdamW's 2 for the embedding
        assert 83 < size < 85 and free <= 12, line
        assert command[:4] == ["andrea", "train", "--config", "andrea-12m"], command
        room = tmp_path / "home" / "andrea-runs"
        assert f"train.runs_dir={room}" in command, command
        given = load_config("andrea-12m", [*sets, f"train.runs_dir={room}"])
        assert load_config("andrea-12m", command[5::2]) == given


def test_the_command_of_a_disk_too_small_trains_elsewhere(tmp_path, data_dir, monkeypatch,
                                                          capsys):
    """The tiny preset on a 160 KiB disk: the command it prints, pasted, trains the run."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with disk_of(tmp_path / "disk", 160, monkeypatch) as disk:
        code, _, err = run_main(capsys, "train", "-c", "andrea-tiny", "--no-progress",
                                "--set", f"data.dir={data_dir}", "--set", "train.name=t",
                                "--set", f"train.runs_dir={disk}", "--set", "train.max_steps=2")
        assert code == 2 and not (disk / "t").exists(), err
    command = shlex.split(err.split("train on a disk with room: ")[1])
    assert command[0] == "andrea", err
    code, out, err = run_main(capsys, *command[1:], "--no-progress")
    assert code == 0 and (tmp_path / "home" / "andrea-runs" / "t" / "step-000002").is_dir(), err


def test_the_commands_of_a_resume_without_room_move_the_run_and_continue_it(
        tmp_path, data_dir, monkeypatch, capsys):
    """A run whose disk filled up: its resume prints `mkdir -p DEST && mv RUN DEST/ && andrea
    train --resume DEST/NAME`, which, pasted, continues it. Before: `mv RUN DEST` with no DEST
    yet renamed the run folder to DEST, and the --resume that followed named nothing."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    probe = train(tiny_config(tmp_path / "probe", data_dir, "train.max_steps=2"),
                  progress=False).run_dir
    used = sum(f.stat().st_size for f in probe.rglob("*") if f.is_file())
    runs = tmp_path / "disk" / "runs"
    with disk_of(tmp_path / "disk", used // 1024 + 100, monkeypatch):
        train(tiny_config(runs, data_dir, "train.max_steps=2"), progress=False)
        code, _, err = run_main(capsys, "train", "--resume", str(runs / "t"),
                                "--set", "train.max_steps=4", "--no-progress")
        assert code == 2 and "continue there: " in err, err
        mkdir, mv, resume = err.split("continue there: ")[1].strip().split(" && ")
        for command in (mkdir, mv):
            done = subprocess.run(shlex.split(command), capture_output=True, text=True)
            assert done.returncode == 0, (command, done.stderr)
    code, out, err = run_main(capsys, *shlex.split(resume)[1:], "--no-progress")
    moved = tmp_path / "home" / "andrea-runs" / "t"
    assert code == 0 and (moved / "step-000004").is_dir() and not (runs / "t").exists(), err


def test_a_small_disk_warns_at_start_stops_before_writing_and_resumes_elsewhere(
    tmp_path, data_dir, uninterrupted, small_disk_dir, capsys
):
    """Step 2's checkpoint fits, then less than one checkpoint is free at step 4. The run
    folder moved to a disk with room resumes as if nothing had happened."""
    result = train(tiny_config(small_disk_dir / "runs", data_dir, *SETS), progress=False)
    out = capsys.readouterr().out
    warned = re.search(r"warning: .* free on its disk, but the checkpoints need about "
                       r"([\d.]+) MiB more \(3 at once, ([\d.]+) MiB each\)", out)
    assert warned, out
    more, each = (float(x) for x in warned.groups())
    run_dir = small_disk_dir / "runs" / "t"
    written = sum(f.stat().st_size for f in (run_dir / "step-000002").iterdir()) / 2**20
    assert abs(each - written) <= 0.05 * written + 0.05 and abs(more - 3 * each) <= 0.15, out
    assert (result.state, result.exit_code, result.steps) == ("stopped", 2, 4)
    assert result.message.startswith(
        f"disk full at step 4: {run_dir}/step-000004 was not written: a checkpoint needs about "
        f"{each} MiB, the disk has "), result.message
    assert f"latest is still {run_dir}/step-000002" in result.message
    moved = shutil.copytree(run_dir, tmp_path / "elsewhere" / "t")
    assert_stopped_at_4(moved)
    assert_resumes_as_uninterrupted(moved, data_dir, uninterrupted)


def test_fsdp_ranks_agree_on_a_failed_checkpoint_and_end_cleanly(tmp_path, data_dir):
    """Rank 0's write fails after every rank wrote its shards of step 4: no rank hangs, each
    ends with exit code 2, and the one line says so; the run folder is as at step 2."""
    cfg = tiny_config(tmp_path, data_dir, *SETS, "train.parallel=fsdp", "train.max_steps=4",
               "train.micro_batch_size=4", "train.global_batch_tokens=512")
    path = tmp_path / "t.yaml"
    path.write_text(cfg.to_yaml())
    proc = run_torchrun("train", "-c", str(path), "--no-progress", timeout=600,
                        env={"ANDREA_FAULTS": "disk-full@checkpoint:step-000004"})
    err = proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith("error: disk full at step 4: "), err[-3000:]
    assert "Traceback" not in err[:err.index("torch/distributed/elastic")], err[-3000:]
    assert_stopped_at_4(tmp_path / "t")


def room_session(tmp_path: Path, *sets: str, step: int = 0, nbytes: int = 1000):
    """What checkpoint_room reads of a Session: the config, the run folder, the step, the
    checkpoint's size, the processes; no model."""
    from types import SimpleNamespace

    from andrea.train.torchrun import DistInfo
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(cfg=load_config("andrea-tiny", list(sets)), run_dir=run_dir,
                           step=step, checkpoint_nbytes=nbytes, dist=DistInfo(), checkpoint=None)


def test_the_checkpoints_ahead_count_the_final_one_off_the_period():
    from andrea.train.checkpoint_room import checkpoints_ahead
    assert checkpoints_ahead(0, 6, 2) == 3  # 2, 4, 6
    assert checkpoints_ahead(0, 7, 2) == 4  # 2, 4, 6 and the final 7
    assert checkpoints_ahead(3, 7, 2) == 3  # 4, 6, 7
    assert checkpoints_ahead(0, 5, 0) == 1  # the final one only


def test_the_start_warning_counts_keep_last_and_the_one_being_written(tmp_path):
    """keep_last 2 of 5 checkpoints ahead: 3 on disk at once; exactly that much room is enough."""
    from andrea.train.checkpoint_room import peak_checkpoints, start_warning
    s = room_session(tmp_path, "train.max_steps=10", "train.checkpoint_every=2",
                     "train.keep_last=2")
    assert peak_checkpoints(s) == (0, 3)
    assert start_warning(s, 3000) is None
    line = start_warning(s, 2999)
    assert line and "(3 at once, " in line and "train.keep_last 2 and the one being written" in line


def test_an_overwrite_counts_the_files_it_replaces_as_room(tmp_path, monkeypatch):
    from andrea.errors import UserError
    from andrea.train import checkpoint_room
    monkeypatch.setattr(checkpoint_room, "free_bytes", lambda path: 600)
    s = room_session(tmp_path)
    (s.run_dir / "old.bin").write_bytes(bytes(500))
    checkpoint_room.check_room_at_start(s, replaced=True)  # 600 + 500 >= 1000
    with pytest.raises(UserError, match="needs about 1000 B, its disk has 600 B free"):
        checkpoint_room.check_room_at_start(s, replaced=False)


def test_the_folder_with_room_is_never_the_full_disks_own(tmp_path, monkeypatch):
    """A run already under ~/andrea-runs is sent to the temporary folder's, not back home."""
    import tempfile

    from andrea.train.checkpoint_room import folder_with_room
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert folder_with_room(1, tmp_path / "elsewhere" / "t") == tmp_path / "home" / "andrea-runs"
    assert (folder_with_room(1, tmp_path / "home" / "andrea-runs" / "t")
            == Path(tempfile.gettempdir()) / "andrea-runs")


def test_another_ranks_failed_write_says_to_free_space(tmp_path):
    """full None (only another rank's write failed, most likely on the same disk): the line
    says how to make room, as for a full disk, under the cautious head."""
    from andrea.train.checkpoint_room import full_message
    s = room_session(tmp_path, step=4)
    line = full_message(s, 10, "a write failed on another rank", full=None)
    assert line.startswith("checkpoint write failed at step 4: ") and "free space there" in line
    assert "fix that" not in full_message(s, 10, "EIO", full=True)
    assert "fix that" in full_message(s, 10, "EIO", full=False)


def test_the_command_on_another_disk_sets_only_what_differs_from_the_preset():
    from andrea.train.checkpoint_room import train_command
    cfg = load_config("andrea-tiny", ["train.max_steps=7"])
    assert train_command(cfg, {"train.runs_dir": "/big/runs"}) == [
        "andrea", "train", "--config", "andrea-tiny", "--set", "train.max_steps=7",
        "--set", "train.runs_dir=/big/runs"]
