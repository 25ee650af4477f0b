"""Shared test helpers: the `andrea` command in this process (andrea_main), or in a process of
its own (run_andrea, python_command, torchrun_command, run_torchrun) where the process is the
point: signals, kill -9, several processes at once, torchrun (run_torchrun_each: several
commands in one launch); waiting for what such a process does (wait_until); the tiny preset as
a run's config (tiny_config, config_file)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

import background
import pytest

if TYPE_CHECKING:
    from andrea.config import Config

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")

# Under pytest-xdist (-n N), each worker's torch, and every process its tests start, takes its
# share of the cores instead of all of them. N workers of a thread per core each keep twice as
# many threads busy as there are cores, and torch's OpenMP waits at every operation for the
# thread that is off its core: a tiny model's step took 3x to 80x longer (docs/log.md).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(share)  # before torch is imported, here or in a child
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(share)


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module, freshly executed (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Result:
    """What a command left: its exit status and its output (subprocess.CompletedProcess's
    names, so assert_user_error reads either)."""

    returncode: int
    stdout: str
    stderr: str


def andrea_main(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, stdin: str = "",
) -> Result:
    """`andrea ARGS` through the real entry point (andrea.cli.main) in this process, in folder
    CWD with ENV added to the environment and sys.argv as `python -m andrea ARGS` has it (all
    restored after), stdin STDIN. What it writes to file descriptors 1 and 2 is its stdout and
    stderr, in order: print and typer alike, and the lines a signal handler writes with
    os.write. Its exit status as a shell would see it: main's SystemExit; an exception main let
    through is a traceback on stderr and status 1, as Python ends a process with one."""
    import andrea.__main__
    from andrea.cli import main

    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_std = sys.stdin, sys.stdout, sys.stderr
    captured = [tempfile.TemporaryFile() for _ in (1, 2)]
    saved_fds = [os.dup(fd) for fd in (1, 2)]
    for f in (*saved_std[1:], sys.__stdout__, sys.__stderr__):
        f.flush()
    try:
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        for fd, file in zip((1, 2), captured, strict=True):
            os.dup2(file.fileno(), fd)
        sys.argv = [andrea.__main__.__file__, *args]
        sys.stdin = io.StringIO(stdin)
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(open(fd, "wb", closefd=False), encoding="utf-8", errors=errors,
                             write_through=True)
            for fd, errors in ((1, "strict"), (2, "backslashreplace")))
        try:
            main(list(args))
        except SystemExit as exited:
            code = exited.code
            if not isinstance(code, int):  # sys.exit("message"): printed, status 1
                if code is not None:
                    print(code, file=sys.stderr)
                code = 0 if code is None else 1
        except Exception:  # noqa: BLE001 - what a process would print before it ends
            traceback.print_exc()
            code = 1
        else:
            code = 0
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved_std
        sys.argv = saved_argv
        for fd, saved in zip((1, 2), saved_fds, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    out, err = (file.seek(0) or file.read().decode("utf-8", "replace") for file in captured)
    for file in captured:
        file.close()
    return Result(code, out, err)


def run_andrea(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 600,
) -> subprocess.CompletedProcess:
    """`python -m andrea ARGS` in a process of its own, as a user would run it; returns the
    completed process. A fresh interpreter spends about 3 s of CPU on imports: use andrea_main
    unless the process is the point."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "andrea", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    """A TCP port nobody listens on now, for a torchrun rendezvous on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_command(*argv: str) -> list[str]:
    """`python ARGV` (-m MODULE ARGS, SCRIPT ARGS, -c CODE ARGS) as a command line for
    subprocess.run or Popen, with this interpreter."""
    return [sys.executable, *argv]


def torchrun_command(*options: str, entry: Sequence[str]) -> list[str]:
    """`torchrun OPTIONS ENTRY` (ENTRY: -m andrea ARGS, or SCRIPT ARGS) as a command line."""
    return python_command("-m", "torch.distributed.run", *options, *entry)


