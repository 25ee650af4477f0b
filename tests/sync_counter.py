"""Run under torchrun: `sync_counter.py OUT CONFIG.yaml` trains CONFIG (`andrea.cli.main`, the
environment's ANDREA_FAULTS as usual) and writes OUT.rankR.json: how many times the run called
`torch.distributed.all_reduce`, read a tensor into Python (`item`, `tolist`, `float()`, `int()`,
`bool()`, `numpy`) and ran the model's forward, with its exit code. tests/test_step_syncs.py
compares 1 and 8 micro-batches a step. One run per process: a second one sometimes hung setting
up its process group again."""

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


def run(config: str) -> dict[str, Any]:
    try:
        main(["train", "-c", config, "--no-progress"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    return {"exit_code": code, **counts}


if __name__ == "__main__":
    out, config = sys.argv[1], sys.argv[2]
    install()
    result = run(config)
    rank = os.environ.get("RANK", "0")
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # the counters wrap torch.Tensor: skip the interpreter's teardown with them in
