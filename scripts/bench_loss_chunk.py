"""One chunk of the LM head's loss (andrea.model.transformer.softmax_chunk) at ANDREA-120M's
shape, eager and compiled, side by side in one process.

A chunk is 667 rows of 50,304 logits (the loss's 32M logits a chunk), bf16 logits in and the
bf16 gradient out, the softmax in float32. Rows timed, median milliseconds a call:

- eager: softmax_chunk as a model outside torch.compile runs it (in place);
- compiled: softmax_chunk under torch.compile, as a compiled model runs it (the gradient written
  pointwise, fused with the softmax);
- compiled, scatter form: the eager form's in-place scatter compiled, which is what a compiled
  model ran until 2026-12-06 (inductor keeps a float32 [rows, vocab] buffer for it and reads it
  back). It is softmax_chunk traced with torch.compiler.is_compiling answering False.

    python scripts/bench_loss_chunk.py [--rows 667] [--vocab 50304] [--repeats 7] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch

from andrea.model.transformer import LOSS_CHUNK_LOGITS, softmax_chunk
from andrea.resources import cpu_name


def compiled_scatter_form() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """softmax_chunk compiled with its eager branch: dynamo inlines the patched is_compiling."""
    compiled = torch.compile(softmax_chunk, dynamic=False)

    def run(*args: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        with mock.patch.object(torch.compiler, "is_compiling", lambda: False):
            return compiled(*args)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--rows", type=int, default=None, help="default: the loss's own chunk")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rows = args.rows or max(1, LOSS_CHUNK_LOGITS // args.vocab)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, args.vocab, generator=g).to(device, torch.bfloat16)
    targets = torch.randint(0, args.vocab, (rows, 1), generator=g).to(device)
    valid = torch.ones(rows, device=device)
    count = valid.sum()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    forms = {
        "eager": softmax_chunk,
        "compiled": torch.compile(softmax_chunk, dynamic=False),
        "compiled, scatter form": compiled_scatter_form(),
    }
    results = {}
    for name, fn in forms.items():  # the first calls compile
        results[name] = fn(logits, targets, valid, count, True)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.repeats):  # interleaved, so a slow moment of the machine hits all
        for name, fn in forms.items():
            sync()
            t0 = time.perf_counter()
            fn(logits, targets, valid, count, True)
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{cpu_name()}, {torch.get_num_threads()} threads")
    print(f"softmax_chunk, {rows} x {args.vocab} bf16 logits; {where}; torch {torch.__version__}")
    base = statistics.median(times["compiled, scatter form"])
    for name, ms in times.items():
        median = statistics.median(ms)
        print(f"{name:24s} {median:9.2f} ms  {base / median:5.2f}x the scatter form")
    same = all(torch.equal(a, b) for a, b in zip(results["compiled"],
                                                  results["compiled, scatter form"], strict=True))
    print(f"compiled and compiled scatter form: {'the same bits' if same else 'DIFFERENT bits'}")


if __name__ == "__main__":
    main()
