"""andrea's training step on one GPU, side by side with a plain compiled loop: the one call.

    python scripts/gpu_speed.py OUTDIR            # on the GPU machine, from the repository root
    python scripts/gpu_speed.py OUTDIR --dry-run  # here, without a GPU: the plumbing, tiny runs

On the GPU machine, through the device tool (.gpu-wheels as for scripts/gpu_check.sh, whose
header says how to fill it):

    run(command="python3 scripts/gpu_speed.py $OUT", carry=[".gpu-wheels"], timeout_s=390)

Parts, each a process of its own under a budget (cut to what is left of RUN_BUDGET_S), run one
after the other so that none slows another; the table printed last (and OUTDIR/speed.json):

  reference    scripts/reference_gpt.py: the plain nanoGPT-style loop, compiled (the yardstick)
  120m         andrea train, ANDREA-120M at 16 x 1024 x 4 micro-batches at the defaults
               (train.compile auto: compiled), inductor's cache empty
  120m-warm    the same again, the cache filled by 120m: the second run's compile; the table's
               last line says whether the two ended at the same loss bit for bit
  120m-plain   as 120m-warm, the loss unchunked inside the compiled graph (F.cross_entropy on
               the whole logits, as the reference; train.loss_chunk_rows=0): what the chunked
               loss costs
  120m-fp32acc as 120m-warm, each loss chunk's weight gradient added into float32 inside its
               matmul (torch.addmm's out_dtype, CUDA only) instead of bf16 products added
               after them, 4 at a time in one pass (transformer.WEIGHT_GRAD_GROUP; the H100's
               profile, one at a time: 160 us a chunk, about 10% of the step)
  120m-chunk4k as 120m-warm, the loss in chunks of 4,096 rows instead of 667 (4 a micro-batch
               of 16 x 1024, not 25; train.loss_chunk_rows=4096): that weight gradient's
               products 4, not 25, added in one pass, not 7
  12m          ANDREA-12M's whole preset run (550 steps) at the defaults (compiled, its steps
               replayed as CUDA graphs: the preset's train.compile_mode reduce-overhead)
  resume       ANDREA-12M as 12m (compiled, CUDA graphs): 16 steps straight, and 8 steps then
               resumed to 16, each a process of its own, the resume after a change of window
               length (step 5); every step's loss and gradient norm must be the same bit for
               bit (the exact-resume promise, under compile, on the GPU)
  12m-cuda,    as 12m and 120m with model.attention=cuda: the project's kernels (TUNED's where
  120m-cuda    it has an entry for this GPU) inside the compiled step, beside SDPA's
  120m-auto    the preset's own micro-batch choice (auto) at the same 65,536 tokens a step
  ddp, fsdp    ANDREA-12M for 8 steps under `torchrun --nproc-per-node 1` with a process group
               of one (ANDREA_PROCESS_GROUP_OF_ONE=1: NCCL), ddp; then fsdp resuming it to 16
               (NorMuon's per-neuron state off in both: fsdp does not shard it yet)
  12m-nographs as 12m with train.compile_mode=default (no CUDA graphs; the preset replays its
               steps as CUDA graphs), cache from 12m: what the graphs gain
  120m-eager   as 120m with train.compile=false
  12m-eager    as 12m with train.compile=false

In that order, what decides most first, so that a slow machine or a smaller `--budget` (seconds
past which no part starts or runs; RUN_BUDGET_S by default) leaves out the least. The order
follows the first GPU run (H100, docs/log.md 2026-12-06): the 120M goal and the two levers its
profile showed (and the loss in fewer chunks), the 12M preset and its resume under CUDA graphs
(its new default), our kernels in training (TUNED has sm_90's entries), then what that run
measured already (the auto micro-batch, NCCL, the 12M step without graphs, the eager baselines).
Each budget is its part's most; together they are more than the run's, so on a slow machine the
last parts are left out.
With the kernel tuner in the same device call, for example: `--budget 400`, then
`scripts/gpu_tune_attention.py --budget 150 --cubins .tune-cubins`, in one call of 590 s, with
the tuner's cubins built before on the CPU (`--prebuild sm_90 --cubins .tune-cubins`) and
carried too (carry=[".gpu-wheels", ".tune-cubins"]): the tuner then compiles nothing there.

A run's tokens/s is the median of its steps' own figures after the first four (as the
reference's), beside the run's figure (warm-up steps left out, docs/metrics.md); the compile is
the warm-up steps' seconds. `--profile` parts also write the top CUDA kernels of their steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RUN_BUDGET_S = 360  # no part starts or runs past it; the device call's timeout_s is 390
STEPS_120M = 16
BATCH_120M = ("train.micro_batch_size=16", "train.global_batch_tokens=65536")
QUIET = ("train.eval_every=0", "train.checkpoint_every=0", "train.keep_last=1", "train.log_every=1")

# name, budget s; in the order of the docstring's list.
# The exact-resume check comes right after the first 12M run: it decides whether compiling by
# default keeps the promise.
PARTS: list[tuple[str, int]] = [
    ("reference", 60), ("120m", 80), ("120m-warm", 40), ("120m-plain", 60), ("120m-fp32acc", 45),
    ("120m-chunk4k", 45), ("12m", 90), ("resume", 95), ("12m-cuda", 90), ("120m-cuda", 80),
    ("120m-auto", 45), ("ddp", 30), ("fsdp", 30), ("12m-nographs", 80), ("120m-eager", 40),
    ("12m-eager", 45),
]
RESUME_STEPS = 16


def add_in_float32(grad_weight: Any, grad_logits: Any, h: Any) -> None:
    """transformer.add_weight_grad with the product added into float32 inside the matmul
    (torch.addmm's out_dtype: CUDA only), not rounded to bf16 and added after it."""
    import torch

    torch.addmm(grad_weight, grad_logits.t(), h, out_dtype=grad_weight.dtype, out=grad_weight)


def andrea_run(args: argparse.Namespace) -> None:
    """One andrea training in this process (a part's process): its figures to --json."""
    import torch

    from andrea.config import load_config
    from andrea.model import transformer
    from andrea.runs import read_metrics
    from andrea.train.loop import train

    if args.fp32_accumulate:
        transformer.add_weight_grad = add_in_float32
        transformer.WEIGHT_GRAD_GROUP = 1  # every chunk's through it, none grouped
    cfg = load_config(args.preset, args.set)
    profiler = None
    if args.profile and torch.cuda.is_available():
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        profiler.__enter__()
    t0 = time.perf_counter()
    result = train(cfg, overwrite=args.resume is None, progress=False, resume=args.resume)
    wall = time.perf_counter() - t0
    if profiler is not None:
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        Path(args.json).with_suffix(".profile.txt").write_text(table)
    records, _ = read_metrics(result.run_dir / "metrics.jsonl")
    trains = [r for r in records if r["event"] == "train"]
    end = next(r for r in reversed(records) if r["event"] == "end")
    evals = [r for r in records if r["event"] == "eval"]
    rates = [r["tokens_per_s"] for r in trains][4:] or [r["tokens_per_s"] for r in trains]
    out = {
        "state": result.state, "steps": result.steps, "wall_s": round(wall, 1),
        "median_tokens_per_s": round(statistics.median(rates), 1) if rates else None,
        "tokens_per_s": end.get("tokens_per_s"), "mfu": end.get("mfu"),
        "train_seconds": end.get("train_seconds"), "warmup_seconds": end.get("warmup_seconds"),
        "warmup_steps": end.get("warmup_steps"),
        "last_loss": trains[-1]["loss"] if trains else None,
        "val_loss": evals[-1].get("val_loss") if evals else None,
        "val_bpb": evals[-1].get("val_bpb") if evals else None,
    }
    print(json.dumps(out))
    Path(args.json).write_text(json.dumps(out))


def resume_check(args: argparse.Namespace) -> None:
    """ANDREA-12M (compile at its default) RESUME_STEPS steps straight, and half of them then
    resumed to the end, each run a process of its own as a user's would be, the resume after
    the sequence warm-up's change of window length: every step's loss and gradient norm must
    agree bit for bit. To --json: identical (true/false) and the first step that differs."""
    from andrea.runs import read_metrics

    quiet = [*args.set, "train.eval_every=0", "train.log_every=1", "train.seq_warmup_length=32",
             "train.seq_warmup_steps=4"]
    half = RESUME_STEPS // 2
    runs = Path(next(a for a in args.set if a.startswith("train.runs_dir=")).split("=", 1)[1])
    me = [sys.executable, str(Path(__file__).resolve()), "--run-andrea", "--preset", args.preset]
    for extra, sets in (
        ([], ["train.name=straight", f"train.max_steps={RESUME_STEPS}"]),
        ([], ["train.name=split", f"train.max_steps={half}", f"train.checkpoint_every={half}"]),
        (["--resume", str(runs / "split")], ["train.name=split",
                                             f"train.max_steps={RESUME_STEPS}"]),
    ):
        subprocess.run([*me, *extra, "--json", str(Path(args.json).with_suffix(".run.json")),
                        "--set", *quiet, *sets], check=True)

    def steps(name: str) -> dict[int, tuple[float, float]]:
        records, _ = read_metrics(runs / name / "metrics.jsonl")
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if r["event"] == "train"}

    straight, split = steps("straight"), steps("split")
    differing = [s for s in range(1, RESUME_STEPS + 1) if straight.get(s) != split.get(s)]
    out = {"identical": not differing, "first_difference": differing[0] if differing else None,
           "straight": straight.get(RESUME_STEPS), "split": split.get(RESUME_STEPS)}
    print(json.dumps(out))
    Path(args.json).write_text(json.dumps(out))


