"""The optimizer's share of an ANDREA-12M step: AdamW against Muon (bf16 and fp32 Newton-Schulz).

    python scripts/bench_muon_step.py [--preset andrea-12m] [--rounds 5] [--fwd-bwd-rounds 3]

Each side is `andrea.train.optim.build_optimizer` for the same model (train.optimizer adamw, muon
with train.muon_ns_precision bf16, muon with fp32), stepping on the same fixed gradients. Rounds
alternate between the three so a noisy, shared machine slows all alike; figures are medians of
optimizer.step() in milliseconds. For scale, one fp32 forward + backward at the preset's micro-
batch x block_size is timed in the same run. Prints the CPU's name and whether it has bf16 units
(the check that picks muon_ns_precision auto).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from andrea.config import load_config
from andrea.model.transformer import Andrea
from andrea.resources import cpu_name
from andrea.train.device import cpu_has_bf16
from andrea.train.optim import build_optimizer

SIDES = {"adamw": ["train.optimizer=adamw"],
         "muon bf16 NS": ["train.optimizer=muon", "train.muon_ns_precision=bf16"],
         "muon fp32 NS": ["train.optimizer=muon", "train.muon_ns_precision=fp32"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="andrea-12m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fwd-bwd-rounds", type=int, default=3)
    args = ap.parse_args()

    setups = {}
    for side, sets in SIDES.items():
        cfg = load_config(args.preset, sets)
        torch.manual_seed(0)
        model = Andrea(cfg.model)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        setups[side] = (model, build_optimizer(model, cfg, torch.device("cpu")))
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for side, (_, opt) in setups.items():
            t0 = time.perf_counter()
            opt.step()
            times[side].append((time.perf_counter() - t0) * 1e3)

    cfg = load_config(args.preset)
    model = setups["adamw"][0]
    b, t = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 8, \
        cfg.model.block_size
    x = torch.randint(cfg.model.vocab_size, (b, t), generator=torch.Generator().manual_seed(2))
    fwd_bwd = []
    for _ in range(args.fwd_bwd_rounds + 1):
        t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        fwd_bwd.append((time.perf_counter() - t0) * 1e3)

    print(f"cpu: {cpu_name()}; bf16 units: {cpu_has_bf16()}; torch {torch.__version__}; "
          f"threads {torch.get_num_threads()}")
    print(f"{args.preset}, optimizer.step() median over {args.rounds} alternating rounds:")
    base = statistics.median(times["adamw"][1:])
    for side, ms in times.items():
        med = statistics.median(ms[1:])
        print(f"  {side:14s} {med:9.1f} ms   x{med / base:6.2f} of adamw")
    print(f"  fp32 forward+backward at B{b}xT{t}: {statistics.median(fwd_bwd[1:]):9.1f} ms "
          f"(median of {args.fwd_bwd_rounds})")


if __name__ == "__main__":
    main()
