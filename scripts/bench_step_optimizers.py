"""`andrea bench`'s training step (andrea.bench.bench_train) for AdamW and Muon, at the preset's
batch (its global_batch_tokens as accumulated micro-batches, one optimizer step) and at one
micro-batch a step (what `andrea bench` timed before issue 43), alternated in one invocation:

    python scripts/bench_step_optimizers.py [--preset andrea-12m] [--rounds 2] [--steps 3]

Prints each timing, the medians and Muon's share of AdamW's tokens/s at each batch, with the CPU.
Muon's orthogonalisation runs once per optimizer step, so a step of one micro-batch overstates
its share of a training step that accumulates several.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from andrea.bench import bench_train
from andrea.config import load_config
from andrea.resources import cpu_name
from andrea.train.device import pick_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="andrea-12m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per case")
    args = parser.parse_args()
    device = pick_device("auto")
    micro = load_config(args.preset).train.micro_batch_size
    one = ["train.global_batch_tokens=0",
           f"train.micro_batch_size={micro if isinstance(micro, int) else 16}"]
    cases = {
        "adamw, preset batch": ["train.optimizer=adamw"],
        "muon, preset batch": ["train.optimizer=muon"],
        "adamw, 1 micro-batch a step": ["train.optimizer=adamw", *one],
        "muon, 1 micro-batch a step": ["train.optimizer=muon", *one],
    }
    name = cpu_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"{args.preset} on {name}, {torch.get_num_threads()} threads", flush=True)
    got: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case, sets in cases.items():
            row = bench_train(args.preset, "sdpa", device, args.steps, 1, sets)
            got[case].append(row.tokens_per_s)
            print(f"{case}: {row.micro_batch_size} x {row.block_size} x {row.accumulation}, "
                  f"{row.step_ms:,.0f} ms a step, {row.tokens_per_s:,.0f} tokens/s", flush=True)
    median = {case: statistics.median(v) for case, v in got.items()}
    for case, v in median.items():
        print(f"median {case}: {v:,.0f} tokens/s")
    for batch in ("preset batch", "1 micro-batch a step"):
        print(f"muon / adamw, {batch}: {median[f'muon, {batch}'] / median[f'adamw, {batch}']:.3f}")


if __name__ == "__main__":
    main()