def part_command(name: str, work: Path, out: Path, dry: bool) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one part."""
    py = [sys.executable]
    me = [*py, str(Path(__file__).resolve()), "--run-andrea"]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    data_120m = f"data.dir={work / 'data-gpt2'}"
    data_12m = f"data.dir={work / 'data-bpe'}"
    runs = f"train.runs_dir={work / 'runs'}"
    big = ["--preset", "andrea-120m", "--set", data_120m, runs,
           f"train.max_steps={STEPS_120M}", *QUIET, *BATCH_120M]
    small = ["--preset", "andrea-12m", "--set", data_12m, runs]
    if dry:  # the plumbing on a CPU: the tiny preset, a few steps
        big = ["--preset", "andrea-tiny", "--set", f"data.dir={work / 'data-byte'}", runs,
               "train.max_steps=6", *QUIET, "train.micro_batch_size=2",
               "train.global_batch_tokens=256"]
        small = ["--preset", "andrea-tiny", "--set", f"data.dir={work / 'data-byte'}", runs,
                 "train.max_steps=6", "train.eval_every=3"]
    j = ["--json", str(out / f"{name}.json")]
    if name == "reference":
        return [*py, str(REPO / "scripts" / "reference_gpt.py"), *j,
                *(["--dry-run"] if dry else [])], env
    if name == "120m-eager":
        return [*me, *j, *big, "train.compile=false", "train.name=eager"], env
    if name == "120m":
        return [*me, *j, *big, "train.name=compiled"], env
    if name == "120m-warm":
        return [*me, *j, "--profile", *big, "train.name=warm"], env
    if name == "120m-auto":
        auto = [a for a in big if not a.startswith("train.micro_batch_size")]
        return [*me, *j, *auto, "train.micro_batch_size=auto", "train.name=auto"], env
    if name == "120m-plain":
        return [*me, *j, *big, "train.loss_chunk_rows=0", "train.name=plain"], env
    if name == "120m-fp32acc":  # out_dtype has no CPU kernel: a dry run checks the plumbing
        return [*me, *j, *([] if dry else ["--fp32-accumulate"]), *big, "train.name=fp32acc"], env
    if name == "120m-chunk4k":
        return [*me, *j, *big, "train.loss_chunk_rows=4096", "train.name=chunk4k"], env
    if name == "12m-eager":
        return [*me, *j, *small, "train.compile=false", "train.name=s-eager"], env
    if name == "12m":
        return [*me, *j, *small, "train.name=s-compiled"], env
    # the kernels need a GPU: a dry run checks these parts' plumbing with the default attention
    cuda = [] if dry else ["model.attention=cuda"]
    if name == "12m-cuda":
        return [*me, *j, *small, *cuda, "train.name=s-cuda"], env
    if name == "120m-cuda":
        return [*me, *j, *big, *cuda, "train.name=cuda"], env
    if name == "12m-nographs":
        return [*me, *j, *small, "train.compile_mode=default", "train.name=s-nographs"], env
    if name == "resume":
        return [*py, str(Path(__file__).resolve()), "--resume-check", *j, *small], env
    torchrun = [*py, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone"]
    env["ANDREA_PROCESS_GROUP_OF_ONE"] = "1"
    # NorMuon's per-neuron state is not sharded under fsdp (a one-line refusal): off in both,
    # so that fsdp resumes ddp's run.
    nccl = [*(a for a in small if a != "train.eval_every=3"), "train.muon_neuron_beta2=0"]
    if name == "ddp":
        return [*torchrun, str(Path(__file__).resolve()), "--run-andrea", *j, *nccl,
                "train.max_steps=8", "train.parallel=ddp", "train.name=nccl", "train.eval_every=0",
                "train.checkpoint_every=4"], env
    if name == "fsdp":
        return [*torchrun, str(Path(__file__).resolve()), "--run-andrea", *j,
                "--resume", str(work / "runs" / "nccl"), *nccl, "train.max_steps=16",
                "train.parallel=fsdp", "train.name=nccl", "train.eval_every=0"], env
    raise ValueError(name)


def install_wheels(work: Path, outdir: Path) -> str:
    """What the GPU image lacks, from .gpu-wheels (scripts/gpu_check.sh's header), into a
    folder on PYTHONPATH: gpu_check's own installer. The PYTHONPATH the parts run with."""
    site = work / "site"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check_report.py"), "deps",
                           str(REPO / ".gpu-wheels"), str(site), str(work / "tools")],
                          capture_output=True, text=True, timeout=60)
    (outdir / "wheels.log").write_text(proc.stdout + proc.stderr)
    print(f"[setup] wheels: {(proc.stdout.strip().splitlines() or ['?'])[-1]}", flush=True)
    return os.pathsep.join([str(REPO), str(site), os.environ.get("PYTHONPATH", "")])


