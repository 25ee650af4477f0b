"""Figures for train.parallel: per-rank state memory, checkpoint write/load time, and activation
checkpointing's peak memory and speed, each case side by side with its baseline in one run.

    python scripts/bench_parallel.py memory     [--preset andrea-120m]
    python scripts/bench_parallel.py checkpoint [--preset andrea-120m] [--rounds 2]
    python scripts/bench_parallel.py checkpointing [--preset andrea-12m] [--micro-batch 16]
                                                   [--rounds 3]

memory: for 1 process, 2 x ddp and 2 x fsdp (torchrun, gloo), build the model and AdamW as the
trainer does, take one step on a short random batch so gradients and moments exist, then add up
the bytes of the tensors this rank holds: parameters (each once; the local shard of a sharded
one), gradients, optimizer state. DDP's gradient buckets (another 4 B/parameter) are not counted,
which favours ddp. Then the same with train.optimizer muon for 1 process and 2 x fsdp (Muon's
momentum for the block matrices, AdamW's moments for the rest; the whole matrices an owner
orthogonalises exist only during the step and are not counted).

checkpoint: the same set-up, then time writing a checkpoint the way the trainer does (1 process:
whole tensors; 2 x fsdp: every rank its shards, plus model.safetensors gathered on rank 0) and
loading it back into the model and optimizer (rank 0's times; the median over rounds).

checkpointing: scripts/bench_memory.py's one case (its own process, peak RSS and tokens/s), with
and without train.activation_checkpointing: blocks, alternating, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from andrea.resources import cpu_name  # noqa: E402
from andrea.train.process_group import shutdown  # noqa: E402

MIB = 2**20


def build(preset: str, parallel: str, optimizer: str = "adamw"):
    """(cfg, the mode, model, optimizer, names), set up in the trainer's order; parallel is
    train.parallel (anything on one process)."""
    import torch

    from andrea.config import load_config
    from andrea.model.transformer import Andrea
    from andrea.train.optim import build_optimizer
    from andrea.train.parallel import parallel_for
    from andrea.train.process_group import init_distributed

    cfg = load_config(preset, ["train.precision=fp32", "train.micro_batch_size=1",
                               f"train.optimizer={optimizer}"])
    mode = parallel_for(parallel, init_distributed("cpu"))
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = Andrea(cfg.model)
    mode.shard(model, device, bf16_params=False)
    optimizer = build_optimizer(model, cfg, device, mode.dist.world_size, sharded=mode.sharded)
    train_model = mode.wrap(model, None, device)
    x = torch.randint(0, cfg.model.vocab_size, (1, 32))
    train_model(x, x)[1].backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return cfg, mode, model, optimizer, names


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def memory_worker(preset: str, parallel: str, optimizer_name: str) -> dict:
    _, mode, model, optimizer, _ = build(preset, parallel, optimizer_name)
    info = mode.dist
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    shutdown(info)
    return {"rank": info.rank, "params": local_bytes(params),
            "grads": local_bytes(p.grad for p in params), "optimizer": local_bytes(state)}


def checkpoint_worker(preset: str, parallel: str) -> dict:
    import torch

    from andrea.train import checkpoint as ckpt_io
    from andrea.train.collectives import all_gather_bytes, barrier
    from andrea.train.rundir import SHARDS_DIR, TrainerState, has_shards, partial_dir, step_dir_name

    cfg, mode, model, optimizer, names = build(preset, parallel)
    info = mode.dist
    pid = torch.tensor([os.getpid()], dtype=torch.int64).view(torch.uint8)
    root = Path(os.environ["BENCH_DIR"])
    run_dir = root / f"run-{int(all_gather_bytes(pid, info)[0].view(torch.int64).item())}"
    sharded = mode.sharded
    barrier(info)
    t0 = time.perf_counter()
    partial = None
    if sharded:
        partial = partial_dir(run_dir, 1, 0)
        ckpt_io.write_shards(partial / SHARDS_DIR,
                             ckpt_io.sharded_state(model, optimizer, names), info.rank)
    weights = ckpt_io.model_state(model, info.is_main)
    moments = {} if sharded else ckpt_io.optimizer_state(optimizer, names)
    if info.is_main:
        ckpt_io.save_checkpoint(run_dir, TrainerState(step=1), cfg, "bench", model=weights,
                                optimizer=moments, rng={}, keep_last=1, partial=partial)
    barrier(info)
    write_s = time.perf_counter() - t0
    ckpt = run_dir / step_dir_name(1)
    t0 = time.perf_counter()
    if has_shards(ckpt):
        ckpt_io.read_shards(ckpt, model, optimizer, names)
    else:
        tensors = ckpt_io.read_model_checkpoint(ckpt)[0]
        ckpt_io.load_weights(model, tensors, ckpt)
        ckpt_io.load_optimizer(optimizer, names, ckpt)
    barrier(info)
    load_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    barrier(info)
    if info.is_main:
        shutil.rmtree(run_dir)
    shutdown(info)
    return {"rank": info.rank, "write_s": write_s, "load_s": load_s, "bytes": size}


def launch(kind: str, preset: str, processes: int, parallel: str, env: dict,
           optimizer: str = "adamw") -> list[dict]:
    """Run one case in fresh processes; every rank's JSON line."""
    child = [str(Path(__file__)), "--worker", kind, "--preset", preset, "--parallel", parallel,
             "--optimizer", optimizer]
    if processes == 1:
        cmd = [sys.executable, *child]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
               "--master_addr=127.0.0.1", f"--master_port={port}", *child]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode:
        raise SystemExit(f"{kind} {processes} x {parallel} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


CASES = [(1, "none"), (2, "ddp"), (2, "fsdp")]
MEMORY_CASES = [(1, "none", "adamw"), (2, "ddp", "adamw"), (2, "fsdp", "adamw"),
                (1, "none", "muon"), (2, "fsdp", "muon")]


def memory(args: argparse.Namespace) -> None:
    print(f"{args.preset}, float32, on {cpu_name()}: bytes each rank holds after one step")
    print(f"{'case':<19}{'params MiB':>11}{'grads MiB':>11}{'optim MiB':>11}{'total MiB':>11}"
          f"{'vs 2 x ddp':>12}")
    totals = {}
    for processes, parallel, optimizer in MEMORY_CASES:
        ranks = launch("memory", args.preset, processes, parallel, {"OMP_NUM_THREADS": "1"},
                       optimizer)
        worst = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        totals[(processes, parallel, optimizer)] = worst
    ddp = totals[(2, "ddp", "adamw")]
    for (processes, parallel, optimizer), r in totals.items():
        total = r["params"] + r["grads"] + r["optimizer"]
        ratio = total / (ddp["params"] + ddp["grads"] + ddp["optimizer"])
        case = f"{processes} x {parallel}" + (" + muon" if optimizer == "muon" else "")
        print(f"{case:<19}{r['params'] / MIB:>11.1f}"
              f"{r['grads'] / MIB:>11.1f}{r['optimizer'] / MIB:>11.1f}{total / MIB:>11.1f}"
              f"{ratio:>12.3f}", flush=True)


def checkpoint(args: argparse.Namespace) -> None:
    results: dict[tuple[int, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for _ in range(args.rounds):  # alternate the cases, so load hits them alike
            for processes, parallel in [(1, "none"), (2, "fsdp")]:
                ranks = launch("checkpoint", args.preset, processes, parallel,
                               {"OMP_NUM_THREADS": "1", "BENCH_DIR": root})
                rank0 = next(r for r in ranks if r["rank"] == 0)
                results.setdefault((processes, parallel), []).append(rank0)
                print(json.dumps(rank0), file=sys.stderr, flush=True)
    print(f"{args.preset}, float32, on {cpu_name()}: checkpoint write and load (weights and "
          f"AdamW), medians of {args.rounds} rounds")
    print(f"{'case':<12}{'write s':>9}{'load s':>9}{'size MiB':>10}")
    for (processes, parallel), rs in results.items():
        print(f"{f'{processes} x {parallel}':<12}"
              f"{statistics.median(r['write_s'] for r in rs):>9.2f}"
              f"{statistics.median(r['load_s'] for r in rs):>9.2f}{rs[0]['bytes'] / MIB:>10.0f}")


def checkpointing(args: argparse.Namespace) -> None:
    results: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for on in (False, True):
            cmd = [sys.executable, str(HERE / "bench_memory.py"), "--child", "--preset",
                   args.preset, "--micro-batches", str(args.micro_batch), "--only", "chunked",
                   "--warmup", "1", "--steps", str(args.steps)]
            cmd += ["--checkpointing"] if on else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results[on].append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(results[on][-1]), file=sys.stderr, flush=True)
    print(f"{args.preset}, micro-batch {args.micro_batch}, on {cpu_name()}: one training step, "
          f"medians of {args.rounds} alternating rounds x {args.steps} steps")
    base = None
    for on, rs in results.items():
        rss = statistics.median(r["peak_rss_bytes"] for r in rs) / 2**30
        speed = statistics.median(r["tokens_per_s"] for r in rs)
        base = base or (rss, speed)
        print(f"{'blocks' if on else 'none':<8} peak RSS {rss:.2f} GiB ({rss / base[0]:.2f}x), "
              f"{speed:.0f} tokens/s ({speed / base[1]:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=["memory", "checkpoint", "checkpointing"])
    parser.add_argument("--preset", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (a temp dir)")
    parser.add_argument("--worker", choices=["memory", "checkpoint"], help=argparse.SUPPRESS)
    parser.add_argument("--parallel", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="adamw", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker == "memory":
            result = memory_worker(args.preset, args.parallel, args.optimizer)
        else:
            result = checkpoint_worker(args.preset, args.parallel)
        print(json.dumps(result), flush=True)
        return
    default = "andrea-12m" if args.what == "checkpointing" else "andrea-120m"
    args.preset = args.preset or default
    {"memory": memory, "checkpoint": checkpoint, "checkpointing": checkpointing}[args.what](args)


if __name__ == "__main__":
    main()
