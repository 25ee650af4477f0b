"""The optimizer's share of an ANDREA-12M step: AdamW against Muon (bf16 and fp32 Newton-Schulz),
and Muon's step with its Newton-Schulz work split over 2 processes against 1.

    python scripts/bench_muon_step.py [--preset andrea-12m] [--rounds 5] [--fwd-bwd-rounds 3]
                                      [--ns-precision auto] [--no-split]

Each side is `andrea.train.optim.build_optimizer` for the same model (train.optimizer adamw, muon
with train.muon_ns_precision bf16, muon with fp32), stepping on the same fixed gradients. Rounds
alternate between the three so a noisy, shared machine slows all alike; figures are medians of
optimizer.step() in milliseconds. For scale, one fp32 forward + backward at the preset's micro-
batch x block_size is timed in the same run. Prints the CPU's name and whether it has bf16 units
(the check that picks muon_ns_precision auto).

Then the split (andrea/train/muon.py, SplitMuon): the same Muon step timed in fresh processes, one
thread each (OMP_NUM_THREADS=1, as each rank would have its own device): 1 process; 2 processes
under ddp as before the split (every rank orthogonalises every matrix); 2 x ddp split (each rank
its share, then an all-gather); 2 x fsdp split (row shards all-to-all to the owners and back).
Gloo on one machine; figures are medians over --rounds steps of the slowest rank, a barrier before
each step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from andrea.config import load_config
from andrea.model.transformer import Andrea
from andrea.resources import cpu_name
from andrea.train.collectives import barrier
from andrea.train.device import cpu_has_bf16, pick_dtype
from andrea.train.optim import build_optimizer
from andrea.train.process_group import init_distributed, shutdown
from andrea.train.sharding import shard_like, shard_model

SIDES = {"adamw": ["train.optimizer=adamw"],
         "muon bf16 NS": ["train.optimizer=muon", "train.muon_ns_precision=bf16"],
         "muon fp32 NS": ["train.optimizer=muon", "train.muon_ns_precision=fp32"]}


SPLIT_CASES = {"1 process": (1, "none"), "2 x ddp, unsplit": (2, "unsplit"),
               "2 x ddp, split": (2, "ddp"), "2 x fsdp, split": (2, "fsdp")}


def split_worker(preset: str, layout: str, precision: str, rounds: int) -> dict:
    """One rank: Muon's optimizer.step() times in ms (the first, a warm-up, dropped)."""
    info = init_distributed("cpu")
    cfg = load_config(preset, ["train.optimizer=muon", f"train.muon_ns_precision={precision}"])
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    if layout == "fsdp":
        shard_model(model, info, torch.device("cpu"), bf16_params=False)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = shard_like(torch.randn(p.shape, generator=gen) * 1e-3, p)
    # unsplit: every rank steps alone on the whole matrices, as ddp did before the split.
    world = 1 if layout == "unsplit" else info.world_size
    opt = build_optimizer(model, cfg, torch.device("cpu"), world)
    times = []
    for _ in range(rounds + 1):
        barrier(info)
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    barrier(info)
    shutdown(info)
    return {"rank": info.rank, "ms": statistics.median(times[1:])}


def split_case(preset: str, processes: int, layout: str, precision: str, rounds: int) -> float:
    """The slowest rank's median step in ms, in fresh processes of one thread each."""
    child = [str(Path(__file__)), "--worker", layout, "--preset", preset,
             "--ns-precision", precision, "--rounds", str(rounds)]
    if processes > 1:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        child = ["-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                 "--master_addr=127.0.0.1", f"--master_port={port}", *child]
    proc = subprocess.run([sys.executable, *child], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"{processes} x {layout} failed:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return max(r["ms"] for r in ranks)


def split_table(args: argparse.Namespace) -> None:
    precision = args.ns_precision
    if precision == "auto":
        precision = "bf16" if pick_dtype("auto", torch.device("cpu")) == torch.bfloat16 else "fp32"
    print(f"{args.preset}, Muon optimizer.step() across processes, {precision} Newton-Schulz, "
          f"1 thread per process, median over {args.rounds} steps of the slowest rank:")
    base = None
    for name, (processes, layout) in SPLIT_CASES.items():
        ms = split_case(args.preset, processes, layout, precision, args.rounds)
        base = base or ms
        print(f"  {name:18s} {ms:9.1f} ms   x{ms / base:5.2f} of 1 process", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="andrea-12m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fwd-bwd-rounds", type=int, default=3)
    ap.add_argument("--ns-precision", default="auto", choices=["auto", "bf16", "fp32"],
                    help="Newton-Schulz dtype of the split rows")
    ap.add_argument("--no-split", action="store_true", help="skip the rows across processes")
    ap.add_argument("--worker", choices=["none", "unsplit", "ddp", "fsdp"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(split_worker(args.preset, args.worker, args.ns_precision, args.rounds)),
              flush=True)
        return

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
          f"(median of {args.fwd_bwd_rounds})", flush=True)
    if not args.no_split:
        split_table(args)


if __name__ == "__main__":
    main()
