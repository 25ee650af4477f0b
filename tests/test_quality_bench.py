"""scripts/bench_quality.py: the time-to-quality comparison a user runs, end to end on the tiny
preset, and its interpolation of the tokens needed to reach a loss."""

from __future__ import annotations

import json
import re
import sys

import pytest
from conftest import load_script


def bench_quality():
    return load_script("bench_quality")


@pytest.fixture(scope="module")
def one_play(tmp_path_factory) -> list[str]:
    """--set overrides for a corpus of one play: every run ends with an evaluation of the whole
    val split, which on the tiny preset's Shakespeare split (about 500,000 bytes) took most of
    this file's time; one play's 10% keeps the same code path at a few seconds."""
    from andrea.data.corpus import shakespeare

    root = tmp_path_factory.mktemp("one-play")
    _, text = shakespeare()[0]
    (root / "play.txt").write_text(text, encoding="utf-8")
    return [f"data.source={root / 'play.txt'}", f"data.dir={root / 'data'}"]


def sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


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


def test_both_optimizers_side_by_side_on_the_tiny_preset(tmp_path, one_play, monkeypatch, capsys):
    module = bench_quality()
    runs = tmp_path / "runs"
    # andrea-tiny: 8 x 64 = 512 tokens a step, so 5,120 tokens are 10 steps, one a tenth.
    monkeypatch.setattr(sys, "argv", [
        "bench_quality.py", "--preset", "andrea-tiny", "--tokens", "5120", "--runs-dir", str(runs),
        "--eval-tokens", "1024", *sets(one_play)])
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
        run_dir = runs / module.run_name(opt, 5120, one_play)
        assert len(list(run_dir.glob("step-*"))) == 10


def test_one_optimizer_alone_names_its_run_by_the_override(tmp_path, one_play, monkeypatch, capsys):
    module = bench_quality()
    assert module.run_name("muon", 1000, ["train.muon_lr=0.04"]) == "quality-muon-1000-muon_lr-0.04"
    assert module.run_name("adamw", 10, ["data.dir=/a b/c"]) == "quality-adamw-10-dir-_a_b_c"
    runs = tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", [
        "bench_quality.py", "--preset", "andrea-tiny", "--tokens", "5120", "--runs-dir", str(runs),
        "--eval-tokens", "512", "--optimizers", "adamw", *sets(one_play),
        "--set", "train.lr=0.01"])
    assert module.main() == 0
    out = capsys.readouterr().out
    assert "muon" not in out and "tokens to reach" not in out
    assert re.search(r"^adamw: best val loss [\d.]+ \([\d.]+ bits/byte\) at [\d,]+ tokens; "
                     r"final on the whole val split [\d.]+ \([\d.]+ bits/byte\) after \d+ s$",
                     out, re.M)
    assert "wall time" not in out  # one run: nothing to compare with


def test_seconds_to_reach_and_checkpoint_seconds(tmp_path) -> None:
    module = bench_quality()
    points = [(100, 5.0, None, 10.0), (200, 4.0, None, 30.0), (300, 3.0, None, 50.0)]
    assert module.seconds_to_reach(points, 3.5) == pytest.approx(40.0)
    assert module.seconds_to_reach(points, 2.0) is None
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(e) for e in [
        {"event": "start", "step": 0, "time": 100.0},
        {"event": "train", "step": 1, "time": 101.0},
        {"event": "checkpoint", "step": 2, "time": 103.5},
        {"event": "checkpoint", "step": 4, "time": 107.25},
    ]) + "\n")
    assert module.checkpoint_seconds(metrics) == {2: 3.5, 4: 7.25}


