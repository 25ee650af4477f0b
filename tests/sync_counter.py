"""Run under torchrun: `sync_counter.py OUT RUNS` trains each [NAME, CONFIG.yaml, FAULTS] of the
JSON list RUNS in turn (torchrun_runs.run: `andrea train -c CONFIG.yaml`, ANDREA_FAULTS=FAULTS,
its output in OUT-NAME.rankR.*) and writes OUT.rankR.json: for each NAME, how many times the
run called `torch.distributed.all_reduce`, read a tensor into Python (`item`, `tolist`,
`float()`, `int()`, `bool()`, `numpy`) and ran the model's forward, with its exit code.
tests/test_step_syncs.py compares 1 and 8 micro-batches a step."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torchrun_runs import RANK, run

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


if __name__ == "__main__":
    out, runs = sys.argv[1], json.loads(sys.argv[2])
    install()
    result = {}
    for index, (name, config, faults) in enumerate(runs):
        counts.clear()
        code = run(["train", "-c", config, "--no-progress"],
                   {"ANDREA_FAULTS": faults} if faults else {}, f"{out}-{name}", index)
        result[name] = {"exit_code": code, **counts}
    with open(f"{out}.rank{RANK}.json", "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # the counters wrap torch.Tensor: skip the interpreter's teardown with them in
