"""How close the trainer's estimate of a checkpoint's size (andrea/train/checkpoint.py, used for
the free-space checks) comes to a real checkpoint's bytes on disk.

    python scripts/checkpoint_size.py [--presets andrea-tiny andrea-12m] [--fsdp]

One process: each preset with AdamW and with Muon, one optimizer step, the checkpoint written as
training writes it, its files' bytes summed. --fsdp also trains andrea-tiny for 2 steps under
torchrun with 2 processes and train.parallel=fsdp (CPU, gloo) and measures its sharded checkpoint.
Prints one row each: the estimate before the first step (what the start warning uses), the real
size, their ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from andrea.config import load_config
from andrea.fileio import size_text
from andrea.model.transformer import Andrea
from andrea.train import checkpoint as ckpt_io
from andrea.train.checkpoint import checkpoint_nbytes
from andrea.train.optim import build_optimizer
from andrea.train.rundir import TrainerState


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def one_process(preset: str, optimizer: str) -> tuple[int, int]:
    """(estimate before the first step, real bytes after one step) in this process."""
    cfg = load_config(preset, [f"train.optimizer={optimizer}"])
    model = Andrea(cfg.model)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    estimate = checkpoint_nbytes(model, opt, False, 1, "cpu")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = ckpt_io.save_checkpoint(
            Path(tmp), TrainerState(step=1), cfg, "byte:v1", model=ckpt_io.model_state(model),
            optimizer=ckpt_io.optimizer_state(opt, names),
            rng={"cpu.rank0": torch.get_rng_state()}, keep_last=1)
        return estimate, folder_bytes(ckpt)


def fsdp_two_processes() -> tuple[int, int]:
    """(estimate, real bytes) of andrea-tiny's sharded checkpoint at 2 processes."""
    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"train.runs_dir={tmp}", "train.name=f", "train.parallel=fsdp",
                "train.max_steps=2", "train.eval_every=0", "train.micro_batch_size=4",
                "train.global_batch_tokens=512"]
        cfg = load_config("andrea-tiny", sets)
        path = Path(tmp) / "f.yaml"
        path.write_text(cfg.to_yaml())
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        "--standalone", "-m", "andrea", "train", "-c", str(path),
                        "--no-progress"], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       capture_output=True)
        model = Andrea(cfg.model)
        opt = build_optimizer(model, cfg, torch.device("cpu"))
        estimate = checkpoint_nbytes(model, opt, True, 2, "cpu")
        return estimate, folder_bytes(Path(tmp) / "f" / "step-000002")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["andrea-tiny", "andrea-12m"])
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args()
    rows = [(f"{p}, {o}, 1 process", *one_process(p, o))
            for p in args.presets for o in ("adamw", "muon")]
    if args.fsdp:
        rows.append(("andrea-tiny, adamw, 2 x fsdp", *fsdp_two_processes()))
    print("| checkpoint | estimate | real | estimate / real |\n|---|---|---|---|")
    for name, estimate, real in rows:
        print(f"| {name} | {estimate:,} ({size_text(estimate)}) | {real:,} ({size_text(real)}) | "
              f"{estimate / real:.4f} |")


if __name__ == "__main__":
    main()
