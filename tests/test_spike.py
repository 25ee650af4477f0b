"""The loss-spike guard (train.spike_guard): an injected spike leaves the guarded run's curve
where the clean run's is, the unguarded one's not; rollback; exact resume; the config keys."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    andrea_main,
    assert_user_error,
    config_file,
    free_port,
    run_torchrun,
    tiny_config,
    torchrun_command,
)

from andrea.config import load_config
from andrea.errors import UserError
from andrea.runs import format_table, read_run
from andrea.train import checkpoint as ckpt_io
from andrea.train.loop import train
from andrea.train.spike import APPLY, ROLLBACK, SKIP, SpikeGuard

# A step of random tokens whose loss (so gradient) is 1000x: bad data and a blow-up at once.
# Clipping is off: a scaled gradient is what clipping exists for, and the guard must not need it.
SPIKE = "spike@21x1000"


SETS = ("train.eval_every=40", "train.checkpoint_every=10", "train.max_steps=40",
        "train.grad_clip=0", "train.spike_window=12")


def events(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def tail_loss(losses: dict[int, float]) -> float:
    return sum(losses[s] for s in range(31, 41)) / 10


@pytest.fixture(scope="module")
def clean(tmp_path_factory, data_dir):
    return train(tiny_config(tmp_path_factory.mktemp("clean"), data_dir, *SETS), progress=False)


def test_a_guarded_run_keeps_the_clean_curve_an_unguarded_one_does_not(
        tmp_path, data_dir, clean, inject_faults):
    inject_faults(SPIKE)
    runs = tmp_path / "runs"
    bad = train(tiny_config(runs, data_dir, *SETS, name="bad"), progress=False)
    guarded = train(tiny_config(runs, data_dir, *SETS, "train.spike_guard=skip",
                                name="guarded"), progress=False)
    # The spike happened in both: the same loss at step 21, far above the clean run's.
    assert bad.losses[21] == guarded.losses[21] > clean.losses[21] + 1.0
    # Afterwards, on the same data: the guarded run stays on the clean curve, the other not.
    assert abs(tail_loss(guarded.losses) - tail_loss(clean.losses)) < 0.01
    assert tail_loss(bad.losses) - tail_loss(clean.losses) > 0.03
    assert abs(guarded.last_val_loss - clean.last_val_loss) < 0.01
    assert bad.last_val_loss - clean.last_val_loss > 0.02
    (spike,) = events(guarded.run_dir, "spike")
    # Flagged by either z-score (which one crosses 6 first depends on the CPU's rounding).
    assert spike["step"] == 21 and spike["action"] == "skip"
    assert max(spike["loss_z"], spike["grad_z"]) > 6
    assert not events(bad.run_dir, "spike")
    summary = read_run(guarded.run_dir)
    assert (summary.spikes, summary.rollbacks) == (1, 0)
    assert "guarded: spike guard: 1 outlier step not applied, 0 rollbacks" in format_table(
        [summary])
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra")
    from andrea.plot import plot_runs

    svg = plot_runs([guarded.run_dir], tmp_path / "curves.svg", x="step").read_text()
    assert "x: spike not applied" in svg  # the legend of the cross on the loss curve


def test_rollback_returns_to_the_checkpoint_past_the_bad_data_at_a_cut_lr(
        tmp_path, data_dir, clean, inject_faults):
    inject_faults("spike@21-22x1000")
    sets = ("train.spike_guard=rollback", "train.spike_patience=2", "train.spike_lr_factor=0.5",
            "train.spike_lr_steps=5")
    run = train(tiny_config(tmp_path, data_dir, *SETS, *sets), progress=False)
    assert run.state == "finished" and run.steps == 40
    (rollback,) = events(run.run_dir, "rollback")
    assert rollback["step"] == 20 and rollback["from_step"] == 22
    assert rollback["checkpoint"] == "step-000020" and rollback["data_offset"] == 2
    # Steps 21..25 ran again at half the lr (the clean run's lr at those steps), then the plan.
    lr = {r["step"]: r["lr"] for r in events(run.run_dir, "train")}  # the last record wins
    clean_lr = {r["step"]: r["lr"] for r in events(clean.run_dir, "train")}
    assert all(lr[s] == pytest.approx(0.5 * clean_lr[s]) for s in range(21, 26))
    assert all(lr[s] == pytest.approx(clean_lr[s]) for s in range(26, 41))
    # Steps 21.. read the data of 23..: the garbage is never seen again, and the curve is back.
    assert max(run.losses[s] for s in range(21, 41)) < clean.losses[21] + 0.5
    assert abs(run.last_val_loss - clean.last_val_loss) < 0.02
    summary = read_run(run.run_dir)
    assert (summary.spikes, summary.rollbacks, summary.step) == (2, 1, 40)


def test_rollback_without_a_checkpoint_yet_takes_a_lasting_shift_as_skip_does(tmp_path, data_dir):
    """Before: rollback's patience-th outlier with no checkpoint to go back to was skipped and
    the window kept, so every later step was an outlier: 27 of 30 steps not applied, a val loss
    of 5.1 against skip's 3.5, and the run "finished". Now it is skip's lasting shift."""
    sets = ("train.spike_z=0.001", "train.spike_window=2", "train.max_steps=30",
            "train.warmup_steps=0", "train.checkpoint_every=0")
    runs = tmp_path / "runs"
    skip = train(tiny_config(runs, data_dir, *sets, "train.spike_guard=skip", name="skip"),
                 progress=False)
    rollback = train(tiny_config(runs, data_dir, *sets, "train.spike_guard=rollback",
                                 name="rollback"), progress=False)
    assert rollback.losses == skip.losses
    actions = [e["action"] for e in events(runs / "rollback", "spike")]
    assert "accepted" in actions and "rollback" not in actions
    assert actions == [e["action"] for e in events(runs / "skip", "spike")]
    assert len(actions) < 20


def test_guard_state_survives_resume_bit_for_bit(tmp_path, data_dir, inject_faults):
    inject_faults("spike@21-22x1000")
    sets = ("train.spike_guard=rollback", "train.spike_patience=2", "train.eval_every=0",
            "train.max_steps=30")
    whole = train(tiny_config(tmp_path / "a", data_dir, *SETS, *sets), progress=False)
    # Paused at step 18 (window filling), and again right after the rollback.
    cfg = tiny_config(tmp_path / "b", data_dir, *SETS, *sets)
    first = train(cfg, progress=False, stop_after=18)
    second = train(cfg, resume=str(first.run_dir), progress=False,
                   stop_after=3)  # 19, 20, 21: outlier held, not yet rolled
    rest = train(cfg, resume=str(first.run_dir), progress=False)
    assert (first.steps, second.steps, rest.steps) == (18, 21, 30)
    assert {**first.losses, **second.losses, **rest.losses} == whole.losses
    a, b = (ckpt_io.read_trainer_state(r.checkpoint)[0].spike_guard for r in (whole, rest))
    assert a == b and a["rollbacks"] == 1 and a["data_offset"] == 2
    wa, wb = (ckpt_io.read_model_checkpoint(r.checkpoint)[0] for r in (whole, rest))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_end_of_a_sequence_warmup_is_not_a_spike_and_the_guard_goes_on(
        tmp_path, data_dir, inject_faults):
    # 100 steps on windows of 8 tokens, then 64: the first whole-window steps reach positions
    # the model has not trained, so their loss and gradient norm jump by plan. The guard used to
    # hold two of them back as a spike; now it measures anew there, and once its window is full
    # again (12 steps) it still catches a real spike.
    inject_faults("spike@118x1000")
    run = train(tiny_config(tmp_path, data_dir, *SETS, "train.spike_guard=skip",
                            "train.eval_every=0", "train.max_steps=125", "train.grad_clip=1",
                            "train.seq_warmup_length=8", "train.seq_warmup_steps=100"),
                progress=False)
    norms = {e["step"]: e["grad_norm"] for e in events(run.run_dir, "train")}
    assert norms[101] > 2 * max(norms[s] for s in range(89, 101))  # the planned jump
    late = [(e["step"], e["action"]) for e in events(run.run_dir, "spike") if e["step"] > 100]
    assert late == [(118, "skip")]


def guard(mode: str = "skip", **sets: object) -> SpikeGuard:
    cfg = load_config("andrea-tiny", [f"train.spike_guard={mode}", "train.warmup_steps=0",
                                      "train.spike_window=4", "train.spike_patience=2",
                                      *(f"train.{k}={v}" for k, v in sets.items())]).train
    g = SpikeGuard(cfg)
    for step, loss in enumerate([3.0, 3.1, 2.9, 3.0], start=1):
        assert g.judge(step, loss, 1.0).action == APPLY
    return g


def test_judge_skips_outliers_and_takes_a_lasting_shift_as_the_new_level():
    g = guard()  # window 4, patience 2
    assert g.judge(5, 3.05, 1.0).action == APPLY  # ordinary noise
    assert g.judge(6, 3.0, 50.0).action == SKIP  # a gradient-norm spike alone is enough
    assert g.judge(7, 2.5, 1.0).action == APPLY  # downwards is never a spike
    assert g.judge(8, 9.0, 1.0).action == SKIP  # a loss spike...
    assert g.judge(9, 3.0, 1.0).action == APPLY  # ... that passed
    assert g.judge(10, 6.0, 1.0).action == SKIP  # the loss moves up to stay: held back once,
    accepted = g.judge(11, 6.0, 1.0)  # then, the patience-th outlier in a row, taken as real
    assert accepted.outlier and accepted.action == APPLY
    assert g.judge(12, 6.0, 1.0).action == APPLY  # a new window fills: no verdict till full
    assert g.spikes == 4


def test_a_flat_stretch_does_not_make_ordinary_noise_a_spike():
    """Over a window of equal losses and norms the spread is at least 1% of the mean: 0.5% up
    is noise, 20% up a spike (z = 20 at the floor). Mutation round 3: without the floor, the
    spread was 1e-12 and a loss 0.5% up a spike; no test had a flat window."""
    g = guard()
    g.restart()
    for step in range(5, 9):
        assert g.judge(step, 2.0, 1.0).action == APPLY
    assert g.judge(9, 2.01, 1.005).action == APPLY
    assert g.judge(10, 2.0, 1.0).action == APPLY
    assert g.judge(11, 2.4, 1.0).action == SKIP


def test_the_last_warm_up_step_is_not_judged():
    """train.warmup_steps = 6: steps 1 to 6 warm up and are never judged; step 7 is.
    Mutation round 3: the guard judging from step 6 on (>=) passed every test."""
    for spike_at, action in ((6, APPLY), (7, SKIP)):
        g = guard(warmup_steps=6)
        for step in range(5, spike_at):
            assert g.judge(step, 3.0, 1.0).action == APPLY
        assert g.judge(spike_at, 9.0, 1.0).action == action


def test_a_shift_and_a_restart_start_the_guard_afresh():
    """A lasting shift taken as the new level leaves a window of that step alone (measured anew
    from there); a restart (the end of a sequence-length warm-up) forgets the outliers in a
    row too, so one outlier before it and one after are two first outliers, each skipped.
    Mutation round 3: take_as_shift without clearing the window and restart() without resetting
    the streak passed every test."""
    g = guard()  # window 4, patience 2
    assert g.judge(5, 6.0, 1.0).action == SKIP
    assert g.judge(6, 6.0, 1.0).action == APPLY  # the shift, taken
    assert g.state_dict()["window"] == [[6.0, 1.0]]
    g = guard()
    assert g.judge(5, 9.0, 1.0).action == SKIP
    g.restart()
    for step in range(6, 10):
        assert g.judge(step, 3.0, 1.0).action == APPLY
    assert g.judge(10, 9.0, 1.0).action == SKIP


def test_judge_rolls_back_after_patience_and_state_round_trips_through_json():
    g = guard("rollback", spike_lr_factor=0.25, spike_lr_steps=7)
    assert g.judge(5, 9.0, 1.0).action == SKIP
    assert g.judge(6, 9.0, 1.0).action == ROLLBACK
    g.rolled_back(from_step=6, to_step=2)
    assert g.data_step(2) == 6 and g.lr_scale(8) == 0.25 and g.lr_scale(9) == 1.0
    again = SpikeGuard(g.cfg, json.loads(json.dumps(g.state_dict())))
    assert again.state_dict() == g.state_dict()
    assert again.judge(7, 3.2, 1.1) == g.judge(7, 3.2, 1.1)


@pytest.mark.parametrize("setting, fragment", [
    ("train.spike_guard=always", "train.spike_guard: 'always' is not one of off, skip, rollback"),
    ("train.spike_z=0", "train.spike_z: must be positive"),
    ("train.spike_window=1", "train.spike_window: must be an integer of at least 2"),
    ("train.spike_lr_factor=2", "train.spike_lr_factor: must be in (0, 1]"),
])
def test_bad_guard_settings_are_one_line_errors(setting, fragment):
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_config("andrea-tiny", [setting])


def test_bad_guard_setting_from_the_command_line(tmp_path):
    proc = andrea_main("train", "-c", "andrea-tiny", "--set", "train.spike_patience=0",
                       cwd=tmp_path)
    assert_user_error(proc, "train.spike_patience: must be a positive integer")


def test_presets_guard_all_but_the_tiny_one():
    assert load_config("andrea-tiny").train.spike_guard == "off"
    assert load_config("andrea-12m").train.spike_guard == "skip"
    assert load_config("andrea-120m").train.spike_guard == "rollback"


def test_two_processes_decide_as_one(tmp_path, data_dir, inject_faults):
    """Under ddp every rank takes the same decisions (they judge the all-reduced loss and
    norm, and agree() makes sure): the same spikes and rollback as one process, the same
    losses; a rank that decided otherwise would train other weights or hang."""
    sets = ("train.spike_guard=rollback", "train.spike_patience=2", "train.spike_window=6",
            "train.warmup_steps=2", "train.checkpoint_every=5", "train.max_steps=16",
            "train.eval_every=0", "train.precision=fp32", "train.micro_batch_size=4",
            "train.global_batch_tokens=512")
    spike = "spike@12-13x1000"
    inject_faults(spike)
    cfg = tiny_config(tmp_path / "one", data_dir, *SETS, *sets, name="one")
    assert train(cfg, progress=False).state == "finished"
    cfg2 = tiny_config(tmp_path / "two", data_dir, *SETS, *sets, name="two")
    path2 = config_file(cfg2, tmp_path)
    two = run_torchrun("train", "-c", str(path2), "--no-progress", env={"ANDREA_FAULTS": spike})
    assert two.returncode == 0, two.stderr[-3000:]
    run1, run2 = Path(cfg.train.runs_dir) / "one", Path(cfg2.train.runs_dir) / "two"
    for event in ("spike", "rollback"):
        assert [(r["step"], r["action"] if event == "spike" else r["from_step"])
                for r in events(run2, event)] == [
            (r["step"], r["action"] if event == "spike" else r["from_step"])
            for r in events(run1, event)]
    assert [r["from_step"] for r in events(run2, "rollback")] == [13]
    loss1 = {r["step"]: r["loss"] for r in events(run1, "train")}
    loss2 = {r["step"]: r["loss"] for r in events(run2, "train")}
    assert loss1.keys() == loss2.keys()
    assert all(loss2[s] == pytest.approx(loss1[s], rel=1e-4) for s in loss1)


def test_a_rollback_needs_the_same_checkpoint_on_every_rank(tmp_path):
    """Node-local run folders under ddp: a rank that cannot see the checkpoint makes every rank
    take the streak as a lasting shift instead (the same decision everywhere), checked with
    real gloo processes."""
    script = tmp_path / "agree.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "from andrea.train.collectives import all_reduce_sum\n"
        "from andrea.train.spike import same_on_every_rank\n"
        "dist.init_process_group('gloo')\n"
        "class D: enabled, world_size = True, dist.get_world_size()\n"
        "r = dist.get_rank()\n"
        "cpu = torch.device('cpu')\n"
        # One write per line: print() writes its parts separately, and three processes share
        # the pipe, so their words could interleave.
        "same = same_on_every_rank(20, cpu, all_reduce_sum, D)\n"
        "differ = same_on_every_rank(20 if r == 0 else -1, cpu, all_reduce_sum, D)\n"
        "os.write(1, f'same {r} {same}\\ndiffer {r} {differ}\\n'.encode())\n"
        "dist.destroy_process_group()\n"
    )
    proc = subprocess.run(
        torchrun_command("--nproc_per_node=3", "--master_addr=127.0.0.1",
                         f"--master_port={free_port()}", entry=[str(script)]),
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(proc.stdout.split("\n"))
    assert [x for x in lines if x.startswith("same")] == [f"same {r} True" for r in range(3)]
    assert [x for x in lines if x.startswith("differ")] == [f"differ {r} False" for r in range(3)]
