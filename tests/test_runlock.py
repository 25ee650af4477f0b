"""One writer per run folder (andrea/train/runlock.py): a second `andrea train` on a run in use
(--resume of it, --overwrite of it, the same new name at the same moment, a second torchrun
job) is refused in seconds, in one line naming its holder; a holder killed with SIGKILL never
blocks; a holder on another host is named with the way to take the run over; the lock is
released when train() ends, so trainings one after another in one process each take the run.
Real processes where two at once or a kill is the point; the rest in this process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    andrea_main,
    assert_user_error,
    config_file,
    make_checkpoint,
    python_command,
    run_andrea,
    tiny_config,
    wait_until,
    without_notes,
)
from test_parallel import launch_nodes

from andrea import folder_lock
from andrea.cli import main
from andrea.errors import UserError
from andrea.folder_lock import pid_alive, process_start_time
from andrea.hf import export_hf
from andrea.train import runlock
from andrea.train.rundir import CONFIG, METRICS, RUN_LOCK, read_latest, step_dirs, step_of_dir
from andrea.train.runlock import Holder, RunLock, TrainingLocks, is_stale

HOST = socket.gethostname()


def start_training(cfg: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(python_command("-m", "andrea", "train", "-c", str(cfg),
                                           "--no-progress", *args),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM, as a scheduler stops a run: it checkpoints its last step and exits 143."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=120)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]


def test_a_second_training_on_a_live_run_is_refused_in_seconds_naming_its_holder(
        tmp_path, data_dir):
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=1000000",
                                  "train.checkpoint_every=5", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    first = start_training(cfg)
    try:
        wait_until((run_dir / "latest").exists, what="a checkpoint", proc=first)  # to resume from
        holder = json.loads((run_dir / RUN_LOCK).read_text())
        assert holder["host"] == HOST and pid_alive(holder["pid"])
        # Old code: the second one trains alongside (a million steps: the timeout ends it).
        for way in (["--resume", "auto"], ["--overwrite"], ["--resume", str(run_dir)]):
            began = time.monotonic()
            # --stop-after 1: old code trains a step alongside, then ends (and this fails)
            second = andrea_main("train", "-c", str(cfg), "--no-progress", "--stop-after", "1",
                                 *way)
            took = time.monotonic() - began
            assert_user_error(second, f"{run_dir}: another andrea train is writing this run "
                                      f"(pid {holder['pid']} on host {HOST}, since ",
                              f"stop it (kill {holder['pid']})", "--set train.name=")
            assert took < 30, took  # a bound for a loaded machine: start-up, then refused
            assert first.poll() is None  # the first trains on
    finally:
        out, err = stop(first)
    assert first.returncode == 143, err[-3000:]
    written = events(run_dir)
    assert [e["event"] for e in written].count("start") == 1  # nobody else wrote the run
    steps = [e["step"] for e in written if e["event"] == "train"]
    assert steps == list(range(1, len(steps) + 1)) and written[-1]["event"] == "end"
    assert not pid_alive(holder["pid"]) and not (run_dir / RUN_LOCK).exists()


def test_resuming_a_live_run_before_its_first_checkpoint_is_refused_as_in_use(
        tmp_path, data_dir):
    """`--resume RUN` while the run trains towards its first checkpoint: refused as a run in use,
    as --resume auto is. It said the run had "stopped before its first checkpoint" and to start
    it over with --config, which the lock then refused."""
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=1000000",
                                  name="r"), tmp_path)  # checkpoint_every 0: none until it ends
    run_dir = tmp_path / "runs" / "r"
    first = start_training(cfg)
    try:
        wait_until(lambda: (run_dir / METRICS).exists() and '"train"' in
                   (run_dir / METRICS).read_text(), what="a step", proc=first)
        for config in ([], ["-c", str(cfg)]):
            second = andrea_main("train", *config, "--resume", str(run_dir), "--no-progress",
                                 "--stop-after", "1")
            assert_user_error(second, f"{run_dir}: another andrea train is writing this run")
        assert first.poll() is None
    finally:
        out, err = stop(first)
    assert first.returncode == 143, err[-3000:]


def test_the_same_new_run_started_twice_at_once_trains_once(tmp_path, data_dir):
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=1000000",
                                  "train.checkpoint_every=0", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    both = [start_training(cfg), start_training(cfg)]
    try:
        # Old code: both train a million steps.
        wait_until(lambda: any(p.poll() is not None for p in both), what="one of them refused")
        refused = next(p for p in both if p.poll() is not None)
        trains = next(p for p in both if p is not refused)
        out, err = refused.communicate()
        assert_user_error(subprocess.CompletedProcess([], refused.returncode, out, err),
                          f"{run_dir}: another andrea train is ")
        wait_until((run_dir / METRICS).exists, what="its start", proc=trains)
        assert trains.poll() is None
    finally:
        said = [stop(proc) for proc in both]
    assert trains.returncode == 143, said
    assert [e["event"] for e in events(run_dir)].count("start") == 1, said


def assert_whole_history(run_dir: Path, config: str) -> None:
    """The run as its one training wrote it: its config, one start, every step from 1, an end,
    `latest` one of its checkpoints."""
    written = events(run_dir)
    assert [e["event"] for e in written].count("start") == 1 and written[-1]["event"] == "end"
    steps = [e["step"] for e in written if e["event"] == "train"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5
    assert (run_dir / CONFIG).read_text() == config
    latest = read_latest(run_dir)
    assert latest is not None and step_of_dir(latest) >= 5 and latest in step_dirs(run_dir)


def test_import_force_on_a_live_run_is_refused_and_the_run_keeps_its_history(tmp_path,
                                                                             data_dir):
    """The issue's case: `andrea import --force` deleted a live run's checkpoints, metrics,
    config and lock, and the training went on writing into the imported folder. It now takes
    the run's lock first, as a training does."""
    hf = export_hf(str(make_checkpoint(tmp_path / "src")), tmp_path / "hf")
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=1000000",
                                  "train.checkpoint_every=5", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    first = start_training(cfg)
    try:
        wait_until((run_dir / "latest").exists, what="a checkpoint", proc=first)
        config = (run_dir / CONFIG).read_text()
        holder = json.loads((run_dir / RUN_LOCK).read_text())
        refused = andrea_main("import", str(hf), "--out", str(run_dir), "--force")
        assert_user_error(refused, f"{run_dir}: another andrea train is writing this run (pid "
                                   f"{holder['pid']} on host {HOST}, since ",
                          f"stop it (kill {holder['pid']}), or import into another run with "
                          f"--out runs/NAME")
        assert first.poll() is None  # trains on, alone
    finally:
        out, err = stop(first)
    assert first.returncode == 143, err[-3000:]
    assert_whole_history(run_dir, config)
    assert not (run_dir / RUN_LOCK).exists()
    # Once the training has ended, the same command replaces the run.
    imported = andrea_main("import", str(hf), "--out", str(run_dir), "--force")
    assert imported.returncode == 0, imported.stderr
    assert [d.name for d in step_dirs(run_dir)] == ["step-000000"]


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_training_whose_lock_file_goes_stops_at_its_next_step_writing_nothing_more(
        tmp_path, data_dir, how):
    """Deleting a live training's lock file (what taking over a lost node's run does) let a
    second writer in while the first wrote on, its heartbeat into the deleted file. The first
    now sees at its next step that the file is not the one it holds, and stops in one line
    before it writes that step: no record, no end event, no checkpoint, `latest` untouched."""
    # 10,000 steps: minutes, more on a loaded machine, whose plan note (progress.PlanNote) is
    # left out of the stderr this test reads.
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=10000",
                                  "train.checkpoint_every=5", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    first = start_training(cfg)
    try:
        wait_until((run_dir / "latest").exists, what="a checkpoint", proc=first)
        lock = run_dir / RUN_LOCK
        if how == "removed":
            lock.unlink()
        else:  # another holder's record, put in place as its own file
            other = Holder(4242, "node-7", time.time(), time.time()).encode()
            (run_dir / "new.lock").write_bytes(other)
            os.replace(run_dir / "new.lock", lock)
        # Old code: trains on.
        wait_until(lambda: first.poll() is not None, what="the training to notice and stop")
    finally:
        out, err = stop(first)
    line = assert_user_error(subprocess.CompletedProcess([], first.returncode, out,
                                                         without_notes(err)),
                             f"{run_dir}: its lock file {lock} was removed or replaced while "
                             f"this training held it", "writing nothing more there",
                             f"andrea train --resume {run_dir}")
    stopped_at = int(line.split("stopped at step ")[1].split(",")[0])
    written = events(run_dir)
    assert "end" not in [e["event"] for e in written]
    assert max(e["step"] for e in written if e["event"] == "train") < stopped_at
    latest = read_latest(run_dir)
    assert latest is not None and step_of_dir(latest) < stopped_at
    assert step_of_dir(step_dirs(run_dir)[-1]) == step_of_dir(latest)
    assert not list(run_dir.glob("*.partial-*"))
    if how == "replaced":  # the new holder's file, left as it was
        assert lock.read_bytes() == other
        return
    assert not lock.exists()  # never written again (the heartbeat stops too)
    resumed = andrea_main("train", "-c", str(cfg), "--resume", "auto", "--stop-after", "1",
                          "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {latest}" in resumed.stdout


def test_a_lock_file_gone_while_a_checkpoint_is_written_publishes_nothing(
        tmp_path, data_dir, monkeypatch, capsys):
    """The lock file taken over while the training writes a checkpoint (minutes, for a large
    model), after the step's own check: the checkpoint is not published; `latest` stays on the
    one before, the half-written folder is removed, and the line says why."""
    from andrea import faults

    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=4",
                                  "train.checkpoint_every=2", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    written = []

    def model_file_written() -> None:
        written.append(True)
        if len(written) == 2:  # step 4's checkpoint, half written
            (run_dir / RUN_LOCK).unlink()

    monkeypatch.setattr(faults, "after_model_file", model_file_written)
    code, err = train_main(capsys, "-c", str(cfg))
    assert code == 2 and f"its lock file {run_dir / RUN_LOCK} was removed or replaced" in err, err
    assert "stopped at step 4, writing nothing more there" in err, err
    assert read_latest(run_dir) == run_dir / "step-000002"
    assert [d.name for d in step_dirs(run_dir)] == ["step-000002"]
    assert not list(run_dir.glob("*.partial-*"))


def test_prepare_force_on_a_folder_a_live_training_reads_is_refused_naming_it(tmp_path):
    """A training holds each data folder it reads (a shared lock on its prepare lock): a
    prepare that would rewrite the shards under it is refused, naming the training; once it
    has ended the same command runs."""
    text, data = tmp_path / "short.txt", tmp_path / "short-byte"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n"
                            for i in range(3000)))
    cfg = config_file(tiny_config(tmp_path / "runs", data, "train.max_steps=1000000",
                                  f"data.source={text}", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    first = start_training(cfg)  # prepares the folder, then reads it
    prepare = ("prepare", "-c", str(cfg), "--force")
    try:
        wait_until((run_dir / METRICS).exists, what="the set-up", proc=first)  # holds the folder
        shards = {p.name: p.read_bytes() for p in data.glob("*.bin")}
        refused = andrea_main(*prepare)
        assert_user_error(refused, f"{data}: andrea train of {run_dir} reads this data folder "
                                   f"(pid {first.pid} on host {HOST}, since ",
                          f"stop it (kill {first.pid}), or prepare into another folder")
        assert first.poll() is None
        assert {p.name: p.read_bytes() for p in data.glob("*.bin")} == shards
    finally:
        stop(first)
    assert first.returncode == 143
    assert andrea_main(*prepare).returncode == 0
    # In one process (andrea.cli.main twice), the hold ends with the training's TrainingLocks.
    with TrainingLocks() as locks:
        locks.read_data([data], run_dir)
        assert_user_error(andrea_main(*prepare), f"(pid {os.getpid()} on host {HOST}, since ")
    assert andrea_main(*prepare).returncode == 0


def test_a_holder_killed_with_sigkill_never_blocks(tmp_path, data_dir):
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=8",
                                  "train.checkpoint_every=2", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    killed = run_andrea("train", "-c", str(cfg), "--no-progress",
                        env={"ANDREA_FAULTS": "sigkill@5.0"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = json.loads((run_dir / RUN_LOCK).read_text())  # it died holding the run
    assert left["host"] == HOST and not pid_alive(left["pid"])
    began = time.monotonic()
    resumed = andrea_main("train", "--resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    assert time.monotonic() - began < 30
    assert "another andrea train" not in resumed.stdout + resumed.stderr
    assert (run_dir / "latest").read_text().strip() == "step-000008"
    assert not (run_dir / RUN_LOCK).exists()


def train_main(capsys, *argv: str) -> tuple[int, str]:
    """`andrea train ARGV` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main(["train", "--no-progress", *argv])
    return exited.value.code, capsys.readouterr().err


def test_a_run_held_on_another_host_is_named_and_can_be_taken_over(tmp_path, data_dir, capsys):
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                                  "train.checkpoint_every=2", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    assert train_main(capsys, "-c", str(cfg))[0] == 0
    lock = run_dir / RUN_LOCK
    # A node that trained the run on a shared filesystem was lost ten minutes ago.
    lock.write_bytes(Holder(4242, "lost-node", time.time() - 3600, time.time() - 600).encode())
    code, err = train_main(capsys, "-c", str(cfg), "--resume", "auto",
                           "--set", "train.max_steps=4")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {run_dir}: another andrea train is writing this run (pid 4242 "
                          f"on host lost-node, since "), err
    assert ", last alive 10 min ago by that host's clock)" in err, err
    # The way out the line names.
    assert err.rstrip().endswith(f"take the run over: rm {lock}, then run this again"), err
    lock.unlink()
    assert train_main(capsys, "-c", str(cfg), "--resume", "auto",
                      "--set", "train.max_steps=4")[0] == 0
    assert (run_dir / "latest").read_text().strip() == "step-000004" and not lock.exists()


def test_a_run_an_older_andrea_trains_without_a_lock_file_is_refused_naming_it(
        tmp_path, data_dir, capsys):
    """An andrea from before the run lock keeps no lock file: upgraded while such a training
    ran, a resume (or --overwrite) found the flock free and no record, and trained a second
    writer into the run. The run's metrics.jsonl names the writer: its last segment's start,
    with no end after it, of a process that still runs."""
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                                  "train.checkpoint_every=2", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    assert train_main(capsys, "-c", str(cfg))[0] == 0
    older = subprocess.Popen(["sleep", "300"])  # the older andrea's training, resumed at 2
    try:
        start = {"event": "start", "step": 2, "max_steps": 100, "pid": older.pid,
                 "host": HOST, "time": round(time.time(), 3)}
        with open(run_dir / METRICS, "a") as f:
            f.write(json.dumps(start) + "\n" + json.dumps({"event": "train", "step": 3}) + "\n")
        written = (run_dir / METRICS).read_bytes()
        for way in (["--resume", str(run_dir)], ["-c", str(cfg), "--overwrite"]):
            code, err = train_main(capsys, *way, "--set", "train.max_steps=4")
            assert code == 2 and err.count("\n") == 1, err
            assert err.startswith(f"error: {run_dir}: another andrea train is writing this run "
                                  f"(pid {older.pid} on host {HOST}, since "), err
            assert f"stop it (kill {older.pid})" in err, err
        assert (run_dir / METRICS).read_bytes() == written
        assert [d.name for d in step_dirs(run_dir)] == ["step-000002"]
    finally:
        older.kill()
        older.wait()
    # Once it is gone, its segment is a crashed one: the run resumes.
    assert train_main(capsys, "--resume", str(run_dir), "--set", "train.max_steps=4")[0] == 0
    assert (run_dir / "latest").read_text().strip() == "step-000004"


def test_a_dead_holders_pid_given_to_another_process_never_blocks(tmp_path, data_dir, capsys):
    """A training killed on this host (kill -9, the OOM killer) whose pid the system has given
    to a later process (containers hand out the same low pids again): the run resumes. Its
    lock record names a live pid, but the flock is free, and the kernel drops a flock only
    with its holder; an andrea from before the lock (no lock file) left an open segment in
    metrics.jsonl whose pid is alive, but that process started after the segment did."""
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                                  "train.checkpoint_every=2", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    assert train_main(capsys, "-c", str(cfg))[0] == 0
    later = subprocess.Popen(["sleep", "300"])  # the process the dead training's pid went to
    try:
        # An older andrea's segment, begun an hour ago and killed: no lock file, no end record.
        start = {"event": "start", "step": 2, "max_steps": 100, "pid": later.pid,
                 "host": HOST, "time": round(time.time() - 3600, 3)}
        with open(run_dir / METRICS, "a") as f:
            f.write(json.dumps(start) + "\n")
        assert not (run_dir / RUN_LOCK).exists() and pid_alive(later.pid)
        code, err = train_main(capsys, "--resume", str(run_dir), "--set", "train.max_steps=4")
        assert code == 0, err
        # A training of this andrea, killed an hour ago: its lock file names the pid.
        (run_dir / RUN_LOCK).write_bytes(
            Holder(later.pid, HOST, time.time() - 3600, time.time() - 3000).encode())
        code, err = train_main(capsys, "--resume", str(run_dir), "--set", "train.max_steps=6")
        assert code == 0, err
    finally:
        later.kill()
        later.wait()
    assert read_latest(run_dir) == run_dir / "step-000006"
    assert not (run_dir / RUN_LOCK).exists()


def test_a_training_that_ended_in_a_process_still_running_never_blocks(tmp_path, data_dir,
                                                                       capsys):
    """A run trained by train() in a process that lives on (a notebook's kernel): its segment
    ended (an end record), its lock released. Another process resumes the run: the live pid of
    the segment's start record is no writer once the segment has ended."""
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                                  "train.checkpoint_every=2", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    kernel = subprocess.Popen(["sleep", "300"])  # the notebook that trained the run
    try:
        time.sleep(0.1)
        assert train_main(capsys, "-c", str(cfg))[0] == 0
        lines = (run_dir / METRICS).read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["event"] for r in records][0] == "start" and records[-1]["event"] == "end"
        records[0]["pid"] = kernel.pid  # as if the kernel's train() had written the segment
        (run_dir / METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
        code, err = train_main(capsys, "--resume", str(run_dir), "--set", "train.max_steps=4")
        assert code == 0, err
    finally:
        kernel.kill()
        kernel.wait()
    assert read_latest(run_dir) == run_dir / "step-000004"


def test_trainings_one_after_another_in_one_process_each_take_the_run(tmp_path, data_dir,
                                                                      capsys):
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                                  "train.checkpoint_every=2", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    assert train_main(capsys, "-c", str(cfg))[0] == 0
    # Refused after it took the lock (a key that defines the run): released as it raises.
    code, err = train_main(capsys, "--resume", str(run_dir), "--set", "model.n_layer=3")
    assert code == 2 and "resuming cannot change model.n_layer" in err, err
    assert train_main(capsys, "--resume", str(run_dir), "--set", "train.max_steps=4")[0] == 0
    assert (run_dir / "latest").read_text().strip() == "step-000004"
    assert not (run_dir / RUN_LOCK).exists()


def test_a_run_refused_at_set_up_leaves_no_folder(tmp_path, data_dir, capsys):
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                                  "train.global_batch_tokens=100", name="r"), tmp_path)
    code, err = train_main(capsys, "-c", str(cfg))
    assert code == 2 and "global_batch_tokens" in err, err
    assert not (tmp_path / "runs").exists()  # the folders made to hold the lock are gone


def test_a_second_torchrun_job_is_refused_on_every_rank(tmp_path, data_dir):
    """Only rank 0 takes the lock; its refusal reaches the other rank, which never waits for
    it. Two torchrun "nodes" (one launcher each), so that each rank's own line shows: one
    launcher stops its workers as soon as one fails."""
    cfg = config_file(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                                  "train.checkpoint_every=2", name="r"), tmp_path)
    run_dir = tmp_path / "runs" / "r"
    held = RunLock(run_dir).acquire()  # this process trains the run, as far as they know
    try:
        nodes = launch_nodes(cfg, [tmp_path, tmp_path], timeout=120)
    finally:
        held.release()
    for code, _, err in nodes:
        ours = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code != 0 and len(ours) == 1, err[-3000:]
        assert (f"another andrea train is writing this run (pid {os.getpid()} on host {HOST}"
                in ours[0]), ours
    assert not (run_dir / "latest").exists()


# In this process: which recorded holder is stale, and the heartbeat.

def test_a_recorded_holder_is_stale_only_when_it_cannot_be_writing():
    now = time.time()
    me = Holder(os.getpid(), HOST, now, now, "job@10.0.0.1:29500", 1)
    here = Holder(_dead_pid(), HOST, now, now)
    assert is_stale(None, me, flocked=True)
    assert is_stale(here, me, flocked=True)  # the kernel dropped its flock: it died
    # Where flock does not work, the pid decides.
    assert is_stale(here, me, flocked=False)
    assert not is_stale(Holder(os.getppid(), HOST, now, now), me, flocked=False)
    # On another host: never, but for an earlier attempt of the same torchrun job.
    elsewhere = Holder(4242, "node-1", now, now, "job@10.0.0.1:29500", 0)
    assert is_stale(elsewhere, me, flocked=True)
    assert not is_stale(Holder(4242, "node-1", now, now, "job@10.0.0.1:29500", 1), me, True)
    assert not is_stale(Holder(4242, "node-1", now, now, "other@10.0.0.1:29500", 0), me, True)
    assert not is_stale(Holder(4242, "node-1", now, now), me, flocked=True)


def test_where_flock_does_not_work_a_live_holder_of_this_host_is_refused(tmp_path,
                                                                        monkeypatch):
    """A filesystem without flock (some network filesystems: ENOLCK): the record alone decides.
    A holder of this host whose process runs is refused, never taken over as if the kernel had
    dropped its flock; one whose process is gone is taken."""
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    live = subprocess.Popen(["sleep", "300"])  # a training of this host, writing the run
    try:
        now = time.time()
        (run_dir / RUN_LOCK).write_bytes(Holder(live.pid, HOST, now, now).encode())
        with pytest.raises(UserError, match=f"another andrea train is writing this run "
                                            f"\\(pid {live.pid} on host {HOST}, since "):
            RunLock(run_dir).acquire()
    finally:
        live.kill()
        live.wait()
    (run_dir / RUN_LOCK).write_bytes(Holder(_dead_pid(), HOST, now, now).encode())
    lock = RunLock(run_dir).acquire()
    try:
        assert Holder.decode((run_dir / RUN_LOCK).read_bytes()).pid == os.getpid()
    finally:
        lock.release()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_holder_says_it_is_alive_while_it_holds_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path / "runs" / "r").acquire()
    try:
        first = Holder.decode(lock.path.read_bytes())
        assert first is not None
        later = wait_until(lambda: (held := Holder.decode(lock.path.read_bytes())) is not None
                           and held.alive > first.alive and held, what="a newer heartbeat")
        assert (later.pid, later.host, later.since) == (os.getpid(), HOST, first.since)
        assert later.alive > first.alive
    finally:
        lock.release()
    assert not (tmp_path / "runs").exists()


def test_another_users_live_process_is_alive(monkeypatch):
    """kill(pid, 0) of another user's process fails with EPERM: it runs (a holder of a shared
    run folder under another account), so its lock is not stale."""
    def refused(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(folder_lock.os, "kill", refused)
    assert pid_alive(12345)


def test_a_process_start_time_is_when_it_started():
    before = time.time()
    child = subprocess.Popen(["sleep", "5"])
    try:
        started = process_start_time(child.pid)
        assert started is not None and before - 2 <= started <= time.time() + 2, started
    finally:
        child.kill()
        child.wait()


def test_a_holder_recorded_within_the_clocks_rounding_of_its_start_is_alive():
    """/proc gives the boot time in whole seconds: a process may seem to start up to a second
    after the time its lock record gives. That holder is alive; a process that started seconds
    after the record is another one, given the recorded pid again."""
    child = subprocess.Popen(["sleep", "5"])
    try:
        started = process_start_time(child.pid)
        assert started is not None
        assert pid_alive(child.pid, started_by=started - 1.5)
        assert not pid_alive(child.pid, started_by=started - 5)
    finally:
        child.kill()
        child.wait()
