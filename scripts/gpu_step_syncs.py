"""A training step's waits on the GPU: how often ANDREA-12M's step makes the host wait for the
device, from which lines, and how long the step takes, at 1 and at 8 micro-batches a step.

    python scripts/gpu_step_syncs.py DATA OUT.json [--preset andrea-12m] [--device cuda]

A synchronisation is a PyTorch call that makes the host wait for the GPU: a tensor read into
Python, a copy to the host. torch.cuda.set_sync_debug_mode("warn") has each one warn; the
warnings are counted by the line that asked (the innermost frame in the andrea package, else the
innermost frame). After one uncounted run (what a process does once), each setting trains the
preset twice on DATA (`andrea.train.loop.train`, in this process), for SHORT and for LONG
steps: what both runs share (set-up, the final checkpoint) cancels, and (LONG - SHORT) / (LONG
steps - SHORT steps) is a step's count. A step's time is the median of the LONG run's per-step
records after its first two (log_every 1: from one step's read to the next). Both settings keep
the preset's tokens per step; the sequence warm-up is off, so every step has the preset's block
size.

scripts/gpu_check.sh runs it on the GPU (its step-syncs part); gpu_check_report.py `syncs` gives
the verdict: a step's count must not grow with its micro-batches. Without a GPU there is nothing
to count (tests/test_gpu_check.py runs it on the CPU with reads made to warn as a GPU's would).
To count an older version, put that checkout's `andrea` and `configs` first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

import andrea
from andrea.config import load_config
from andrea.runs import read_metrics
from andrea.train.loop import train

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's text in sync debug mode "warn"
SHORT, LONG = 3, 8
MICRO_BATCHES = (1, 8)
# Every counted run's: no sequence warm-up (both of its keys, as a preset that has one needs),
# no evaluation, no checkpoint but the final one, a record every step.
STEP_SETTINGS = ("train.warmup_steps=2", "train.seq_warmup_length=0", "train.seq_warmup_steps=0",
                 "train.eval_every=0", "train.checkpoint_every=0", "train.keep_last=1",
                 "train.log_every=1")
PACKAGE = str(Path(andrea.__file__).resolve().parent)


def asking_line() -> str:
    """The line that made the host wait: the innermost frame in the andrea package (the call
    in andrea that read), else the innermost frame outside this file and the warnings module."""
    frames = [f for f in traceback.extract_stack()
              if f.filename != __file__ and not f.filename.endswith("warnings.py")]
    ours = [f for f in frames if f.filename.startswith(PACKAGE)]
    frame = (ours or frames)[-1]
    where = (str(Path(frame.filename).relative_to(Path(PACKAGE).parent)) if ours
             else Path(frame.filename).name)
    return f"{where}:{frame.lineno} ({frame.name})"


def count_syncs(run: Callable[[], Any]) -> Counter[str]:
    """RUN(), its synchronisations counted by the line that asked."""
    counts: Counter[str] = Counter()

    def show(message: Warning | str, category: type[Warning], *rest: Any) -> None:
        if SYNC_WARNING in str(message):
            counts[asking_line()] += 1
        else:
            shown(message, category, *rest)

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every call, not once per line
        warnings.showwarning = show
        debug = torch.cuda.is_available()
        if debug:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            if debug:
                torch.cuda.set_sync_debug_mode("default")
    return counts


def measure(preset: str, data: Path, device: str, runs: Path,
            extra: list[str] | None = None) -> dict[str, Any]:
    """Both settings' counts and step times (the module's docstring)."""
    cfg = load_config(preset, extra or [])
    windows = cfg.train.global_batch_tokens // cfg.model.block_size

    def run(name: str, micro: int, steps: int) -> Callable[[], object]:
        return partial(train, load_config(preset, [
            *(extra or []), f"data.dir={data}", f"train.runs_dir={runs}", f"train.name={name}",
            f"train.device={device}", f"train.max_steps={steps}",
            f"train.micro_batch_size={micro}", *STEP_SETTINGS,
        ]), progress=False)

    # The process's first run pays what happens once (CUDA's and cuBLAS's set-up, the kernels'
    # compilation): uncounted, so that it does not land in one setting's short run only.
    run("syncs-warm-up", windows // MICRO_BATCHES[-1], 1)()
    settings = []
    for micro_batches in MICRO_BATCHES:
        micro = windows // micro_batches
        name = f"syncs-{micro_batches}x{micro}"
        counts = {steps: count_syncs(run(f"{name}-{steps}", micro, steps))
                  for steps in (SHORT, LONG)}
        records = [r for r in read_metrics(runs / f"{name}-{LONG}" / "metrics.jsonl")[0]
                   if r["event"] == "train"]
        per_line = {line: (counts[LONG][line] - counts[SHORT][line]) / (LONG - SHORT)
                    for line in counts[LONG] | counts[SHORT]}
        steady = records[2:] or records
        settings.append({
            "micro_batches": micro_batches, "micro_batch_size": micro,
            "steps": len(records),
            "syncs": {"short": sum(counts[SHORT].values()), "long": sum(counts[LONG].values())},
            "per_step": sum(per_line.values()),
            "per_step_lines": {k: v for k, v in sorted(per_line.items()) if v},
            "run_lines": dict(sorted(counts[SHORT].items())),
            "step_ms": statistics.median(
                1000 * cfg.train.global_batch_tokens / r["tokens_per_s"] for r in steady),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        })
    return {"preset": preset, "package": PACKAGE, "torch": torch.__version__, "device": device,
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
            "tokens_per_step": cfg.train.global_batch_tokens, "short": SHORT, "long": LONG,
            "settings": settings}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, help="the preset's prepared data folder")
    ap.add_argument("out", type=Path, help="the JSON written")
    ap.add_argument("--preset", default="andrea-12m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="more overrides for every run")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="andrea-step-syncs-") as runs:
        result = measure(args.preset, args.data, args.device, Path(runs), args.set)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for s in result["settings"]:
        print(f"{s['micro_batches']} x {s['micro_batch_size']}: {s['per_step']:g} syncs a step, "
              f"{s['step_ms']:.1f} ms a step ({s['tokens_per_s']:,.0f} tokens/s)")
        for line, n in s["per_step_lines"].items():
            print(f"    {n:g}  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
