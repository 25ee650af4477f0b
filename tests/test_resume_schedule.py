"""A resume that changes train.max_steps: the learning rate goes on from where it was, never
jumps (AdamW's and Muon's, which the one schedule drives)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from andrea.config import load_config
from andrea.train.loop import train
from andrea.train.schedule import lr_at, replan


def schedule(kind: str, max_steps: int):
    return load_config("andrea-tiny", [
        f"train.schedule={kind}", f"train.max_steps={max_steps}", "train.lr=1.0",
        "train.min_lr=0.1", "train.warmup_steps=10", "train.decay_fraction=0.2"]).train


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
@pytest.mark.parametrize("at", [5, 60, 90, 100])
def test_a_longer_or_shorter_run_continues_from_the_lr_it_had(kind, at):
    old = schedule(kind, 100)
    for new_max in (200, 120, at + 1):
        new = schedule(kind, new_max)
        anchor, lines = replan(at, new, 100, None)
        before, after = lr_at(at, old), lr_at(at, new, anchor)
        assert after == pytest.approx(before, rel=0.1 if new_max > at + 1 else 1.0)
        lrs = [lr_at(s, new, anchor) for s in range(at, new_max)]
        if at >= 10:  # past warm-up: never up, and down to min_lr at the end (constant: flat)
            assert all(b <= a + 1e-12 for a, b in zip(lrs, lrs[1:], strict=False))
            if new_max >= at + 20:
                assert lrs[-1] == pytest.approx(1.0 if kind == "constant" else 0.1, abs=0.02)
            assert lines and "the learning rate jumps" not in lines[0]
        else:
            assert anchor is None and not lines  # still warming up: the plain plan is smooth


def test_wsd_still_holding_just_holds_longer():
    anchor, _ = replan(50, schedule("wsd", 200), 100, None)
    assert [lr_at(s, schedule("wsd", 200), anchor) for s in (50, 159, 199)] == \
        pytest.approx([1.0, 1.0, 0.1])


def test_a_jump_that_cannot_be_smoothed_is_said():
    # wsd still holding at step 99, now to end at 100: the decay has a single step left.
    anchor, lines = replan(99, schedule("wsd", 100), 400, None)
    assert lines[1:] == ["resume: the learning rate jumps from 1 to 0.1 at step 99"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resuming_a_finished_run_for_longer_keeps_the_lr(tmp_path: Path, data_dir, optimizer,
                                                          capsys):
    sets = [f"data.dir={data_dir}", f"train.runs_dir={tmp_path}", "train.name=r",
            "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
            "train.warmup_steps=2", f"train.optimizer={optimizer}"]
    first = train(load_config("andrea-tiny", [*sets, "train.max_steps=6"]), progress=False)
    capsys.readouterr()
    more = train(load_config("andrea-tiny", [*sets, "train.max_steps=12"]),
                 resume=str(first.run_dir), progress=False)
    out = capsys.readouterr().out
    assert more.steps == 12
    lines = (first.run_dir / "metrics.jsonl").read_text().splitlines()
    lr = {r["step"]: r["lr"] for r in map(json.loads, lines) if r["event"] == "train"}
    # Step 7 runs at the lr the finished plan had next (its end, min_lr), then stays there:
    # the old code went back up to 1.2e-3, with no warm-up and no word.
    planned = lr_at(6, load_config("andrea-tiny", [*sets, "train.max_steps=6"]).train)
    assert planned == pytest.approx(3e-4)
    assert all(lr[s] == pytest.approx(planned) for s in range(7, 13))
    assert "resume: train.max_steps 6 -> 12: the cosine schedule continues from lr" in out
    # And the re-planned schedule is kept by the next resume (it is in the checkpoint).
    again = train(load_config("andrea-tiny", [*sets, "train.max_steps=14"]),
                  resume=str(first.run_dir), progress=False)
    lines = (first.run_dir / "metrics.jsonl").read_text().splitlines()
    lr = {r["step"]: r["lr"] for r in map(json.loads, lines) if r["event"] == "train"}
    assert again.steps == 14 and lr[13] == pytest.approx(planned)
