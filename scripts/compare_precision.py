"""fp16 with loss scaling against fp32: the tiny preset trained the same way in each, the fp16
run with an overflow forced at one step (ANDREA_FAULTS's overflow@STEP; --overflow-at 0: none).

    python scripts/compare_precision.py [--steps 200] [--overflow-at 100] [--out DIR]

Prints, per run, the final train loss, the val loss, the overflow steps and tokens/s; then the
largest and the mean |loss_fp16 - loss_fp32| over the steps before the overflow, after it, and
over the last 20; and what the forced overflow cost (the steps skipped, the scale before and
after). The runs are in-process and sequential: on a busy machine their tokens/s differ by load.
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
    faults.install(fault)
    try:
        cfg = load_config("andrea-tiny", [
            f"train.runs_dir={out}", f"train.name={name}", f"train.max_steps={steps}",
            f"train.precision={precision}", "train.log_every=1", f"train.eval_every={steps}",
            "train.checkpoint_every=0", f"data.dir={out / 'data'}"])
        result = train(cfg, progress=False)
    finally:
        faults.install(None)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").open()]
    end = next(r for r in records if r["event"] == "end")
    return {
        "name": name, "losses": result.losses, "val": result.last_val_loss,
        "overflows": [r for r in records if r["event"] == "overflow"],
        "scales": {r["step"]: r.get("loss_scale") for r in records if r["event"] == "train"},
        "tokens_per_s": end.get("tokens_per_s") or end.get("median_tokens_per_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--overflow-at", type=int, default=100)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
