"""The fault matrix (issue 33): each fault injected into a short real run, one row each.

    python scripts/faults.py [--work DIR] [--only NAME ...]

On one machine, CPU, a few minutes. Every run is the real `andrea` command in a subprocess (one
thread each) on the tiny preset: 12 steps of 1,024 tokens, a checkpoint every 4, fp32. Each row
injects one fault (ANDREA_FAULTS, a signal, a tmpfs too small for the writes where this process
may mount one, else a write failing with ENOSPC at the same call), recovers as a user would (the
same command, or `--resume`), and compares the outcome with an uninterrupted run: every step's
loss and grad norm and the final weights, exactly ("identical"), or the prepared shards byte for
byte. "lost" counts the steps completed but not in a checkpoint when the fault hit (for prepare:
complete shards lost). A row whose feature is not on this branch says "not available".
Prints the CPU's model name first; the table is Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from andrea import faults
from andrea.resources import cpu_name

STEPS, EVERY = 12, 4
SETS = ("train.max_steps=12", "train.checkpoint_every=4", "train.eval_every=0",
        "train.log_every=1", "train.global_batch_tokens=1024", "train.precision=fp32")
LINE = "Line {j} of {name}: the quick brown fox jumps over the lazy dog.\n"
PREPARE = ("prepare", "-c", "andrea-tiny", "--set", "data.source=in", "--set",
           "data.shard_tokens=20000")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Row:
    fault: str
    did: str
    lost: str
    after: str
    test: str  # the test that covers the row


class Bench:
    """The work folder: prepared data, the uninterrupted runs compared against, and helpers
    that run andrea there."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.data = work / "data"
        self.runs = work / "runs"
        self._refs: dict[str, Path] = {}

    def env(self, fault: str = "") -> dict[str, str]:
        return {**os.environ, **ENV, **({faults.VARIABLE: fault} if fault else {})}

    def train_args(self, name: str, *extra: str) -> list[str]:
        runs = self.runs.relative_to(self.work)  # relative: the messages stay short
        sets = [*SETS, "data.dir=data", f"train.runs_dir={runs}", f"train.name={name}"]
        return ["train", "-c", "andrea-tiny", *[a for s in sets for a in ("--set", s)],
                "--no-progress", "--overwrite", *extra]  # a new run, whatever --work holds

    def andrea(
        self, *args: str, fault: str = "", cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "andrea", *args], env=self.env(fault),
                              cwd=cwd or self.work, capture_output=True, text=True, timeout=600)

    def start(self, *args: str, fault: str = "", torchrun: int = 0,
              cwd: Path | None = None) -> subprocess.Popen:
        return subprocess.Popen(launcher(torchrun) + ["-m", "andrea", *args], env=self.env(fault),
                                cwd=cwd or self.work, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def torchrun(
        self, *args: str, fault: str = "", restarts: int = 0
    ) -> subprocess.CompletedProcess:
        cmd = launcher(2, restarts) + ["-m", "andrea", *args]
        return subprocess.run(cmd, env=self.env(fault), cwd=self.work, capture_output=True,
                              text=True, timeout=600)

    def reference(self, procs: int = 1) -> Path:
        """The uninterrupted run on `procs` processes (trained once)."""
        name = f"ref{procs}"
        if name not in self._refs and latest_step(self.runs / name) != STEPS:
            args = self.train_args(name)
            r = self.torchrun(*args) if procs > 1 else self.andrea(*args)
            check(r, f"the uninterrupted run on {procs} process(es)")
        self._refs[name] = self.runs / name
        return self._refs[name]


def launcher(procs: int, restarts: int = 0) -> list[str]:
    """python, or torchrun with `procs` processes on 127.0.0.1 (a static rendezvous)."""
    if not procs:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            f"--max-restarts={restarts}"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(r: subprocess.CompletedProcess, what: str) -> None:
    if r.returncode != 0:
        raise SystemExit(f"{what} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")


# ----------------------------------------------------------------------------- comparing


def steps_of(run: Path) -> dict[int, tuple[float, float]]:
    """Each step's (loss, grad norm), the last record of a step winning (a resume redoes it)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "train":
            out[r["step"]] = (r["loss"], r["grad_norm"])
    return out


def latest_step(run: Path) -> int:
    latest = run / "latest"
    return int(latest.read_text().strip().split("-")[-1]) if latest.exists() else 0


def same_run(run: Path, ref: Path) -> str:
    """'identical' when every step's loss and grad norm and the final weights equal the
    uninterrupted run's exactly; else what differs."""
    import torch

    from andrea.train.checkpoint import read_model_checkpoint
    from andrea.train.rundir import resolve_checkpoint

    got, want = steps_of(run), steps_of(ref)
    if sorted(got) != sorted(want):
        return f"differs: steps {sorted(got)} against {sorted(want)}"
    bad = [s for s in want if got[s] != want[s]]
    a = read_model_checkpoint(resolve_checkpoint(run))[0]
    b = read_model_checkpoint(resolve_checkpoint(ref))[0]
    tensors = [k for k in b if not torch.equal(a[k], b[k])]
    if bad or tensors:
        return f"differs: {len(bad)} steps, {len(tensors)} tensors"
    return "identical"


def same_shards(a: Path, b: Path) -> str:
    names = sorted(p.name for p in b.glob("*.bin"))
    if sorted(p.name for p in a.glob("*.bin")) != names:
        return "differs: other shard files"
    equal = filecmp.cmpfiles(a, b, names, shallow=False)[0]
    return "identical" if equal == names and (a / "manifest.json").exists() else "differs"


def said(stderr: str) -> str:
    """andrea's own last line (a traceback's last line for a crash), for the table."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    if any(ln.startswith("Traceback") for ln in lines):
        return f"traceback ({lines[-1][:60]})"
    return lines[-1] if lines else "nothing"


def wait_until(cond: Callable[[], bool], proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not cond():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"the run ended or hung before the fault: {proc.communicate()}")
        time.sleep(0.05)


def collect(stream) -> list[str]:
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(stream), daemon=True).start()
    return lines


# ----------------------------------------------------------------------------- training rows


def resumed(b: Bench, name: str, ref: Path, procs: int = 1) -> str:
    """Resume runs/NAME as a user would (`--resume`) and compare it with `ref`."""
    args = ["train", "--resume", str((b.runs / name).relative_to(b.work)), "--no-progress"]
    r = b.torchrun(*args) if procs > 1 else b.andrea(*args)
    if r.returncode != 0:
        return f"resume failed: {said(r.stderr)}"
    partial = list((b.runs / name).glob("*.partial-*"))
    return same_run(b.runs / name, ref) + (f" ({len(partial)} partial left)" if partial else "")


def signal_row(b: Bench, name: str, fault: str, label: str, test: str) -> Row:
    """A signal (or SIGKILL) from ANDREA_FAULTS in step 6.s first micro-batch."""
    ref = b.reference()
    r = b.andrea(*b.train_args(name), fault=fault)
    done, kept = max(steps_of(b.runs / name)), latest_step(b.runs / name)
    did = f"exit {r.returncode}; {said(r.stderr)}" if r.returncode > 0 else \
        f"killed ({r.returncode}); latest stayed step {kept}"
    return Row(label, did, str(done - kept), resumed(b, name, ref), test)


def kill_mid_checkpoint(b: Bench) -> Row:
    # test_train.py::test_kill_9_while_writing_a_checkpoint_leaves_latest_loadable
    ref, name = b.reference(), "kill9ckpt"
    proc = b.start(*b.train_args(name), fault="checkpoint-delay@2")
    run = b.runs / name
    wait_until(lambda: any(run.glob("step-000008.partial-*/model.safetensors")), proc)
    proc.kill()
    proc.communicate()
    done, kept = max(steps_of(run)), latest_step(run)
    did = f"killed mid-write of step 8; latest stayed step {kept}; the resume swept the partial"
    return Row("kill -9 mid-checkpoint", did, str(done - kept), resumed(b, name, ref),
               "test_train.py::test_kill_9_while_writing_a_checkpoint_leaves_latest_loadable")


def double_signal(b: Bench) -> Row:
    # test_train.py::test_second_signal_exits_at_once_leaving_the_last_checkpoint
    ref, name = b.reference(), "double"
    proc = b.start(*b.train_args(name), fault="sigint@5.0,checkpoint-delay@3")
    err, run = collect(proc.stderr), b.runs / name
    wait_until(lambda: any(run.glob("step-000005.partial-*/model.safetensors")), proc)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    time.sleep(0.2)  # the reader thread's last lines
    done, kept = max(steps_of(run)), latest_step(run)
    did = f"exit {proc.returncode}; {said(''.join(err))}"
    return Row("double Ctrl-C (2nd during its checkpoint)", did, str(done - kept),
               resumed(b, name, ref),
               "test_train.py::test_second_signal_exits_at_once_leaving_the_last_checkpoint")


def launcher_sigterm(b: Bench) -> Row:
    # No test: it needs a torchrun launch of its own (the workers' SIGTERM path is
    # test_train.py::test_signal_checkpoints_and_exits, their resume on two processes
    # test_parallel.py's).
    ref, name = b.reference(2), "launcher"
    proc = b.start(*b.train_args(name), torchrun=2)
    err, run = collect(proc.stderr), b.runs / name
    wait_until(lambda: (run / "metrics.jsonl").exists() and max(steps_of(run), default=0) >= 5,
               proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    time.sleep(0.2)
    done, kept = max(steps_of(run)), latest_step(run)
    ours = [ln for ln in err if "SIGTERM" in ln and "torch" not in ln]
    did = f"exit {proc.returncode}; {ours[-1].strip() if ours else said(''.join(err))}"
    return Row("torchrun launcher SIGTERMed (2 processes)", did, str(done - kept),
               resumed(b, name, ref, procs=2), "none (a torchrun test is not cheap)")


def torchrun_restart(b: Bench) -> Row:
    # test_restarts.py::test_a_restarted_worker_continues_the_run_by_itself
    label = "torchrun worker killed, --max-restarts 1"
    if "kill-after" not in faults.KINDS:
        return Row(label, "not available: needs the torchrun restarts of issue 33", "-", "-",
                   "-")
    ref, name = b.reference(2), "restart"
    r = b.torchrun(*b.train_args(name), fault="kill-after@1:step-000008", restarts=1)
    run = b.runs / name
    restarted = [ln for ln in r.stdout.splitlines() + r.stderr.splitlines()
                 if "torchrun restart" in ln]
    did = f"exit {r.returncode}; " + (restarted[0].strip() if restarted else said(r.stderr))
    lost = str(8 - latest_step_before_restart(run))
    after = same_run(run, ref) if r.returncode == 0 else "did not finish"
    return Row(label, did, lost, after,
               "test_restarts.py::test_a_restarted_worker_continues_the_run_by_itself")


def latest_step_before_restart(run: Path) -> int:
    """The step a restarted run resumed from: its second start event's."""
    starts = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()
              if '"start"' in ln]
    return int(starts[-1]["step"]) if len(starts) > 1 else 0


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[bool]:
    """A tmpfs of `size` at `folder` (True) where this process may mount one, else nothing
    (False: the row injects ENOSPC instead). Unmounted at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(folder)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def grow(folder: Path, mounted: bool) -> None:
    if mounted:
        subprocess.run(["mount", "-o", "remount,size=64m", str(folder)], check=True)


def checkpoint_disk_full(b: Bench) -> Row:
    # test_diskspace.py::test_a_failed_checkpoint_write_stops_cleanly
    label = "full disk during a checkpoint"
    ref, name = b.reference(), "diskfull"
    size = sum(p.stat().st_size for p in (ref / "step-000004").rglob("*") if p.is_file())
    small = Bench(b.work)
    small.runs = b.work / "small-runs"
    with small_disk(small.runs, f"{(2 * size + size // 2) // 1024 + 64}k") as mounted:
        fault = "" if mounted else "disk-full@checkpoint:step-000012"
        r = small.andrea(*small.train_args(name), fault=fault)
        run = small.runs / name
        if r.returncode == 0:
            return Row(label, "not available: the checkpoint write takes no disk-full fault "
                       "here", "-", "-", "-")
        done, kept = max(steps_of(run)), latest_step(run)
        partial = len(list(run.glob("*.partial-*")))
        did = f"exit {r.returncode}; {said(r.stderr)}; {partial} partial folder(s) left"
        grow(small.runs, mounted)
        after = resumed(small, name, ref)
    how = "tmpfs" if mounted else "ENOSPC injected"
    return Row(f"{label} ({how})", did, str(done - kept), after,
               "test_diskspace.py::test_a_failed_checkpoint_write_stops_cleanly")


def disk_below_one_checkpoint(b: Bench) -> Row:
    """A tmpfs half a checkpoint in size: the run stops before step 1, and the command its line
    gives (another train.runs_dir, found under $HOME) trains the run there."""
    label = "a disk smaller than one checkpoint (tmpfs)"
    test = "test_diskspace.py::test_a_disk_smaller_than_one_checkpoint_stops_before_step_1"
    ref, name = b.reference(), "onedisk"
    size = sum(p.stat().st_size for p in (ref / "step-000004").rglob("*") if p.is_file())
    small = Bench(b.work)
    small.runs = b.work / "tiny-runs"
    home = b.work / "home"  # where the line finds room: not the user's own home
    shutil.rmtree(home, ignore_errors=True)
    env = {**b.env(), "HOME": str(home)}
    with small_disk(small.runs, f"{size // 2048}k") as mounted:
        if not mounted:
            return Row(label, "not available: no tmpfs here (root mounts one)", "-", "-", test)
        r = subprocess.run([sys.executable, "-m", "andrea", *small.train_args(name)], env=env,
                           cwd=b.work, capture_output=True, text=True, timeout=600)
        trained = (small.runs / name / "metrics.jsonl").exists()
    did = f"exit {r.returncode}; {said(r.stderr)}" + ("; it trained" if trained else "")
    if "train on a disk with room: " not in r.stderr:
        return Row(label, did, "-", "no command to paste", test)
    pasted = shlex.split(r.stderr.split("train on a disk with room: ")[1].splitlines()[0])
    rerun = subprocess.run([sys.executable, "-m", "andrea", *pasted[1:], "--no-progress"],
                           env=env, cwd=b.work, capture_output=True, text=True, timeout=600)
    after = (same_run(home / "andrea-runs" / name, ref) if rerun.returncode == 0
             else f"its command failed: {said(rerun.stderr)}")
    return Row(label, did, "0", f"{after} (its command pasted)", test)


# ----------------------------------------------------------------------------- prepare rows


def corpus(work: Path) -> Path:
    """About 100 KB of text in two files: 5 train shards and 2 val ones of 20,000 byte tokens."""
    for name in ("a.txt", "sub/b.txt"):
        path = work / "in" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(LINE.format(j=j, name=name) for j in range(800)))
    return work


def clean_prepare(b: Bench) -> Path:
    out = b.work / "prep-clean"
    if not (out / "manifest.json").exists():
        check(b.andrea(*PREPARE, "-o", out.name), "the uninterrupted prepare")
    return out


def paused_prepare(b: Bench, out: Path, sig: int, *extra: str) -> tuple[int, str]:
    """A prepare into `out` paused in its third train shard, then sent `sig`."""
    proc = b.start(*PREPARE, "-o", out.name, *extra, fault="prepare-pause@train_000002.bin")
    for line in proc.stderr:
        if "paused in" in line:
            break
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def prepare_stopped(b: Bench, sig: int, label: str, test: str, *extra: str) -> Row:
    clean, out = clean_prepare(b), b.work / f"prep-{signal.Signals(sig).name}"
    shutil.rmtree(out, ignore_errors=True)
    code, err = paused_prepare(b, out, sig, *extra)
    kept = len(list(out.glob("*.bin")))
    did = (f"killed ({code})" if code < 0 else f"exit {code}; {said(err)}") + \
        f"; {kept} complete shards kept"
    r = b.andrea(*PREPARE, "-o", out.name)
    after = same_shards(out, clean) if r.returncode == 0 else f"rerun failed: {said(r.stderr)}"
    return Row(label, did, "0 shards", after, test)


def prepare_disk_full(b: Bench) -> Row:
    # test_prepare_stops.py::test_full_disk_keeps_every_complete_shard_and_the_rerun_finishes
    clean, small = clean_prepare(b), b.work / "prep-small"
    with small_disk(small, "160k") as mounted:
        fault = "" if mounted else "disk-full@prepare:train_000003.bin"
        shutil.rmtree(small / "prep", ignore_errors=True)
        r = b.andrea(*PREPARE, "-o", "prep-small/prep", fault=fault)
        kept = len(list((small / "prep").glob("*.bin")))
        did = f"exit {r.returncode}; {said(r.stderr)}"
        grow(small, mounted)
        again = b.andrea(*PREPARE, "-o", "prep-small/prep")
        after = same_shards(small / "prep", clean) if again.returncode == 0 else \
            f"rerun failed: {said(again.stderr)}"
    how = "tmpfs" if mounted else "ENOSPC injected"
    return Row(f"full disk during prepare ({how})", did, f"0 shards ({kept} kept)", after,
               "test_prepare_stops.py::test_full_disk_keeps_every_complete_shard_and_the_rerun_"
               "finishes")


# ----------------------------------------------------------------------------- run folders


def run_folder_moved(b: Bench) -> Row:
    """A run stopped at step 8, copied (`cp -r`) to another folder, the original deleted, and
    resumed from a third directory that holds no data: its data is prepared there again, with
    the run's own tokenizer, in one line."""
    ref, name = b.reference(), "moved"
    r = b.andrea(*b.train_args(name), "--stop-after", "8")
    check(r, "the run to move")
    moved, third = b.work / "elsewhere" / name, b.work / "third"
    shutil.rmtree(moved.parent, ignore_errors=True)
    shutil.rmtree(third, ignore_errors=True)
    third.mkdir()
    shutil.copytree(b.runs / name, moved)
    shutil.rmtree(b.runs / name)
    r = b.andrea("train", "--resume", str(moved), "--no-progress", cwd=third)
    prepared = [ln for ln in r.stdout.splitlines() if ln.startswith("preparing ")]
    did = f"exit {r.returncode}; " + (prepared[0] if prepared else said(r.stderr))
    after = same_run(moved, ref) if r.returncode == 0 else "did not finish"
    return Row("run folder moved (`cp -r`), resumed from a third folder without its data", did,
               "0", after,
               "test_portable.py::test_a_resume_without_the_data_or_its_text_says_how_to_prepare_it")


