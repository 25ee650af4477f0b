"""Training throughput: the trainer against a plain PyTorch loop over the same model.

    python scripts/bench_train.py [--preset andrea-12m] [--steps 8] [--warmup 3] [--rounds 3]

Both sides run ANDREA-12M at micro-batch 8 x 256 with no accumulation, AdamW, global-norm
clipping, in fp32 and under bf16 autocast. The plain loop draws random token batches and does
only forward, backward, clip, step; the trainer is `andrea.train.loop.train` (data loader,
schedule, logging, progress bar, finite checks) with evaluation and periodic checkpoints off.
Rounds alternate between the two so that a noisy, shared machine slows both alike; the figures
are medians of the per-step tokens/s after warm-up, and the overhead is 1 - trainer / plain.
The table's line (and --json's "cpu") names the CPU they are of.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from andrea.config import load_config
from andrea.data.prepare import ensure_prepared
from andrea.model.transformer import Andrea
from andrea.resources import cpu_name
from andrea.train.loop import train
from andrea.train.optim import build_optimizer


def plain_step_seconds(model: Andrea, opt: torch.optim.Optimizer, dtype: torch.dtype,
                       batch: int, clip: float) -> float:
    """One plain step on random tokens: forward under autocast, backward, clip, optimizer
    step. Returns its wall time. Also the baseline step of scripts/bench_memory.py."""
    vocab, block = model.cfg.vocab_size, model.cfg.block_size
    x = torch.randint(0, vocab, (batch, block))
    y = torch.randint(0, vocab, (batch, block))
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()
    return time.perf_counter() - t0


def plain_loop(cfg, dtype: torch.dtype, steps: int, warmup: int) -> list[float]:
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    b, t = cfg.train.micro_batch_size, cfg.model.block_size
    seconds = [plain_step_seconds(model, opt, dtype, b, cfg.train.grad_clip)
               for _ in range(warmup + steps)]
    return [b * t / s for s in seconds[warmup:]]


def trainer_loop(cfg, precision: str, steps: int, warmup: int, root: Path) -> list[float]:
    run_cfg = load_config(
        cfg.source,
        [
            f"data.dir={cfg.data.dir}", f"train.runs_dir={root}", f"train.precision={precision}",
            f"train.max_steps={warmup + steps}", "train.global_batch_tokens=0",
            f"train.micro_batch_size={cfg.train.micro_batch_size}",
            "train.eval_every=0", "train.checkpoint_every=0", "train.log_every=1",
            "train.name=bench",
        ],
    )
    train(run_cfg, overwrite=True, progress=True)
    lines = (root / "bench" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    rates = [r["tokens_per_s"] for r in records if r["event"] == "train"]
    return rates[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="andrea-12m")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="andrea-bench-"))
    cfg = load_config(args.preset, [f"data.dir={root / 'data'}", "train.micro_batch_size=8"])
    ensure_prepared(cfg)
    results: dict[str, dict[str, list[float]]] = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        plain, trainer = [], []
        for _ in range(args.rounds):
            plain += plain_loop(cfg, dtype, args.steps, args.warmup)
            trainer += trainer_loop(cfg, precision, args.steps, args.warmup, root / "runs")
        results[precision] = {"plain": plain, "trainer": trainer}

    print(f"\n{args.preset}, micro-batch {cfg.train.micro_batch_size} x {cfg.model.block_size}, "
          f"on {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"medians of {args.rounds} x {args.steps} steps after {args.warmup} warm-up")
    print(f"{'precision':<10}{'plain tok/s':>14}{'trainer tok/s':>16}{'overhead':>10}")
    summary = {}
    for precision, r in results.items():
        plain, trainer = statistics.median(r["plain"]), statistics.median(r["trainer"])
        summary[precision] = {"plain": plain, "trainer": trainer, "overhead": 1 - trainer / plain}
        print(f"{precision:<10}{plain:>14,.0f}{trainer:>16,.0f}{1 - trainer / plain:>10.1%}")
    if args.json:
        print(json.dumps({"cpu": cpu_name(), "summary": summary, "samples": results}))


if __name__ == "__main__":
    main()
