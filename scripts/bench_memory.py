"""Peak memory and speed of one training step: the chunked loss against the full-logits loss.

    python scripts/bench_memory.py [--preset andrea-120m] [--micro-batches 2 4] [--rounds 2]
                                   [--steps 2] [--precision auto] [--only chunked]

Each case (loss form x micro-batch) runs in its own subprocess, so its peak RSS
(resource.getrusage ru_maxrss) is its own: build the model and AdamW, then warm-up + steps of
forward, backward, clip and optimizer step on random tokens at micro-batch B x block_size.
Rounds alternate the cases so a busy machine slows them alike; figures are medians. "full" is the
form before the change (the [B*T, vocab] float32 logits materialised, Andrea.loss_chunk_rows =
None); "chunked" is the default. --checkpointing adds activation checkpointing to the cases.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

from andrea.resources import cpu_name


def one_case(preset: str, micro_batch: int, loss: str, precision: str, checkpointing: bool,
             warmup: int, steps: int) -> dict:
    import torch
    from bench_train import plain_step_seconds  # scripts/ is on sys.path when run as a script

    from andrea.config import load_config
    from andrea.model.transformer import Andrea
    from andrea.train.device import pick_dtype
    from andrea.train.optim import build_optimizer

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = load_config(preset, [f"train.micro_batch_size={micro_batch}"])
    dtype = pick_dtype(precision, torch.device("cpu"))
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    if loss == "full":
        model.loss_chunk_rows = None
    model.checkpoint_blocks = checkpointing
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    b, t = micro_batch, cfg.model.block_size
    seconds = [plain_step_seconds(model, opt, dtype, b, 1.0)
               for _ in range(warmup + steps)][warmup:]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "preset": preset, "micro_batch": micro_batch, "block_size": t, "loss": loss,
        "checkpointing": checkpointing, "precision": str(dtype).removeprefix("torch."),
        "peak_rss_bytes": peak, "base_rss_bytes": base_rss, "n_params": model.num_params(),
        "tokens_per_s": b * t / statistics.median(seconds), "step_seconds": seconds,
    }


def run_child(args: argparse.Namespace, micro_batch: int, loss: str, checkpointing: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--preset", args.preset, "--precision",
           args.precision, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--micro-batches", str(micro_batch), "--only", loss]
    if checkpointing:
        cmd.append("--checkpointing")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"micro_batch": micro_batch, "loss": loss, "checkpointing": checkpointing,
                "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="andrea-120m")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--only", choices=["full", "chunked"], default=None)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_case(args.preset, args.micro_batches[0], args.only, args.precision,
                                  args.checkpointing, args.warmup, args.steps)))
        return

    losses = [args.only] if args.only else ["full", "chunked"]
    results: dict[tuple[int, str], list[dict]] = {}
    for _ in range(args.rounds):
        for micro_batch in args.micro_batches:
            for loss in losses:
                r = run_child(args, micro_batch, loss, args.checkpointing)
                results.setdefault((micro_batch, loss), []).append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)

    print(f"\n{args.preset} on {cpu_name()}, {args.precision} precision, "
          f"{'activation checkpointing, ' if args.checkpointing else ''}"
          f"medians of {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up")
    print(f"{'micro-batch':<14}{'loss':<9}{'peak RSS GiB':>13}{'tokens/s':>10}"
          f"{'RSS vs full':>12}{'speed vs full':>14}")
    for micro_batch in args.micro_batches:
        medians = {}
        for loss in losses:
            ok = [r for r in results[(micro_batch, loss)] if "error" not in r]
            if not ok:
                print(f"{micro_batch:<14}{loss:<9}  failed: {results[(micro_batch, loss)][0]}")
                continue
            rss = statistics.median(r["peak_rss_bytes"] for r in ok) / 2**30
            speed = statistics.median(r["tokens_per_s"] for r in ok)
            medians[loss] = (rss, speed)
            ratio = ("" if loss == "full" or "full" not in medians else
                     f"{rss / medians['full'][0]:>12.2f}{speed / medians['full'][1]:>14.2f}")
            shape = f"{micro_batch} x {ok[0]['block_size']}"
            print(f"{shape:<14}{loss:<9}{rss:>13.2f}"
                  f"{speed:>10.1f}{ratio}")
    if args.json:
        print(json.dumps({f"{k[0]}/{k[1]}": v for k, v in results.items()}))


if __name__ == "__main__":
    main()
