"""The command run twice in one process leaves nothing behind (what the suite relies on to call
`andrea.cli.main` in the pytest process, tests/conftest.py andrea_main): signal handlers,
torch's thread and numeric settings, the process group, the current folder, the environment,
the injected faults, logging's handlers, the threads left running."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from pathlib import Path

import numpy as np
import torch
import torch.distributed
from conftest import andrea_main

from andrea import faults

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGQUIT, signal.SIGCHLD, signal.SIGPIPE)


def process_state() -> dict:
    known = logging.Logger.manager.loggerDict.values()
    loggers = [logging.getLogger(), *(x for x in known if isinstance(x, logging.Logger))]
    return {
        "signal handlers": {sig.name: signal.getsignal(sig) for sig in SIGNALS},
        "torch threads": (torch.get_num_threads(), torch.get_num_interop_threads()),
        "torch numerics": (torch.get_default_dtype(), torch.is_grad_enabled(),
                           torch.get_float32_matmul_precision(),
                           torch.are_deterministic_algorithms_enabled(),
                           torch.is_autocast_enabled("cpu")),
        "process group": torch.distributed.is_initialized(),
        "folder": os.getcwd(),
        "environment": dict(os.environ),
        "faults": faults._active,
        "logging": {logger.name: (logger.level, list(logger.handlers))
                    for logger in loggers if logger.handlers or logger.level},
        "threads": sorted(t.name for t in threading.enumerate()),
        "random generators": generators(),
    }


def generators() -> tuple:
    """The process's global random generators' states: torch's, Python's and numpy's."""
    return (torch.get_rng_state().numpy().tobytes(), random.getstate(),
            np.random.get_state()[1].tobytes())


def test_train_then_eval_and_generate_twice_leave_the_process_as_it_was(tmp_path: Path,
                                                                          data_dir: Path) -> None:
    before = process_state()
    runs = tmp_path / "runs"
    for attempt in range(2):
        train = andrea_main(
            "train", "--config", "andrea-tiny", "--set", f"data.dir={data_dir}",
            "--set", f"train.runs_dir={runs}", "--set", f"train.name=r{attempt}",
            "--set", "train.max_steps=2", "--set", "train.eval_every=0",
            "--set", "train.log_every=1", cwd=tmp_path, env={"ANDREA_FAULTS": "nan@1000"})
        assert train.returncode == 0, train.stderr
        assert process_state() == before
        run = str(runs / f"r{attempt}")
        for command in (("eval", "--checkpoint", run, "--max-tokens", "64"),
                        ("generate", "--checkpoint", run, "--prompt", "To be",
                         "--max-new-tokens", "4", "--seed", "0")):
            result = andrea_main(*command, cwd=tmp_path)
            assert result.returncode == 0, result.stderr
            assert process_state() == before, command


def test_train_leaves_the_callers_random_generators_as_they_were(tmp_path: Path,
                                                                 data_dir: Path) -> None:
    """Before: train() returned with torch's global generator where the run left it, seeded
    from train.seed, so a script's own draws after it were the same after every run of a
    sweep, whatever the script had seeded. Now the caller's states are put back, and the
    run's losses are what they were: they never depended on the caller's generator."""
    from conftest import tiny_config

    from andrea.train.loop import train

    losses, after = [], []
    for seed in (1, 2):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        before = generators()
        result = train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2",
                                   name=f"seed{seed}"), progress=False)
        assert result.state == "finished"
        assert generators() == before
        losses.append(result.losses)
        after.append(torch.rand(4).tolist())
    assert losses[0] == losses[1] and len(losses[0]) == 2
    assert after[0] != after[1]  # each caller's own next draws, not the run's


def test_train_from_a_thread_other_than_the_main_one(tmp_path: Path, data_dir: Path) -> None:
    """Only the main thread may install signal handlers: a training started from another (a
    sweep's worker thread, a web app's callback) runs without them, and leaves them as they
    were, instead of failing with Python's ValueError."""
    from conftest import tiny_config

    from andrea.train.loop import train

    before = process_state()["signal handlers"]
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(train(tiny_config(tmp_path / "runs", data_dir, "train.max_steps=2"),
                                 progress=False))
        except BaseException as exc:  # the thread's failure, for the assert
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert [getattr(r, "state", r) for r in outcome] == ["finished"]
    assert process_state()["signal handlers"] == before


def test_a_verb_leaves_the_callers_excepthook(monkeypatch) -> None:
    """typer sets sys.excepthook to its own at every call of the app; main puts the caller's
    back, so a crash logger (or a notebook's hook) still sees what fails after the verb."""
    import sys

    def mine(*exc: object) -> None:
        pass

    monkeypatch.setattr(sys, "excepthook", mine)
    assert andrea_main("count-params", "--config", "andrea-tiny").returncode == 0
    assert andrea_main("count-params", "--config", "nope").returncode == 2
    assert sys.excepthook is mine
