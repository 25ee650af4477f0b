"""scripts/bench_quality.py: the time-to-quality comparison a user runs, end to end on the tiny
preset, and its interpolation of the tokens needed to reach a loss."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def bench_quality():
    spec = importlib.util.spec_from_file_location(
        "bench_quality", REPO / "scripts" / "bench_quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tokens_to_reach_interpolates_between_tenths() -> None:
    reach = bench_quality().tokens_to_reach
    points = [(100, 5.0, None), (200, 4.0, None), (300, 3.0, None)]
    assert reach(points, 3.5) == pytest.approx(250.0)
    assert reach(points, 4.0) == pytest.approx(200.0)
    assert reach(points, 6.0) == 100.0  # reached at the first tenth already
    assert reach(points, 2.9) is None
    # A loss that rises again does not un-reach the target: the first crossing counts.
    rising = [(100, 5.0, None), (200, 3.0, None), (300, 4.5, None)]
    assert reach(rising, 4.0) == pytest.approx(150.0)


def test_both_optimizers_side_by_side_on_the_tiny_preset(tmp_path, data_dir, monkeypatch, capsys):
    module = bench_quality()
    runs = tmp_path / "runs"
    # andrea-tiny: 8 x 64 = 512 tokens a step, so 5,120 tokens are 10 steps, one a tenth.
    monkeypatch.setattr(sys, "argv", [
        "bench_quality.py", "--preset", "andrea-tiny", "--tokens", "5120", "--runs-dir", str(runs),
        "--eval-tokens", "1024", "--set", f"data.dir={data_dir}"])
    assert module.main() == 0
    out = capsys.readouterr().out
    assert "andrea-tiny: 10 steps x 512 tokens = 5,120 tokens per optimizer" in out
    rows = re.findall(r"^\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [int(r[0].replace(",", "")) for r in rows] == [512 * k for k in range(1, 11)]
    adamw = [float(r[1]) for r in rows]
    assert adamw[-1] < adamw[0]  # it learns
    best = re.search(r"^adamw: best val loss ([\d.]+)", out, re.M)
    assert best and float(best.group(1)) == min(adamw)
    # AdamW reaches its own final loss by the end of its budget, by construction.
    reached = re.search(r"^  adamw\s+([\d,]+)$", out, re.M)
    assert reached and int(reached.group(1).replace(",", "")) <= 5120
    assert re.search(r"^  muon\s+([\d,]+|not reached)$", out, re.M)
    for opt in ("adamw", "muon"):
        run_dir = runs / module.run_name(opt, 5120, [f"data.dir={data_dir}"])
        assert len(list(run_dir.glob("step-*"))) == 10


def test_one_optimizer_alone_names_its_run_by_the_override(tmp_path, data_dir, monkeypatch, capsys):
    module = bench_quality()
    assert module.run_name("muon", 1000, ["train.muon_lr=0.04"]) == "quality-muon-1000-muon_lr-0.04"
    assert module.run_name("adamw", 10, ["data.dir=/a b/c"]) == "quality-adamw-10-dir-_a_b_c"
    runs = tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", [
        "bench_quality.py", "--preset", "andrea-tiny", "--tokens", "5120", "--runs-dir", str(runs),
        "--eval-tokens", "512", "--optimizers", "adamw", "--set", f"data.dir={data_dir}",
        "--set", "train.lr=0.01"])
    assert module.main() == 0
    out = capsys.readouterr().out
    assert "muon" not in out and "tokens to reach" not in out
    assert re.search(r"^adamw: best val loss [\d.]+ \([\d.]+ bits/byte\) at [\d,]+ tokens$", out,
                     re.M)
