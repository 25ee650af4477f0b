"""The learning-rate schedule: its shapes, each group's lr bit for bit as runs were trained, and a
resume that changes train.max_steps, where the lr goes on from where it was, never jumps
(AdamW's and Muon's, which the one schedule drives)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from andrea.config import load_config
from andrea.errors import UserError
from andrea.model.transformer import Andrea
from andrea.train.loop import train
from andrea.train.optim import build_optimizer, set_learning_rates
from andrea.train.schedule import multiplier, replan


def lr_at(step, cfg, anchor=None):
    """The lr the schedule gives train.lr (AdamW's, the one logged)."""
    return multiplier(step, cfg, anchor).lr


def schedule(kind: str, max_steps: int):
    return load_config("andrea-tiny", [
        f"train.schedule={kind}", f"train.max_steps={max_steps}", "train.lr=1.0",
        "train.min_lr=0.1", "train.warmup_steps=10", "train.decay_fraction=0.2"]).train


def test_a_run_decayed_to_lr_zero_names_the_kept_checkpoints_that_extend_it():
    """The refusal said "before its decay began (step 49 or earlier) if one is kept" while a
    kept step-000050, half-way down the decay, extends the run too: it names the run's kept
    checkpoints whose next step still had an lr, newest first, and none when none is kept."""
    old = dataclasses.replace(schedule("wsd", 100), min_lr=0.0, decay_fraction=0.5)
    new = dataclasses.replace(old, max_steps=110)
    with pytest.raises(UserError) as refused:
        replan(100, new, 100, None, kept=[25, 50, 99, 100])
    assert ("resume from an earlier checkpoint (kept here: step-000050, step-000025; one of "
            "step 49 or earlier holds the peak lr longer") in str(refused.value)
    assert lr_at(99, old) == 0 < lr_at(50, old) < lr_at(49, old) == old.lr  # 99 is left out
    with pytest.raises(UserError, match=r"\(this run keeps none now; one of step 49 "):
        replan(100, new, 100, None, kept=[100])
    for kept in (50, 25):  # each one named is a resume that trains on
        anchor, _ = replan(kept, new, 100, None)
        assert max(lr_at(s, new, anchor) for s in range(kept, 110)) > 0


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


def test_a_resume_with_one_step_left_says_step():
    """The line said 'over the remaining 1 steps'; a count a message cannot know to be above 1
    is said by errors.counted, in the singular for 1."""
    _, lines = replan(99, schedule("cosine", 100), 200, None)
    assert lines[0].endswith(" at step 99 over the remaining 1 step (docs/training.md)"), lines
    _, lines = replan(98, schedule("cosine", 100), 200, None)
    assert lines[0].endswith(" over the remaining 2 steps (docs/training.md)"), lines


def test_a_jump_that_cannot_be_smoothed_is_said():
    # wsd still holding at step 99, now to end at 100: the decay has a single step left.
    anchor, lines = replan(99, schedule("wsd", 100), 400, None)
    assert lines[1:] == ["resume: the learning rate jumps from 1 to 0.1 at step 99"]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resuming_a_finished_run_for_longer_keeps_the_lr(tmp_path: Path, data_dir, optimizer,
                                                          capsys):
    def planned_for(steps: int):
        return tiny_config(tmp_path, data_dir, "train.warmup_steps=2",
                           f"train.optimizer={optimizer}", f"train.max_steps={steps}")

    first = train(planned_for(6), progress=False)
    capsys.readouterr()
    more = train(planned_for(12), resume=str(first.run_dir), progress=False)
    out = capsys.readouterr().out
    assert more.steps == 12
    lines = (first.run_dir / "metrics.jsonl").read_text().splitlines()
    lr = {r["step"]: r["lr"] for r in map(json.loads, lines) if r["event"] == "train"}
    # Step 7 runs at the lr the finished plan had next (its end, min_lr), then stays there:
    # the old code went back up to 1.2e-3, with no warm-up and no word.
    planned = lr_at(6, planned_for(6).train)
    assert planned == pytest.approx(3e-4)
    assert all(lr[s] == pytest.approx(planned) for s in range(7, 13))
    assert "resume: train.max_steps 6 -> 12: the cosine schedule continues from lr" in out
    assert out.count("resume: train.max_steps") == 1  # before: a bare `6 -> 12` line too
    # And the re-planned schedule is kept by the next resume (it is in the checkpoint).
    again = train(planned_for(14), resume=str(first.run_dir), progress=False)
    lines = (first.run_dir / "metrics.jsonl").read_text().splitlines()
    lr = {r["step"]: r["lr"] for r in map(json.loads, lines) if r["event"] == "train"}
    assert again.steps == 14 and lr[13] == pytest.approx(planned)


def test_schedules_at_chosen_steps():
    t = load_config("andrea-tiny", ["train.lr=1.0", "train.min_lr=0.1", "train.warmup_steps=10",
                                    "train.max_steps=110"]).train
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_at(110, t) == pytest.approx(0.1)
    t.schedule = "constant"
    assert lr_at(5, t) == pytest.approx(0.6) and lr_at(100, t) == 1.0
    t.schedule, t.decay_fraction = "wsd", 0.1  # decays over the last 11 steps
    assert lr_at(98, t) == 1.0
    assert lr_at(99, t) == pytest.approx(1.0 - 0.9 / 11)
    assert lr_at(109, t) == pytest.approx(0.1)


# The schedule as every run so far was trained with it, kept verbatim as the reference: AdamW's
# lr from these formulas x the spike guard's cut, Muon's that x (muon_lr / lr).
def old_lr_at(step, cfg, anchor=None):
    if anchor is not None:
        return old_replanned(step, cfg, anchor["step"], anchor["lr"])
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        span = max(1, cfg.max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
    decay_steps = max(1, round(cfg.decay_fraction * cfg.max_steps))
    decay_start = cfg.max_steps - decay_steps
    if step < decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return cfg.lr + progress * (cfg.min_lr - cfg.lr)


def old_replanned(step, cfg, start, start_lr):
    remaining = max(1, cfg.max_steps - start)
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = min(1.0, max(0.0, (step - start) / remaining))
        return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (start_lr - cfg.min_lr)
    decay_start = cfg.max_steps - max(1, round(cfg.decay_fraction * cfg.max_steps))
    if start_lr >= cfg.lr and start <= decay_start:
        return old_lr_at(step, cfg)
    progress = min(1.0, max(0.0, (step - start + 1) / remaining))
    return start_lr + progress * (cfg.min_lr - start_lr)


PLANS = {  # (preset, overrides): the presets' own paths, then every shape with uneven lrs
    "12m": ("andrea-12m", []),
    "readme": ("andrea-12m", ["train.max_steps=100"]),
    "tiny": ("andrea-tiny", []),
    "constant": ("andrea-tiny", ["train.schedule=constant", "train.lr=7.3e-4"]),
    "wsd": ("andrea-tiny", ["train.schedule=wsd", "train.lr=7.3e-4", "train.min_lr=3.1e-5",
                            "train.muon_lr=0.023", "train.decay_fraction=0.37"]),
    "cosine": ("andrea-tiny", ["train.lr=1.7e-3", "train.min_lr=1.3e-4", "train.muon_lr=0.037",
                               "train.warmup_steps=7", "train.max_steps=301"]),
}


@pytest.mark.parametrize("plan", PLANS)
def test_every_groups_lr_is_bit_for_bit_the_old_schedules(plan):
    """For every step of each plan, fresh and re-planned on resumes that lengthen or shorten
    it (the anchors as older checkpoints stored them), with and without a spike-guard cut:
    each group's lr equals the old formula's to the last bit."""
    preset, sets = PLANS[plan]
    cfg = load_config(preset, ["train.optimizer=muon", *sets])
    opt = build_optimizer(Andrea(load_config("andrea-tiny").model), cfg, torch.device("cpu"))
    t = cfg.train
    ratio = t.muon_lr / t.lr  # the old Muon groups' lr_ratio
    plans = [(t, None)]
    for at, longer in ((t.warmup_steps + 3, 2), (t.max_steps // 2, 3), (t.max_steps - 7, 2),
                       (t.max_steps // 3, 0.8)):
        new = dataclasses.replace(t, max_steps=round(t.max_steps * longer))
        try:
            anchor, _ = replan(at, new, t.max_steps, None)
        except UserError:  # decayed to lr 0: refused, nothing to train
            continue
        assert anchor is None or anchor == {"step": at, "lr": old_lr_at(at, t)}
        plans.append((new, json.loads(json.dumps(anchor))))  # as a checkpoint keeps it
    assert len(plans) >= 3
    moved = []
    for sched, anchor in plans:
        for step in range(sched.max_steps + 3):
            for cut in (1.0, 0.5, 0.3):
                set_learning_rates(opt, multiplier(step, sched, anchor).cut(cut))
                adamw = old_lr_at(step, sched, anchor) * cut
                want = [adamw * ratio] + [adamw * 1.0] * 2  # Muon's group, then AdamW's two
                got = [g["lr"] for g in opt.param_groups]
                if got != want:
                    moved.append((sched.max_steps, step, cut, got, want))
    assert not moved, moved[:5]
