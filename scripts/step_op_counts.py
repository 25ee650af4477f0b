"""How many operators one eager training step dispatches, by part: forward, backward, clipping,
optimizer step. On a GPU nearly each of them is a kernel launch, and a small model's step is
as slow as the host can issue them (ANDREA-12M's on an H200: docs/log.md, 2026-12-04); the
counts do not depend on the device or the batch, so this CPU count says where the launches are.

    python scripts/step_op_counts.py [--preset andrea-12m] [--optimizer muon|adamw]
                                     [--precision bf16|fp32] [--host-time]

The forward runs under autocast as training runs it (bf16 by default, a GPU's precision): its
casts of the weights and of LayerNorm's inputs, and their gradients' casts back, are launches too.

--host-time adds each part's milliseconds on this CPU with the model's compute taken out
(head_dim 2, 16 positions, one window; the preset's layers, heads, vocabulary and optimizer):
the median over 50 steps of what the host spends issuing the part, its tiny kernels included.
On a GPU the host issues the same operators while the GPU runs them, so where the GPU is quicker
than the host (a small model), a step takes about this long however fast the GPU is; the GPU's
own launch cost per operator comes on top.

Operators that only make views (view, transpose, detach, split, ...) launch nothing and are
counted apart. The model and optimizer are the package's (`Andrea`, `build_optimizer`), the
attention "sdpa", one micro-batch of 2 windows; two uncounted steps first, so the optimizer's
state exists as in a long run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from andrea.config import Config, load_config
from andrea.model.transformer import Andrea
from andrea.resources import cpu_name
from andrea.train.optim import build_optimizer

VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "detach", "split",
         "split_with_sizes", "expand", "as_strided", "alias", "slice", "select", "unsqueeze",
         "squeeze", "reshape", "unbind", "_reshape_alias", "diagonal", "lift_fresh"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="andrea-12m")
    parser.add_argument("--optimizer", choices=("muon", "adamw"), default=None,
                        help="train.optimizer (default: the preset's)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="autocast's dtype for the forward, as training runs it (default bf16)")
    parser.add_argument("--host-time", action="store_true",
                        help="also each part's host milliseconds with the compute taken out")
    args = parser.parse_args()
    overrides = ["train.micro_batch_size=2", "model.attention=sdpa"]
    if args.optimizer:
        overrides.append(f"train.optimizer={args.optimizer}")
    cfg = load_config(args.preset, overrides)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    parts, names = run_steps(cfg, dtype, windows=2, rounds=3, count=True)
    seconds: dict[str, list[float]] = {}
    if args.host_time:
        torch.set_num_threads(1)  # the host's one issuing thread
        narrow = load_config(args.preset, [*overrides, "model.head_dim=2", "model.block_size=16"])
        seconds, _ = run_steps(narrow, dtype, windows=1, rounds=50 + 5, count=False)
    print(f"{args.preset} ({cfg.model.n_layer} layers), optimizer {cfg.train.optimizer} "
          f"({' + '.join(names)}), {args.precision}; torch {torch.__version__}")
    if seconds:
        print(f"host ms: {cpu_name()}, 1 thread, medians of 50 steps after 5")
    print(f"{'part':10s} {'launching':>9s} {'views':>6s}"
          f"{' host ms' if seconds else ''}  most launched")
    total, total_ms = 0, 0.0
    for name, ops in parts.items():
        launching = Counter({op: n for op, n in ops.items() if op not in VIEWS})
        views = sum(n for op, n in ops.items() if op in VIEWS)
        total += sum(launching.values())
        ms = ""
        if seconds:
            median = 1e3 * statistics.median(seconds[name][5:])
            total_ms += median
            ms = f" {median:8.2f}"
        top = ", ".join(f"{op} {n}" for op, n in launching.most_common(6))
        print(f"{name:10s} {sum(launching.values()):9d} {views:6d}{ms}  {top}")
    print(f"{'step':10s} {total:9d}       {f' {total_ms:8.2f}' if seconds else ''}"
          f"  (forward and backward once per micro-batch)")


def run_steps(cfg: Config, dtype: torch.dtype, windows: int, rounds: int,
              count: bool) -> tuple[dict, list[str]]:
    """`rounds` steps of the preset's model and optimizer on `windows` windows, the forward
    under autocast to dtype (none for float32) as the training loop runs it: (each part's
    operators counted in the last step (count), or each part's seconds in every step; the
    optimizer's class names)."""
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    x = torch.randint(0, cfg.model.vocab_size, (windows, cfg.model.block_size))
    counted: dict[str, Counter[str]] = {}
    timed: dict[str, list[float]] = {}

    def part(name: str, fn, last: bool):
        if count and last:
            with OpCounter() as counter:
                out = fn()
            counted[name] = counter.ops
            return out
        start = time.perf_counter()
        out = fn()
        timed.setdefault(name, []).append(time.perf_counter() - start)
        return out

    def forward():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            return model(x, x)

    for round_ in range(rounds):
        last = round_ == rounds - 1  # two uncounted steps first: the optimizer's state exists
        _, loss = part("forward", forward, last)
        part("backward", loss.backward, last)
        part("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), last)
        part("optimizer", optimizer.step, last)
        optimizer.zero_grad(set_to_none=True)
    names = [type(o).__name__ for o in getattr(optimizer, "optimizers", [optimizer])]
    return (counted if count else timed), names


if __name__ == "__main__":
    main()
