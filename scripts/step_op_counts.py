"""How many operators one eager training step dispatches, by part: forward, backward, clipping,
optimizer step. On a GPU nearly each of them is a kernel launch, and a small model's step is
as slow as the host can issue them (ANDREA-12M's on an H200: docs/log.md, 2026-12-04); the
counts do not depend on the device or the batch, so this CPU count says where the launches are.

    python scripts/step_op_counts.py [--preset andrea-12m] [--optimizer muon|adamw]

Operators that only make views (view, transpose, detach, split, ...) launch nothing and are
counted apart. The model and optimizer are the package's (`Andrea`, `build_optimizer`), the
attention "sdpa", one micro-batch of 2 windows; two uncounted steps first, so the optimizer's
state exists as in a long run.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from andrea.config import load_config
from andrea.model.transformer import Andrea
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
    args = parser.parse_args()
    overrides = ["train.micro_batch_size=2", "model.attention=sdpa"]
    if args.optimizer:
        overrides.append(f"train.optimizer={args.optimizer}")
    cfg = load_config(args.preset, overrides)
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
    parts: dict[str, Counter[str]] = {}

    def step(count: bool) -> None:
        def part(name: str, fn):
            if not count:
                return fn()
            with OpCounter() as counter:
                out = fn()
            parts[name] = counter.ops
            return out

        _, loss = part("forward", lambda: model(x, x))
        part("backward", loss.backward)
        part("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        part("optimizer", optimizer.step)
        optimizer.zero_grad(set_to_none=True)

    for count in (False, False, True):
        step(count)
    names = [type(o).__name__ for o in getattr(optimizer, "optimizers", [optimizer])]
    print(f"{args.preset} ({cfg.model.n_layer} layers), optimizer {cfg.train.optimizer} "
          f"({' + '.join(names)}); torch {torch.__version__}")
    print(f"{'part':10s} {'launching':>9s} {'views':>6s}  most launched")
    total = 0
    for name, ops in parts.items():
        launching = Counter({op: n for op, n in ops.items() if op not in VIEWS})
        views = sum(n for op, n in ops.items() if op in VIEWS)
        total += sum(launching.values())
        top = ", ".join(f"{op} {n}" for op, n in launching.most_common(6))
        print(f"{name:10s} {sum(launching.values()):9d} {views:6d}  {top}")
    print(f"{'step':10s} {total:9d}         (forward and backward once per micro-batch)")


if __name__ == "__main__":
    main()
