"""Shared test helpers: run the real `andrea` command in a subprocess."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import background
import forkserver
import pytest

REPO = Path(__file__).resolve().parents[1]


def run_andrea(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 600,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m andrea ARGS` as a user would run it; returns the completed process. The process
    is forked from one that has imported andrea and torch already (tests/forkserver.py says why
    and what that skips); FRESH, or ANDREA_TEST_FRESH=1, starts a new interpreter instead."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if not fresh and forkserver.enabled():
        return forkserver.run(["-m", "andrea", *args], str(cwd or Path.cwd()), full_env, timeout)
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


def python_command(*argv: str, fresh: bool = False) -> list[str]:
    """`python ARGV` (-m MODULE ARGS, SCRIPT ARGS, -c CODE ARGS) as a command line for
    subprocess.run or Popen: forked from the warm process (tests/forkserver.py); FRESH, or
    ANDREA_TEST_FRESH=1, a new interpreter."""
    return [sys.executable, *argv] if fresh else forkserver.command(*argv)


def torchrun_command(*options: str, entry: Sequence[str]) -> list[str]:
    """`torchrun OPTIONS ENTRY` (ENTRY: -m andrea ARGS, or SCRIPT ARGS) as a command line: the
    launcher and each worker it starts forked from the warm process."""
    return forkserver.command("-m", "torch.distributed.run", *options, "--no-python",
                              *forkserver.command(*entry))


def run_torchrun(
    *args: str, nproc: int = 2, launcher: tuple[str, ...] = (), timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=NPROC [LAUNCHER] -m andrea ARGS` on 127.0.0.1, one thread per
    process (the test machines have 2 cores). LAUNCHER replaces the default rendezvous."""
    rendezvous = launcher or ("--master_addr=127.0.0.1", f"--master_port={free_port()}")
    return subprocess.run(
        torchrun_command(f"--nproc_per_node={nproc}", *rendezvous, entry=["-m", "andrea", *args]),
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2, one line on stderr starting 'error:', no traceback, naming each fragment."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


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
        optimizer={}, rng={}, keep_last=1,
    )


@pytest.fixture
def andrea_cli():
    return run_andrea


@pytest.fixture
def inject_faults():
    """For a run in this process: inject_faults("sigint@3.1") installs those faults (the
    spelling of ANDREA_FAULTS, andrea/faults.py); none are left installed after the test."""
    from andrea import faults

    yield faults.install
    faults.install(None)