def run_parts(outdir: Path, dry: bool, run_budget: float = RUN_BUDGET_S,
              names: list[str] | None = None) -> int:
    """Runs PARTS (those in `names` only, in PARTS' order, when given) one after the other."""
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="andrea-gpu-speed-"))
    pythonpath = install_wheels(work, outdir)
    results: dict[str, Any] = {}
    rows = []
    environment = {"python": sys.version.split()[0], "dry_run": dry}
    try:
        import torch

        environment.update(torch=torch.__version__, cuda=torch.version.cuda,
                           gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    except ImportError:
        pass
    environment["nvidia_smi"] = subprocess.run(
        "nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader",
        shell=True, capture_output=True, text=True).stdout.strip()
    print(json.dumps(environment), flush=True)
    for name, budget in PARTS:
        if names is not None and name not in names:
            continue
        left = run_budget - (time.monotonic() - start)
        limit = int(min(budget, left))
        if limit < 5:
            rows.append((name, "not run: the run's budget is spent", None))
            continue
        if name == "120m":  # a cold compile: inductor's cache as a new machine has it
            shutil.rmtree(work / "inductor", ignore_errors=True)
        command, env = part_command(name, work, outdir, dry)
        log = outdir / f"{name}.log"
        t0 = time.monotonic()
        try:
            proc = subprocess.run(command, env={**os.environ, **env, "PYTHONUNBUFFERED": "1",
                                                "PYTHONPATH": pythonpath},
                                  stdout=log.open("w"), stderr=subprocess.STDOUT, timeout=limit,
                                  cwd=REPO)
            status = "ok" if proc.returncode == 0 else f"rc {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"over its {limit} s"
        took = time.monotonic() - t0
        figures = outdir / f"{name}.json"
        results[name] = json.loads(figures.read_text()) if figures.is_file() else None
        if name == "resume" and status == "ok" and not (results[name] or {}).get("identical"):
            status = f"FAIL: a resumed step differs: {results[name]}"
        if status != "ok":
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            status += ": " + " | ".join(tail)[-300:]
        rows.append((name, status, round(took, 1)))
        print(f"[{name}] {took:.0f} s: {status}", flush=True)
    (outdir / "speed.json").write_text(json.dumps({"environment": environment, "parts": results,
                                                   "status": rows}, indent=1))
    print_table(results, rows)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(status == "ok" for _, status, _ in rows) else 1


def print_table(results: dict[str, Any], rows: list[tuple[str, str, float | None]]) -> None:
    ref = (results.get("reference") or {}).get("median_tokens_per_s")
    print(f"\n{'part':<12} {'status':<6} {'s':>5} {'tok/s med':>10} {'run tok/s':>10} {'x ref':>6} "
          f"{'mfu':>6} {'compile':>8} {'train s':>8} {'loss':>7} {'val bpb':>8}")
    for name, status, took in rows:
        r = results.get(name) or {}
        med = r.get("median_tokens_per_s")
        ratio = f"{med / ref:.3f}" if med and ref else "-"
        compile_s = r.get("first_step_s", r.get("warmup_seconds"))

        def fmt(v: Any, spec: str) -> str:
            return format(v, spec) if isinstance(v, int | float) else "-"

        print(f"{name:<12} {status[:6]:<6} {fmt(took, '5.0f')} {fmt(med, '10.0f')} "
              f"{fmt(r.get('tokens_per_s'), '10.0f')} {ratio:>6} {fmt(r.get('mfu'), '6.3f')} "
              f"{fmt(compile_s, '8.1f')} {fmt(r.get('train_seconds'), '8.2f')} "
              f"{fmt(r.get('last_loss'), '7.4f')} {fmt(r.get('val_bpb'), '8.4f')}")
    line = repeat_line(results)
    if line:
        print(line)


def repeat_line(results: dict[str, Any]) -> str | None:
    """Whether 120m and 120m-warm, the same config and seed in two processes, ended at the same
    loss bit for bit (what exact resume needs of the 120M step; the resume part checks 12M)."""
    first, again = ((results.get(n) or {}).get("last_loss") for n in ("120m", "120m-warm"))
    if first is None or again is None:
        return None
    verdict = "the same bits" if first == again else "DIFFER (a step whose bits do not repeat)"
    return f"120m and 120m-warm, the same run twice: last loss {first!r} and {again!r}: {verdict}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", nargs="?")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--budget", type=float, default=RUN_BUDGET_S,
                        help=f"seconds past which no part starts or runs (default {RUN_BUDGET_S})")
    parser.add_argument("--parts", help="the parts to run, comma-separated (default: all)")
    parser.add_argument("--run-andrea", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--resume-check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--set", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fp32-accumulate", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_andrea:
        andrea_run(args)
        return 0
    if args.resume_check:
        resume_check(args)
        return 0
    if not args.outdir:
        parser.error("give OUTDIR")
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    names = args.parts.split(",") if args.parts else None
    unknown = sorted(set(names or ()) - {name for name, _ in PARTS})
    if unknown:
        parser.error(f"--parts: no part {', '.join(unknown)}; the parts: "
                     f"{', '.join(name for name, _ in PARTS)}")
    return run_parts(outdir.resolve(), args.dry_run, args.budget, names)


if __name__ == "__main__":
    sys.exit(main())
