"""Run under torchrun: `sync_counter.py OUT NAME=CONFIG.yaml[@FAULTS] ...` trains each config in
this process (`andrea.cli.main`, one after the other; FAULTS is ANDREA_FAULTS for that run) and
writes OUT.rankR.json: per run, how many times it called `torch.distributed.all_reduce`, read a
tensor into Python (`item`, `tolist`, `float()`, `int()`, `bool()`, `numpy`) and ran the model's
forward, with its exit code. tests/test_step_syncs.py compares 1 and 8 micro-batches a step.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from andrea.cli import main
from andrea.model.transformer import Andrea

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy")
counts: Counter[str] = Counter()


def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return fn(*args, **kwargs)
    return wrapper


def install() -> None:
    dist.all_reduce = counted("all_reduce", dist.all_reduce)
    for name in READS:
        setattr(torch.Tensor, name, counted("read", getattr(torch.Tensor, name)))
    Andrea.forward = counted("forward", Andrea.forward)


def run(config: str, faults: str | None) -> dict[str, Any]:
    counts.clear()
    if faults:
        os.environ["ANDREA_FAULTS"] = faults
    try:
        main(["train", "-c", config, "--no-progress"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    finally:
        os.environ.pop("ANDREA_FAULTS", None)
    return {"exit_code": code, **counts}


if __name__ == "__main__":
    out, runs = sys.argv[1], sys.argv[2:]
    install()
    result = {}
    for item in runs:
        name, spec = item.split("=", 1)
        config, _, faults = spec.partition("@")
        result[name] = run(config, faults or None)
    rank = os.environ.get("RANK", "0")
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # the counters wrap torch.Tensor: skip the interpreter's teardown with them in