def checkpoint_damaged_in_transit(b: Bench) -> Row:
    """One byte flipped in the tensor data of a copied checkpoint's model.safetensors (its
    header stays valid): generate refuses it."""
    ref = b.reference()
    copy = b.work / "transit" / "ref1"
    shutil.rmtree(copy.parent, ignore_errors=True)
    shutil.copytree(ref, copy)
    model = copy / f"step-{STEPS:06d}" / "model.safetensors"
    blob = bytearray(model.read_bytes())
    blob[len(blob) - 1000] ^= 0x40
    model.write_bytes(bytes(blob))
    r = b.andrea("generate", "--checkpoint", str(copy), "-n", "8", "--seed", "1")
    after = "refused, nothing generated" if r.returncode == 2 and not r.stdout else \
        f"used: exit {r.returncode}, {len(r.stdout)} characters generated"
    return Row("a checkpoint damaged in transit (1 byte of model.safetensors)",
               f"exit {r.returncode}; {said(r.stderr)}", "-", after,
               "test_portable.py::test_a_checkpoint_damaged_on_its_way_is_named_and_never_used")
def two_writers(b: Bench) -> Row:
    """`--resume auto` on a run another `andrea train` is writing (held mid-run by a slow
    checkpoint write): refused; the first run goes on as if alone."""
    ref, name = b.reference(), "writers"
    proc, run = held_run(b, name)
    second = [a for a in b.train_args(name) if a != "--overwrite"] + ["--resume", "auto"]
    began = time.time()
    r = b.andrea(*second)
    did = f"exit {r.returncode} in {time.time() - began:.1f} s; {said(r.stderr)}"
    proc.wait(timeout=300)
    after = same_run(run, ref) if proc.returncode == 0 else f"the first run: exit {proc.returncode}"
    return Row("a second train --resume auto on a live run", did, "0", after,
               "test_runlock.py::test_a_second_training_on_a_live_run_is_refused_in_seconds_"
               "naming_its_holder")


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes, by its path inside it."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file()}