def test_variants_side_by_side_with_wall_time(tmp_path, one_play, monkeypatch, capsys):
    """Recipes as a user compares them: the preset against a variant on twice the budget; each
    has its own table with training seconds, and the summary gives each one's wall time to the
    first run's final val loss as a share of the first run's. The variant's batch-size warm-up
    (10 steps of 512 tokens, then 1,024) counts its steps at their own size."""
    module = bench_quality()
    runs = tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", [
        "bench_quality.py", "--preset", "andrea-tiny", "--tokens", "5120", "--runs-dir", str(runs),
        "--eval-tokens", "512", *sets(one_play),
        "--variant", "preset:", "--variant",
        "zero:train.zero_init_output=true,train.global_batch_tokens=1024,"
        "train.batch_warmup_tokens=512,train.batch_warmup_steps=10,tokens=15360"])
    assert module.main() == 0
    out = capsys.readouterr().out
    assert "zero: data.source=" in out
    assert "train.batch_warmup_steps=10; 20 steps x 1,024 tokens (the first 10 x 512)" in out
    tables = re.findall(r"^\s+tokens\s+(\w+) loss\s+\w+ bpb\s+\w+ s$", out, re.M)
    assert tables == ["preset", "zero"]  # different tenths: one table each
    rows = re.findall(r"^\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+\.\d)$", out, re.M)
    assert len(rows) == 20
    preset_seconds = [float(r[3]) for r in rows[:10]]  # a tiny run: tenths of a second
    assert preset_seconds == sorted(preset_seconds) and preset_seconds[-1] > 0
    assert [int(r[0].replace(",", "")) for r in rows[10:]] == [
        1024 * k for k in range(1, 6)] + [5120 + 2048 * k for k in range(1, 6)]
    share = re.search(r"^wall time of training to reach preset's final val loss ([\d.]+), as a "
                      r"share of preset's (\d+) s:$", out, re.M)
    assert share
    assert re.search(r"^  preset\s+[\d,]+ s \(1\.00\)$", out, re.M)  # reached at its own end
    assert re.search(r"^  zero\s+([\d,]+ s \([\d.]+\)|not reached)$", out, re.M)
    for label, tokens in (("preset", 5120), ("zero", 15360)):
        run_dir = runs / module.run_name(label, tokens, one_play)
        assert len(list(run_dir.glob("step-*"))) == 10
    zero_cfg = (runs / module.run_name("zero", 15360, one_play) / "config.yaml")
    assert "zero_init_output: true" in zero_cfg.read_text()


@pytest.mark.parametrize("variant, words", [
    ("bad label:train.lr=1", "the label before ':'"),
    ("x:train.lr", "'train.lr' is not KEY=VALUE"),
    ("x:tokens=-5", "tokens='-5' is not a positive integer"),
])
def test_a_bad_variant_is_one_line(variant, words, monkeypatch, capsys):
    module = bench_quality()
    monkeypatch.setattr(sys, "argv", ["bench_quality.py", "--variant", variant])
    assert module.main() == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --variant") and words in err and err.count("\n") == 1


def test_reuse_adds_a_variant_to_a_comparison_already_run(tmp_path, one_play, monkeypatch, capsys):
    """--reuse: the preset trained once; a later invocation adds a variant and compares against
    it without retraining it, and refuses a folder trained with other settings."""
    module = bench_quality()
    runs = tmp_path / "runs"
    common = ["bench_quality.py", "--preset", "andrea-tiny", "--tokens", "5120", "--runs-dir",
              str(runs), "--eval-tokens", "512", *sets(one_play)]
    monkeypatch.setattr(sys, "argv", [*common, "--variant", "preset:"])
    assert module.main() == 0
    first = capsys.readouterr().out
    metrics = runs / module.run_name("preset", 5120, one_play) / "metrics.jsonl"
    trained = metrics.read_bytes()
    monkeypatch.setattr(sys, "argv", [*common, "--reuse", "--variant", "preset:",
                                      "--variant", "lr:train.lr=0.01"])
    assert module.main() == 0
    out = capsys.readouterr().out
    assert metrics.read_bytes() == trained  # not retrained
    # The same evaluation of the same checkpoints: the preset's table rows are the first run's.
    row = r"^\s+[\d,]+\s+[\d.]+\s+[\d.]+\s+\d+\.\d"
    assert re.findall(row, first, re.M) == re.findall(row, out, re.M)
    assert re.search(r"^  preset\s+[\d,]+ s \(1\.00\)$", out, re.M)
    assert re.search(r"^  lr\s+([\d,]+ s \([\d.]+\)|not reached)$", out, re.M)
    # The same name with other settings is not silently taken for the preset's run.
    monkeypatch.setattr(sys, "argv", [*common, "--reuse", "--variant", "preset:train.lr=0.02"])
    assert module.main() == 2
    err = capsys.readouterr().err
    assert "--reuse: the run there was trained with other settings (train.lr)" in err