def run_torchrun(
    *args: str, nproc: int = 2, launcher: tuple[str, ...] = (), timeout: float = 300,
    env: dict[str, str] | None = None, script: bool = False,
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=NPROC [LAUNCHER] -m andrea ARGS` on 127.0.0.1, one thread per
    process (the test machines have 2 cores). LAUNCHER replaces the default rendezvous; with
    script, ARGS are a script and its arguments instead of andrea's."""
    rendezvous = launcher or ("--master_addr=127.0.0.1", f"--master_port={free_port()}")
    entry = list(args) if script else ["-m", "andrea", *args]
    return subprocess.run(
        torchrun_command(f"--nproc_per_node={nproc}", *rendezvous, entry=entry),
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )


def run_torchrun_each(
    folder: Path, commands: dict[str, Sequence[str]], *, nproc: int = 2, timeout: float = 600,
    envs: dict[str, dict[str, str]] | None = None,
) -> dict[str, Result]:
    """`torchrun --nproc_per_node=NPROC -m andrea ARGS` (or `SCRIPT.py ARGS`) for each named
    ARGS of COMMANDS, in turn, in one launch (tests/torchrun_runs.py; its files under FOLDER),
    each with ENVS[name] added to the environment: a launch's start-up, about 9 s of CPU, is
    paid once, for trainings whose processes are not the point. A Result per name, as a launch of
    its own would give it: its exit code the first non-zero of any rank's, its stdout and
    stderr every rank's, rank 0's first. A command after one that failed is not run: its exit
    code is -1, its output the launch's."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "commands.json").write_text(json.dumps([
        {"args": list(args), "env": (envs or {}).get(name, {}), "out": str(folder / name)}
        for name, args in commands.items()]))
    launch = run_torchrun(str(REPO / "tests" / "torchrun_runs.py"),
                          str(folder / "commands.json"), nproc=nproc, script=True,
                          timeout=timeout)
    results = {}
    for name in commands:
        def rank_files(suffix: str, name: str = name) -> list[Path]:
            return [folder / f"{name}.rank{rank}.{suffix}" for rank in range(nproc)]
        if not all(p.exists() for p in rank_files("code")):
            results[name] = Result(-1, launch.stdout, launch.stderr)
            continue
        codes = [int(p.read_text()) for p in rank_files("code")]
        results[name] = Result(next((c for c in codes if c), 0),
                               *("".join(p.read_text() for p in rank_files(suffix))
                                 for suffix in ("out", "err")))
    return results


def without_notes(stderr: str) -> str:
    """A long training's stderr without its `note: ` lines: the plan's time (progress.PlanNote),
    said when a plan is long for the machine's pace, which a loaded machine can make it."""
    return "".join(line for line in stderr.splitlines(True) if not line.startswith("note: "))


def assert_user_error(
    proc: Result | subprocess.CompletedProcess, *fragments: str
) -> str:
    """Exit code 2, one line on stderr starting 'error:', no traceback, naming each fragment."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def wait_until(
    condition: Callable[[], T], *, what: str, timeout: float = 60,
    proc: subprocess.Popen | None = None,
) -> T:
    """Polls CONDITION until it returns something true, and returns that: how a test waits for
    what another process or thread does (a file appears, a line is said), never a fixed sleep.
    Fails saying WHAT it waited for after TIMEOUT seconds, or as soon as PROC, the process that
    was to make it true, has ended (with that process's output); PROC is killed on a timeout,
    so that a failed test leaves no training behind."""
    deadline = time.monotonic() + timeout
    while True:
        ended = proc is not None and proc.poll() is not None  # before: it may end once true
        value = condition()
        if value:
            return value
        if ended:
            out, err = proc.communicate()
            pytest.fail(f"waited for {what}, but the process ended first (exit "
                        f"{proc.returncode})\nstdout: {out[-3000:]}\nstderr: {err[-3000:]}")
        if time.monotonic() > deadline:
            if proc is not None:
                proc.kill()
                proc.communicate()
            pytest.fail(f"waited {timeout:g} s for {what}")
        time.sleep(0.02)


def fake_cgroup(root: Path, version: int, limit: str, usage: int, cache: int) -> None:
    """A container's memory control group as the kernel shows it (v2, or v1's memory folder)."""
    folder = root / "job" if version == 2 else root / "memory"
    folder.mkdir(parents=True)
    names = (("memory.max", "memory.current", "inactive_file") if version == 2 else
             ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    (folder / names[0]).write_text(limit + "\n")
    (folder / names[1]).write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"anon 1\n{names[2]} {cache}\nfile 2\n")
    (root / "self-cgroup").write_text("0::/job\n" if version == 2 else "4:memory:/\n")


def tiny_config(runs: Path, data_dir: Path, *sets: str, name: str = "t") -> Config:
    """The tiny preset (configs/andrea-tiny.yaml) as a test's run: run NAME under RUNS reading
    DATA_DIR (the data_dir fixture, or a folder of the test's own), every step logged, no eval
    and one checkpoint at the end; SETS (--set spellings: "train.max_steps=4") come last."""
    from andrea.config import load_config

    return load_config("andrea-tiny", [
        f"data.dir={data_dir}", f"train.runs_dir={runs}", f"train.name={name}",
        "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0", *sets])


def config_file(cfg: Config, folder: Path) -> Path:
    """CFG as FOLDER/NAME.yaml (NAME: its run's), the file `andrea train -c` reads."""
    path = folder / f"{cfg.train.name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[bool]:
    """A tmpfs of `size` (mount's spelling: "160k") at `folder`: True where this process may
    mount one (root), else False and `folder` is an ordinary folder (the caller then injects the
    full disk: disk-full@ in ANDREA_FAULTS, or a faked shutil.disk_usage). Unmounted at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=True)


# The kernel emulator's library, which these files' tests load (tests/background.py: built on a
# low-priority thread from the session's start; the half-arch and sanitizer builds are declared
# by the files that use them).
EMULATOR_USERS = ("test_cuda_backend.py", "test_cuda_compile.py", "test_gpu_check.py",
                  "test_kernel_numerics.py")
if shutil.which(os.environ.get("CXX", "g++")):
    from andrea.cuda import emulator as _emulator

    background.declare("emulator", _emulator.build_library, wanted_by=EMULATOR_USERS)


def pytest_configure(config: pytest.Config) -> None:
    background.share_between_workers(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    background.unshare()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=background.runs_late)  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def builds_in_the_background(request: pytest.FixtureRequest) -> Iterator[None]:
    background.start(request.session.items)
    yield
    background.stop()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The tiny preset's data (Shakespeare as bytes), prepared once for the whole session."""
    from andrea.config import load_config
    from andrea.data.prepare import ensure_prepared

    out = tmp_path_factory.mktemp("data") / "shakespeare-byte"
    ensure_prepared(load_config("andrea-tiny", [f"data.dir={out}"]))
    return out


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory, data_dir):
    """One run the whole session reads (eval, tasks, export, generate, runs): the tiny preset in
    fp32, 40 steps, a checkpoint at steps 20 and 40, every step logged. Its TrainResult (run_dir,
    checkpoint, losses). Never change it: copy the run folder first (shutil.copytree)."""
    from andrea.config import load_config
    from andrea.train.loop import train

    runs = tmp_path_factory.mktemp("trained") / "runs"
    return train(load_config("andrea-tiny", [
        f"data.dir={data_dir}", f"train.runs_dir={runs}", "train.name=t", "train.max_steps=40",
        "train.eval_every=0", "train.checkpoint_every=20", "train.log_every=1",
        "train.precision=fp32",
    ]), progress=False)


def make_checkpoint(
    tmp_path: Path, *sets: str, tokenizer: str = "byte:v1", seed: int = 0, step: int = 5
) -> Path:
    """A run runs/r under tmp_path whose one checkpoint holds a freshly initialised tiny model
    (no training: for tests that need any weights). Returns the checkpoint folder."""
    import torch

    from andrea.config import load_config
    from andrea.model.transformer import Andrea
    from andrea.train import checkpoint as ckpt_io
    from andrea.train.rundir import TrainerState

    cfg = load_config(
        "andrea-tiny", [f"train.runs_dir={tmp_path / 'runs'}", "train.name=r", *sets]
    )
    torch.manual_seed(seed)
    model = Andrea(cfg.model)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return ckpt_io.save_checkpoint(
        run_dir, TrainerState(step=step), cfg, tokenizer, model=ckpt_io.model_state(model),
        optimizer={}, rng={"cpu.rank0": torch.get_rng_state()}, keep_last=1,
    )


@pytest.fixture
def inject_faults():
    """For a run in this process: inject_faults("sigint@3.1") installs those faults (the
    spelling of ANDREA_FAULTS, andrea/faults.py); none are left installed after the test."""
    from andrea import faults

    yield faults.install
    faults.install(None)
