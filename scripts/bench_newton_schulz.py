"""Muon's orthogonalisation in float32: the plain Newton-Schulz iteration against its Gram form
(andrea/train/muon.py, `gram_iteration`), on a preset's Muon matrices, alternated in one run:

    python scripts/bench_newton_schulz.py [--preset andrea-12m] [--rounds 5] [--train-steps 3]

For each shape of the preset's Muon matrices (QKV, W_O, MLP up and down, as many of each as the
model has) it times `newton_schulz` in float32 both ways and gives each form's error against the
plain iteration in float64, on matrices whose singular values spread over 4 decades (as momentum
matrices' do). Then, with --train-steps > 0, `andrea bench`'s training step (andrea.bench.
bench_train, the preset's batch, train.optimizer muon with fp32 iterations) with the plain form
and with the Gram form, alternated: what the change is worth to a whole step. Medians; prints the
CPU's name.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import Counter

import torch

from andrea.bench import bench_train
from andrea.config import load_config
from andrea.model.transformer import Andrea
from andrea.resources import cpu_name
from andrea.train import muon

QUINTIC = muon.NewtonSchulzSchedule.quintic((3.4445, -4.7750, 2.0315), 5)


def spread_matrix(rows: int, cols: int, decades: float, seed: int) -> torch.Tensor:
    """float64 [rows, cols] with singular values evenly spread over `decades` decades."""
    gen = torch.Generator().manual_seed(seed)
    m = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, m, generator=gen, dtype=torch.float64))
    return (u * 10 ** (-decades * torch.arange(m, dtype=torch.float64) / m)) @ v.T


def time_ms(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="andrea-12m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=3, help="0: skip the training step")
    args = ap.parse_args()
    cfg = load_config(args.preset)
    matrices, _ = muon.split_parameters(Andrea(cfg.model))
    counts = Counter(tuple(p.shape) for p in matrices)
    print(f"{args.preset} on {cpu_name()}, {torch.get_num_threads()} threads; Muon matrices: "
          + ", ".join(f"{n} x {r}x{c}" for (r, c), n in counts.items()), flush=True)

    forms = {"plain": False, "gram": True}
    total = {"plain": 0.0, "gram": 0.0, "picked": 0.0}
    for i, ((rows, cols), n) in enumerate(counts.items()):
        g64 = spread_matrix(rows, cols, 4, seed=i)
        g32 = g64.float()
        ref = muon.newton_schulz(g64, QUINTIC, eps=1e-7, dtype=torch.float64)
        times: dict[str, list[float]] = {form: [] for form in forms}
        for _ in range(args.rounds + 1):  # the first round warms up and is dropped
            for form, gram in forms.items():
                times[form].append(time_ms(muon.newton_schulz, g32, QUINTIC, eps=1e-7,
                                           dtype=torch.float32, gram=gram))
        row = []
        for form, gram in forms.items():
            out = muon.newton_schulz(g32, QUINTIC, eps=1e-7, dtype=torch.float32, gram=gram)
            error = float((out.double() - ref).norm() / ref.norm())
            ms = statistics.median(times[form][1:])
            total[form] += n * ms
            row.append(f"{form} {ms:7.1f} ms (error {error:.1e})")
        picked = "gram" if muon.gram_pays((rows, cols), torch.float32) else "plain"
        total["picked"] += n * statistics.median(times[picked][1:])
        print(f"  {rows:5d} x {cols:<5d}  " + "   ".join(row) + f"   gram/plain "
              f"{statistics.median(times['gram'][1:]) / statistics.median(times['plain'][1:]):.2f}"
              f"   andrea picks {picked}", flush=True)
    print(f"one optimizer step's orthogonalisation, all {len(matrices)} matrices: plain "
          f"{total['plain']:,.0f} ms, gram everywhere {total['gram']:,.0f} ms, andrea's pick "
          f"{total['picked']:,.0f} ms ({total['picked'] / total['plain']:.2f} of plain)",
          flush=True)

    if args.train_steps <= 0:
        return
    sets = ["train.optimizer=muon", "train.muon_ns_precision=fp32"]
    plain = functools.partial(muon.newton_schulz, gram=False)
    picked_form = muon.newton_schulz
    tokens: dict[str, list[float]] = {"plain": [], "picked": []}
    for _ in range(2):
        for side, fn in (("plain", plain), ("picked", picked_form)):
            muon.newton_schulz = fn  # what Float32Muon calls
            row = bench_train(args.preset, "sdpa", torch.device("cpu"), args.train_steps, 1, sets)
            tokens[side].append(row.tokens_per_s)
            print(f"training step, {side} form: {row.micro_batch_size} x {row.block_size} x "
                  f"{row.accumulation}, {row.step_ms:,.0f} ms, {row.tokens_per_s:,.0f} tokens/s",
                  flush=True)
    muon.newton_schulz = picked_form
    med = {side: statistics.median(v) for side, v in tokens.items()}
    print(f"median tokens/s: plain {med['plain']:,.0f}, andrea's pick {med['picked']:,.0f}; "
          f"ratio {med['picked'] / med['plain']:.3f}")


if __name__ == "__main__":
    main()