def held_run(b: Bench, name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """A training of runs/NAME held mid-run by slow checkpoint writes (8 s each), once its
    first checkpoint (step 4) is in place."""
    proc = b.start(*b.train_args(name, *extra), fault="checkpoint-delay@8")
    collect(proc.stdout), collect(proc.stderr)  # drained, so that it never blocks on a pipe
    run = b.runs / name
    wait_until(lambda: (run / "latest").exists(), proc)
    return proc, run


def import_force_live(b: Bench) -> Row:
    """`andrea import --force` of an export over a run another `andrea train` is writing:
    refused; the training goes on as if alone."""
    ref = b.reference()
    hf = b.work / "hf-ref1"
    check(b.andrea("export", "--checkpoint", str(ref.relative_to(b.work)), "--out", hf.name,
                   "--force"), "the export to import")
    proc, run = held_run(b, "importlive")
    began = time.time()
    r = b.andrea("import", hf.name, "--out", str(run.relative_to(b.work)), "--force")
    did = f"exit {r.returncode} in {time.time() - began:.1f} s; {said(r.stderr)}"
    proc.wait(timeout=300)
    after = same_run(run, ref) if proc.returncode == 0 else f"the run: exit {proc.returncode}"
    return Row("`andrea import --force` over a live run", did, "0", after,
               "test_runlock.py::test_import_force_on_a_live_run_is_refused_and_the_run_keeps_"
               "its_history")


def lock_removed(b: Bench) -> Row:
    """A live training's lock file deleted while it writes step 8's checkpoint: it stops
    before `latest` moves, in one line; `--resume` continues from step 4."""
    ref, name = b.reference(), "lockgone"
    proc = b.start(*b.train_args(name), fault="checkpoint-delay@3")
    err, run = collect(proc.stderr), b.runs / name
    wait_until(lambda: any(run.glob("step-000008.partial-*/model.safetensors")), proc)
    (run / ".andrea-train.lock").unlink()
    proc.wait(timeout=120)
    time.sleep(0.2)  # the reader thread's last lines
    done, kept = max(steps_of(run)), latest_step(run)
    did = f"exit {proc.returncode}; {said(''.join(err))}"
    return Row("a live training's lock file deleted (during step 8's checkpoint)", did,
               str(done - kept), resumed(b, name, ref),
               "test_runlock.py::test_a_training_whose_lock_file_goes_stops_at_its_next_step_"
               "writing_nothing_more")


def prepare_force_live(b: Bench) -> Row:
    """`andrea prepare --force` of the data folder a live training reads: refused; the shards
    and the training untouched."""
    ref, data = b.reference(), b.work / "data-read"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(b.data, data)
    proc, run = held_run(b, "prepread", "--set", f"data.dir={data.name}")
    began = time.time()
    r = b.andrea("prepare", "-c", "andrea-tiny", "-o", data.name, "--force")
    did = f"exit {r.returncode} in {time.time() - began:.1f} s; {said(r.stderr)}"
    proc.wait(timeout=300)
    after = (f"shards {same_shards(data, b.data)}; the run "
             + (same_run(run, ref) if proc.returncode == 0 else f"exit {proc.returncode}"))
    return Row("`andrea prepare --force` of a folder a live training reads", did, "0", after,
               "test_runlock.py::test_prepare_force_on_a_folder_a_live_training_reads_is_"
               "refused_naming_it")


def overwrite_refused(b: Bench) -> Row:
    """The issue's case: `--overwrite --set model.block_size=9000` of a finished run on a
    folder of 46,035 train tokens: refused at set-up, the old run as it was."""
    name = "overwrite"
    sets = ("--set", "data.source=in/a.txt", "--set", "data.dir=data-short")
    check(b.andrea(*b.train_args(name, *sets, "--stop-after", str(EVERY))), "the old run")
    before = files_of(b.runs / name)
    r = b.andrea(*b.train_args(name, *sets, "--set", "model.block_size=9000", "--set",
                               "train.global_batch_tokens=0"))
    after = files_of(b.runs / name) if (b.runs / name).exists() else {}
    kept = ("the old run intact, every file" if after == before else
            f"the old run lost: {len(before)} files before, {len(after)} after")
    return Row("`--overwrite` of a run with `model.block_size=9000` on 46,035 tokens",
               f"exit {r.returncode}; {said(r.stderr)}", "0", kept,
               "test_train.py::test_an_overwrite_refused_by_the_data_size_keeps_the_old_run")


def lr_inf(b: Bench) -> Row:
    """`--set train.lr=inf`: refused at load; nothing runs or is written."""
    name = "lrinf"
    r = b.andrea(*b.train_args(name, "--set", "train.lr=inf"))
    wrote = (b.runs / name).exists()
    return Row("`--set train.lr=inf`", f"exit {r.returncode}; {said(r.stderr)}", "0",
               "the run folder written" if wrote else "nothing written",
               "test_config.py::test_every_float_key_refuses_a_number_that_is_not_finite")


# ----------------------------------------------------------------------------- the matrix

# ----------------------------------------------------------------------------- data rows


def flip_in_range(data: Path) -> None:
    """One id of the train shard changed to another valid one (the byte tokenizer's 0)."""
    with open(data / "train_000000.bin", "r+b") as f:
        f.seek(256 + 2 * 123_457)
        f.write(b"\0\0")


def flip_out_of_range(data: Path) -> None:
    """Bytes of the train shard overwritten mid-file: ids 0x4141 = 16705 >= 257."""
    with open(data / "train_000000.bin", "r+b") as f:
        f.seek(256 + 2 * 100_000)
        f.write(b"A" * 4096)


def data_damage_row(
    b: Bench, name: str, label: str, damage: Callable[[Path], None], test: str,
    stops: bool = True,
) -> Row:
    """A run with a data folder of its own stops after step 4 (--stop-after 4, a checkpoint
    there); `damage` hits the folder; the resume either stops with one line (`stops`: then the
    user deletes the damaged train shard, as the line says) or prepares the folder again, saying
    why; the run resumed is compared with the uninterrupted one."""
    ref = b.reference()
    data = b.work / f"data-{name}"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(b.data, data)
    check(b.andrea(*b.train_args(name, "--stop-after", str(EVERY), "--set",
                                 f"data.dir={data.name}")), f"{name}: the run to step 4")
    damage(data)
    args = ["train", "--resume", str((b.runs / name).relative_to(b.work)), "--no-progress"]
    r = b.andrea(*args)
    done, kept = max(steps_of(b.runs / name)), latest_step(b.runs / name)
    if stops:
        did = f"exit {r.returncode}; {said(r.stderr)}"
        (data / "train_000000.bin").unlink()
        return Row(label, did, str(done - kept), resumed(b, name, ref), test)
    said_out = next((ln for ln in r.stdout.splitlines() if "preparing" in ln), "nothing said")
    did = f"exit {r.returncode}; {said_out}"
    after = same_run(b.runs / name, ref) if r.returncode == 0 else f"failed: {said(r.stderr)}"
    return Row(label, did, "0", after, test)


def break_manifest(data: Path) -> None:
    (data / "manifest.json").write_bytes(b"\x00garbage")


# ----------------------------------------------------------------------------- issue 51 rows


def cut_short(shard: Path) -> None:
    """The issue's cut: the shard's last 8,192 bytes gone, as a copy that stopped short."""
    os.truncate(shard, shard.stat().st_size - 8192)


def rewrite_in_place(shard: Path) -> None:
    """Other text at the same size: 4,096 bytes of the shard's tokens rewritten in place (ids
    still in range), the file's size and inode unchanged."""
    with open(shard, "r+b") as f:
        f.seek(256 + 2 * 200_000)
        f.write(b"a\0" * 2048)


def pasted(b: Bench, line: str, cwd: Path | None = None) -> str:
    """Run each `command` of an andrea line as the user would paste it (`rm`, `andrea ...`)
    in `cwd` (the work folder); what failed, or "" when all ran."""
    cwd = cwd or b.work
    for command in re.findall(r"`([^`]+)`", line):
        argv = shlex.split(command)
        if argv[0] == "rm":
            for path in argv[1:]:
                (cwd / path).unlink()
        elif argv[0] == "andrea":
            r = b.andrea(*argv[1:], cwd=cwd)
            if r.returncode != 0:
                return f"`{command}` failed: {said(r.stderr)}"
    return ""


def changed_under_run(b: Bench, name: str, label: str, change: Callable[[Path], None],
                      test: str) -> Row:
    """A train shard of the run's own data folder changed once step 5 is logged (the run held
    at step 8's checkpoint, so it is still training); the user then follows the lines: resume
    as the stop says, and where a resume names a damaged shard, run what it says and resume
    again. The run is compared with the uninterrupted one."""
    ref = b.reference()
    data = b.work / f"data-{name}"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(b.data, data)
    proc = b.start(*b.train_args(name, "--set", f"data.dir={data.name}"),
                   fault="checkpoint-delay@2")
    err, run = collect(proc.stderr), b.runs / name
    collect(proc.stdout)
    wait_until(lambda: (run / "metrics.jsonl").exists() and max(steps_of(run), default=0) >= 5,
               proc)
    change(data / "train_000000.bin")
    proc.wait(timeout=300)
    time.sleep(0.2)  # the reader thread's last lines
    done, kept = max(steps_of(run)), latest_step(run)
    did = f"exit {proc.returncode}; {said(''.join(err))}"
    args = ["train", "--resume", str(run.relative_to(b.work)), "--no-progress"]
    for _ in range(2):  # the resume, and once more after a damaged shard's commands
        r = b.andrea(*args)
        if r.returncode == 0:
            return Row(label, did, str(done - kept), same_run(run, ref), test)
        failed = pasted(b, said(r.stderr))
        if failed:
            break
    return Row(label, did, str(done - kept), f"resume failed: {failed or said(r.stderr)}", test)


def eval_val_cut_short(b: Bench, given: bool) -> Row:
    """`andrea eval` of a run on its val split cut short: the run's own folder (under ./data,
    where train prepares it: here a run trained 2 steps in a folder of its own) is prepared
    again by eval itself; a folder given with --data is named with the command that prepares it
    again, which is pasted. The val figure is compared with eval's on the intact folder."""
    home = b.work / "evalhome"
    own = home / "data" / "shakespeare-byte"
    if not (home / "runs" / "evalrun" / "latest").exists():
        shutil.rmtree(home, ignore_errors=True)
        shutil.copytree(b.data, own)  # what the tiny preset's run prepares: up to date
        sets = [*SETS[2:], "train.max_steps=2", "train.name=evalrun"]
        check(b.andrea("train", "-c", "andrea-tiny", *[a for s in sets for a in ("--set", s)],
                       "--no-progress", cwd=home), "the run to evaluate")
    data = home / "given" if given else own
    if given:
        shutil.rmtree(data, ignore_errors=True)
        shutil.copytree(b.data, data)
    args = ["eval", "--checkpoint", "runs/evalrun", "--max-tokens", "4096", "--no-progress",
            "--precision", "fp32", "--json"] + (["--data", "given"] if given else [])
    before = b.andrea(*args, cwd=home)
    check(before, "eval on the intact folder")
    cut_short(data / "val_000000.bin")
    r = b.andrea(*args, cwd=home)
    line, failed = said(r.stderr), ""
    if given:
        did = f"exit {r.returncode}; {line}"
        failed = pasted(b, line, home) if r.returncode == 2 else "no command"
        r = r if failed else b.andrea(*args, cwd=home)
    else:
        did = f"exit {r.returncode}; " + next(
            (ln for ln in r.stderr.splitlines() if "preparing" in ln), line)
    loss = json.loads(before.stdout)[0]["loss"]
    if failed or r.returncode != 0:
        after = f"failed: {failed or said(r.stderr)}"
    else:
        again = json.loads(r.stdout)[0]["loss"]
        after = "identical val loss" if again == loss else f"val loss {again} against {loss}"
    if given:
        return Row("`andrea eval --data DIR` on a val shard cut short, its command pasted", did,
                   "-", after, "test_printed_commands.py::test_eval_on_a_damaged_data_folder_"
                   "names_a_command_that_prepares_it")
    return Row("`andrea eval` on the run's val shard cut short", did, "-", after,
               "test_printed_commands.py::test_eval_prepares_the_runs_damaged_val_split_again_"
               "as_train_does")


ROWS: dict[str, Callable[[Bench], Row]] = {
    # tests/test_fault_matrix.py::test_kill_9_mid_step_then_resume_equals_the_uninterrupted_run
    "kill9": lambda b: signal_row(
        b, "kill9", "sigkill@5.0", "kill -9 mid-step (step 6)",
        "test_fault_matrix.py::test_kill_9_mid_step_then_resume_equals_the_uninterrupted_run"),
    "kill9ckpt": kill_mid_checkpoint,
    # test_train.py::test_interrupt_mid_accumulation_resumes_bit_for_bit
    "sigint": lambda b: signal_row(
        b, "sigint", "sigint@5.0", "Ctrl-C mid-step (step 6)",
        "test_train.py::test_interrupt_mid_accumulation_resumes_bit_for_bit"),
    # test_train.py::test_signal_checkpoints_and_exits[SIGTERM]
    "sigterm": lambda b: signal_row(
        b, "sigterm", "sigterm@5.0", "SIGTERM mid-step (step 6)",
        "test_train.py::test_signal_checkpoints_and_exits"),
    "double": double_signal,
    "restart": torchrun_restart,
    "launcher": launcher_sigterm,
    "ckptdisk": checkpoint_disk_full,
    "prepdisk": prepare_disk_full,
    # test_formats.py::test_killed_prepare_resumes_from_its_last_complete_shard
    "prepkill": lambda b: prepare_stopped(
        b, signal.SIGKILL, "prepare killed (-9) mid-shard, run again",
        "test_formats.py::test_killed_prepare_resumes_from_its_last_complete_shard"),
    # test_prepare_stops.py::test_sigterm_is_the_clean_stop_of_ctrl_c
    "prepterm": lambda b: prepare_stopped(
        b, signal.SIGTERM, "prepare SIGTERMed (2 workers), run again",
        "test_prepare_stops.py::test_sigterm_is_the_clean_stop_of_ctrl_c", "--workers", "2"),
    "onedisk": disk_below_one_checkpoint,
    "shardflip": lambda b: data_damage_row(
        b, "shardflip", "a train shard's id changed in range, then resume", flip_in_range,
        "test_shard_damage.py::test_in_range_damage_stops_the_run_keeping_its_checkpoints"),
    "shardrange": lambda b: data_damage_row(
        b, "shardrange", "a train shard overwritten out of range, then resume", flip_out_of_range,
        "test_shard_damage.py::test_out_of_range_id_is_one_line_naming_shard_and_position"),
    "shardgone": lambda b: data_damage_row(
        b, "shardgone", "a val shard deleted, then resume",
        lambda data: (data / "val_000000.bin").unlink(),
        "test_shard_damage.py::test_a_damaged_folder_is_named_and_prepared_again", stops=False),
    "manifest": lambda b: data_damage_row(
        b, "manifest", "garbage manifest.json, then resume", break_manifest,
        "test_shard_damage.py::test_a_damaged_folder_is_named_and_prepared_again", stops=False),
    "moved": run_folder_moved,
    "transit": checkpoint_damaged_in_transit,
    "writers": two_writers,
    "importlive": import_force_live,
    "lockgone": lock_removed,
    "prepread": prepare_force_live,
    "overwrite": overwrite_refused,
    "lrinf": lr_inf,
    "shardcut": lambda b: changed_under_run(
        b, "shardcut", "a train shard cut short (8,192 bytes) while the training reads it",
        cut_short, "test_shard_damage.py::test_a_shard_cut_short_under_a_running_training_is_one_"
        "line_with_a_checkpoint"),
    "shardrewrite": lambda b: changed_under_run(
        b, "shardrewrite", "a train shard rewritten in place (same size) while the training "
        "reads it", rewrite_in_place,
        "test_shard_damage.py::test_a_stop_for_a_changed_shard_resumes_as_the_uninterrupted_run"),
    "evalcut": lambda b: eval_val_cut_short(b, given=False),
    "evalgiven": lambda b: eval_val_cut_short(b, given=True),
}


def cell(text: str, width: int = 110) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", help="work folder (kept); default: a temporary one, removed")
    ap.add_argument("--only", nargs="+", choices=list(ROWS), help="these rows only")
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        b = Bench(corpus(work))
        t0 = time.time()
        check(b.andrea("prepare", "-c", "andrea-tiny", "-o", "data"), "preparing the data")
        print("| fault | what andrea did | lost | after recovery | test |\n|---|---|---|---|---|",
              flush=True)
        for key in args.only or ROWS:
            row = ROWS[key](b)
            print(f"| {row.fault} | {cell(row.did)} | {row.lost} | {row.after} | {row.test} |",
                  flush=True)
        print(f"\n{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
