"""Time to quality: ANDREA-12M on the embedded corpus, AdamW and Muon at one token budget.

    python scripts/bench_quality.py [--tokens 7864320] [--preset andrea-12m] [--runs-dir runs]
                                    [--eval-tokens 32768] [--set train.muon_lr=0.02 ...]
                                    [--optimizers adamw muon]

Both runs are `andrea.train.loop.train` with the preset's settings, the same seed and therefore the
same initial weights and the same data order (batches are a function of seed and step); they
differ only in train.optimizer. The budget is rounded up to a whole number of optimizer steps
divisible by 10; warm-up is the preset's, capped at a tenth of the steps so a short budget still
reaches the peak learning rate. Each run checkpoints at every tenth of the budget, and every
checkpoint is evaluated (andrea.evaluate.evaluate_checkpoint) on the same --eval-tokens tokens
of the validation split (windows spread over the whole split, the trainer's val set for
train.eval_tokens of that size), which gives validation loss and bits per byte on identical text.

Printed: the CPU, the settings, a table of val loss and bits/byte at each tenth, and the tokens
each optimizer needs to reach AdamW's final val loss (linear between tenths; "not reached" when it
does not within the budget), with Muon's share of AdamW's. The runs stay under --runs-dir as
quality-adamw-<tokens> and quality-muon-<tokens> (with the --set overrides appended, so a
learning-rate sweep keeps one run per setting): `andrea plot` them for the curves.
--optimizers runs one of them only (a sweep of one optimizer's learning rate); the comparison is
printed when both ran.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from andrea.config import load_config
from andrea.errors import UserError
from andrea.evaluate import evaluate_checkpoint
from andrea.resources import cpu_name
from andrea.train import checkpoint as ckpt_io
from andrea.train.device import cpu_has_bf16
from andrea.train.loop import train

OPTIMIZERS = ("adamw", "muon")


def plan(preset: str, tokens: int, extra: list[str]) -> tuple[int, int, int]:
    """(steps, tokens per step, warm-up steps) for a budget of about `tokens`."""
    cfg = load_config(preset, extra)
    per_step = cfg.train.global_batch_tokens or 8 * cfg.model.block_size
    steps = -(-tokens // per_step)
    steps = -(-steps // 10) * 10
    return steps, per_step, min(cfg.train.warmup_steps, max(1, steps // 10))


def run_one(optimizer: str, args: argparse.Namespace, steps: int, warmup: int
            ) -> tuple[list[tuple[int, float, float | None]], float]:
    """Train, then evaluate each tenth's checkpoint: [(tokens, val loss, bits/byte)], seconds."""
    tenth = steps // 10
    name = run_name(optimizer, args.tokens, args.set)
    cfg = load_config(args.preset, [
        f"train.optimizer={optimizer}", f"train.max_steps={steps}",
        f"train.warmup_steps={warmup}", f"train.checkpoint_every={tenth}", "train.keep_last=10",
        # The trainer's own evaluation is off: every tenth's checkpoint is evaluated below.
        "train.eval_every=0", f"train.runs_dir={args.runs_dir}", f"train.name={name}",
        *args.set,
    ])
    t0 = time.perf_counter()
    result = train(cfg, progress=False)
    if result.state != "finished":
        raise UserError(f"{result.run_dir}: the {optimizer} run ended {result.state}")
    per_step = result.tokens // steps
    points = []
    for ckpt in ckpt_io.list_checkpoints(result.run_dir):
        step = int(ckpt.name[5:])
        ev = evaluate_checkpoint(str(ckpt), max_tokens=args.eval_tokens, progress=False)
        points.append((step * per_step, ev.loss, ev.bits_per_byte))
    if len(points) != 10:
        raise UserError(f"{result.run_dir}: expected 10 checkpoints, found {len(points)}")
    return points, time.perf_counter() - t0


def run_name(optimizer: str, tokens: int, overrides: list[str]) -> str:
    """quality-<optimizer>-<tokens>[-<key>-<value>...]: one run folder per setting."""
    tags = [re.sub(r"[^A-Za-z0-9._-]+", "_", o.split(".", 1)[-1].replace("=", "-"))
            for o in overrides]
    return "-".join([f"quality-{optimizer}-{tokens}", *tags])


def tokens_to_reach(points: list[tuple[int, float, float | None]], target: float) -> float | None:
    """The first token count at which the val loss reaches target, linear between tenths."""
    prev_tokens, prev_loss = 0, None
    for tokens, loss, _ in points:
        if loss <= target:
            if prev_loss is None or prev_loss == loss:
                return float(tokens)
            return prev_tokens + (tokens - prev_tokens) * (prev_loss - target) / (prev_loss - loss)
        prev_tokens, prev_loss = tokens, loss
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="andrea-12m")
    ap.add_argument("--tokens", type=int, default=7_864_320,
                    help="token budget per optimizer (default: 480 steps of 16,384 tokens, "
                         "about 27 minutes each on 2 CPU cores)")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--eval-tokens", type=int, default=32_768)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a config override for both runs (e.g. train.muon_lr=0.03)")
    ap.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                    help="which optimizers to run (default: both)")
    args = ap.parse_args()
    try:
        steps, per_step, warmup = plan(args.preset, args.tokens, args.set)
        print(f"cpu: {cpu_name()}; bf16 units: {cpu_has_bf16()}")
        print(f"{args.preset}: {steps} steps x {per_step:,} tokens = {steps * per_step:,} tokens "
              f"per optimizer, warm-up {warmup} steps; val on {args.eval_tokens:,} tokens "
              f"spread over the val split; overrides: {' '.join(args.set) or '-'}", flush=True)
        results = {}
        for optimizer in args.optimizers:
            results[optimizer], seconds = run_one(optimizer, args, steps, warmup)
            run_dir = Path(args.runs_dir) / run_name(optimizer, args.tokens, args.set)
            print(f"{optimizer}: trained and evaluated in {seconds:.0f} s (run: {run_dir})",
                  flush=True)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    ran = [opt for opt in OPTIMIZERS if opt in results]
    print(f"\n{'tokens':>11}" + "".join(f"  {opt + ' loss':>10}  {opt + ' bpb':>9}" for opt in ran))
    for row in zip(*(results[opt] for opt in ran), strict=True):
        print(f"{row[0][0]:>11,}" + "".join(
            f"  {loss:>10.4f}  {bpb or float('nan'):>9.4f}" for _, loss, bpb in row))
    for opt in ran:
        best = min(results[opt], key=lambda point: point[1])
        print(f"{opt}: best val loss {best[1]:.4f} ({best[2] or float('nan'):.4f} bits/byte) "
              f"at {best[0]:,} tokens")
    if ran != list(OPTIMIZERS):
        return 0
    target = results["adamw"][-1][1]
    print(f"\ntokens to reach AdamW's final val loss {target:.4f}:")
    needed = {opt: tokens_to_reach(results[opt], target) for opt in OPTIMIZERS}
    for opt, tokens in needed.items():
        print(f"  {opt:6s} {f'{tokens:,.0f}' if tokens is not None else 'not reached'}")
    if needed["muon"] is not None and needed["adamw"]:
        print(f"  muon / adamw: {needed['muon'] / needed['adamw']:.2f} (goal: <= 0.75)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
