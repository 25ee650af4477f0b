"""Run under torchrun: `torchrun_runs.py RUNS.json` runs each command of RUNS.json in turn on
every rank, `andrea ARGS` through andrea.cli.main in this process (or, where ARGS start with a
SCRIPT.py, that script as __main__ with ARGS as its sys.argv), with its ENV added to the
environment (ANDREA_FAULTS is read by each command), its file descriptors 1 and 2 going to
OUT.rankR.out and OUT.rankR.err and its exit code to OUT.rankR.code (RUNS.json: a list of
{"args": [...], "env": {...}, "out": OUT}). conftest.run_torchrun_each writes and reads these:
a launch's start-up (about 9 s of CPU for the launcher and two workers, docs/log.md) is paid
once for several trainings whose processes are not the point. A command that fails ends the
launch (torchrun then stops the other ranks); the commands after it are not run.

Each command takes keys of its own in torchrun's store, as a first launch's (restarts.attempt:
its process group's, the config rank 0 shares): a second process group under the first one's
keys read the ended group's addresses and sometimes hung (sync_counter.py), and a rank read
the config an earlier `--resume RUN` had shared."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch.distributed as dist

from andrea.cli import main
from andrea.train import restarts

RANK = os.environ.get("RANK", "0")


def run(args: list[str], env: dict[str, str], out: str, index: int) -> int:
    connect = dist.TCPStore

    def own_keys(*a, **k):  # noqa: ANN002, ANN003 - TCPStore's own
        return dist.PrefixStore(f"tests/command-{index}", connect(*a, **k))

    saved_env, saved_fds = dict(os.environ), [os.dup(fd) for fd in (1, 2)]
    dist.TCPStore = own_keys
    restarts.attempt.cache_clear()  # this command's attempt, 0, under its own keys
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.environ.update(env)
        for fd, suffix in ((1, "out"), (2, "err")):
            with open(f"{out}.rank{RANK}.{suffix}", "wb") as file:
                os.dup2(file.fileno(), fd)
        try:
            if args[0].endswith(".py"):
                saved_argv, sys.argv = sys.argv, list(args)
                try:
                    runpy.run_path(args[0], run_name="__main__")
                finally:
                    sys.argv = saved_argv
            else:
                main(args)
            code = 0
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else int(exited.code is not None)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        dist.TCPStore = connect
        for fd, saved in zip((1, 2), saved_fds, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        os.environ.clear()
        os.environ.update(saved_env)
    with open(f"{out}.rank{RANK}.code", "w") as file:
        file.write(f"{code}\n")
    return code


if __name__ == "__main__":
    commands = json.loads(Path(sys.argv[1]).read_text())
    for index, command in enumerate(commands):
        code = run(command["args"], command.get("env", {}), command["out"], index)
        if code:
            sys.exit(code)
