"""fp16 with loss scaling against fp32: the tiny preset trained the same way in each, the fp16
run with an overflow forced at one step (ANDREA_FAULTS's overflow@STEP; --overflow-at 0: none).

    python scripts/compare_precision.py [--steps 200] [--overflow-at 100] [--out DIR]

Prints, per run, the final train loss, the val loss, the overflow steps and tokens/s; then the
largest and the mean |loss_fp16 - loss_fp32| over the steps before the overflow, after it, and
over the last 20; and what the forced overflow cost (the steps skipped, the scale before and
after). The runs are in-process and sequential: on a busy machine their tokens/s differ by load,
so the speed of fp16 autocast against fp32 is measured apart (--speed-only for it alone): one
forward and backward of the tiny model at 8 x 64, the dtypes interleaved, the fastest of 7 each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from andrea import faults
from andrea.config import load_config
from andrea.resources import cpu_name
from andrea.train.loop import train


def run(out: Path, name: str, steps: int, precision: str, fault: str | None) -> dict:
    """Train the run (unless OUT/NAME already holds it, finished) and read its metrics."""
    metrics = out / name / "metrics.jsonl"
    if not (metrics.exists() and '"state": "finished"' in metrics.read_text()):
        faults.install(fault)
        try:
            train(load_config("andrea-tiny", [
                f"train.runs_dir={out}", f"train.name={name}", f"train.max_steps={steps}",
                f"train.precision={precision}", "train.log_every=1", f"train.eval_every={steps}",
                "train.checkpoint_every=0", f"data.dir={out / 'data'}"]), progress=False)
        finally:
            faults.install(None)
    records = [json.loads(line) for line in metrics.open()]
    end = next(r for r in records if r["event"] == "end")
    return {
        "name": name, "val": next(r["val_loss"] for r in records if r["event"] == "eval"),
        "losses": {r["step"]: r["loss"] for r in records if r["event"] == "train"},
        "overflows": [r for r in records if r["event"] == "overflow"],
        "scales": {r["step"]: r.get("loss_scale") for r in records if r["event"] == "train"},
        "tokens_per_s": end.get("tokens_per_s") or end.get("median_tokens_per_s"),
    }


def speed(rounds: int = 7) -> None:
    import time

    import torch

    from andrea.model.transformer import Andrea

    cfg = load_config("andrea-tiny")
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (8, cfg.model.block_size + 1))
    best = {torch.float32: float("inf"), torch.float16: float("inf")}
    for _ in range(rounds):
        for dtype in best:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            best[dtype] = min(best[dtype], time.perf_counter() - t0)
    fp32, fp16 = best.values()
    print(f"forward+backward, 8 x 64, fastest of {rounds}: fp32 {fp32 * 1e3:.1f} ms, fp16 "
          f"autocast {fp16 * 1e3:.1f} ms ({fp16 / fp32:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--overflow-at", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--speed-only", action="store_true")
    args = parser.parse_args()
    if args.speed_only:
        print(f"cpu: {cpu_name()}")
        return speed()
    out = args.out or Path(tempfile.mkdtemp(prefix="compare-precision-"))
    k = args.overflow_at
    fp16 = run(out, "fp16", args.steps, "fp16", f"overflow@{k}" if k else None)
    fp32 = run(out, "fp32", args.steps, "fp32", None)
    print(f"cpu: {cpu_name()}; andrea-tiny, {args.steps} steps")
    for r in (fp32, fp16):
        print(f"{r['name']:>14}: final loss {r['losses'][args.steps]:.4f}, val {r['val']:.4f}, "
              f"overflow steps {len(r['overflows'])}, {r['tokens_per_s']:,.0f} tokens/s")
    diffs = {s: abs(fp16["losses"][s] - fp32["losses"][s]) for s in range(1, args.steps + 1)}
    spans = {"all steps": range(1, args.steps + 1), "before the overflow": range(1, k or 1),
             "after it": range(k + 1 if k else args.steps + 1, args.steps + 1),
             "the last 20": range(args.steps - 19, args.steps + 1)}
    for label, steps in spans.items():
        if steps:
            got = [diffs[s] for s in steps]
            print(f"|loss fp16 - fp32|, {label}: max {max(got):.4f}, mean "
                  f"{statistics.mean(got):.4f}")
    if k:
        skipped = [o["step"] for o in fp16["overflows"]]
        print(f"overflow@{k}: skipped steps {skipped}, loss scale {fp16['scales'].get(k - 1)} "
              f"-> {fp16['scales'].get(k)}")
    speed()


if __name__ == "__main__":
    main()
