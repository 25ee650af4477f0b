"""The rows of scripts/faults.py (the fault matrix) that no other test covers, each through a
real process. The script names each row's test; the others live in test_train, test_formats and
test_prepare_stops."""

from __future__ import annotations

import signal
from pathlib import Path

import torch
from conftest import config_file, run_andrea, tiny_config
from test_train import read_events

from andrea.train import checkpoint as ckpt_io
from andrea.train.loop import train
from andrea.train.rundir import resolve_checkpoint


def steps(run_dir: Path) -> dict[int, tuple[float, float]]:
    """Each step's (loss, grad norm); a step a resume redid counts as its last record."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_events(run_dir, "train")}


def test_kill_9_mid_step_then_resume_equals_the_uninterrupted_run(tmp_path, data_dir):
    """SIGKILL after step 5's forward and backward, before its update: nothing runs after it,
    step-000003 stays the latest; the resume redoes step 4 and ends with the uninterrupted
    run's losses, grad norms and weights, exactly."""
    sets = ("train.max_steps=6", "train.checkpoint_every=3", "train.precision=fp32")
    whole = train(tiny_config(tmp_path / "a" / "runs", data_dir, *sets), progress=False)
    cfg = tiny_config(tmp_path / "b" / "runs", data_dir, *sets)
    r = run_andrea("train", "-c", str(config_file(cfg, tmp_path)), "--no-progress",
                   env={"ANDREA_FAULTS": "sigkill@4.0"})  # threads as this process: same sums
    assert r.returncode == -signal.SIGKILL, r.stderr
    run_dir = Path(cfg.train.runs_dir) / "t"
    assert sorted(steps(run_dir)) == [1, 2, 3, 4]
    assert resolve_checkpoint(run_dir).name == "step-000003"
    rest = train(cfg, resume=str(run_dir), progress=False)
    assert rest.steps == 6 and sorted(rest.losses) == [4, 5, 6]
    assert steps(run_dir) == steps(whole.run_dir)  # exact float equality, every step
    a = ckpt_io.read_model_checkpoint(whole.checkpoint)[0]
    b = ckpt_io.read_model_checkpoint(rest.checkpoint)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)
