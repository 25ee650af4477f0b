"""Checkpoints written before: today's (AdamW, Muon) and an earlier release's load through the
real `andrea train --resume` and `andrea eval` and continue with the losses the code that
wrote them gives; trainer_state.json has one owner, TrainerState; step folders are named and
read in one place. tests/fixtures/checkpoints/README.md says how each fixture was made."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, andrea_main, assert_user_error

from andrea.errors import UserError
from andrea.train import checkpoint as ckpt_io
from andrea.train.rundir import TrainerState, step_dir_name, step_of_dir

FIXTURES = REPO / "tests" / "fixtures" / "checkpoints"
TODAY = ("adamw", "muon")  # written by the code before TrainerState
RELEASE = "release-4a71d5f"  # the first release that trained: 9 of today's 16 keys
# Every fixture is one run at its step 3 of 6 (the tiny preset at d_model 16, fp32).
# What resuming it gave with the code that wrote today's fixtures, {step: loss} of the train
# events and {step: val loss} of the eval events after step 3. "longer": the release's
# fixture resumed with train.max_steps=8 (its checkpoint records no max_steps: the schedule is
# re-planned from the run's config).
OLD_LOSSES = {
    "adamw": ({4: 5.651175498962402, 5: 5.576634407043457, 6: 5.525915622711182},
              {6: 5.501831650733948}),
    "muon": ({4: 5.663552284240723, 5: 5.595861911773682, 6: 5.547783851623535},
             {6: 5.5237802267074585}),
    RELEASE: ({4: 5.651175498962402, 5: 5.576634407043457, 6: 5.525915622711182},
              {6: 5.501831650733948}),
    "longer": ({4: 5.651175498962402, 5: 5.576634407043457, 6: 5.505331039428711,
                7: 5.456680774688721, 8: 5.415761470794678},
               {6: 5.452580094337463, 8: 5.410796523094177}),
}
# `andrea eval --max-tokens 8192 --precision fp32` of each fixture with that code.
OLD_EVAL = {"adamw": 5.645872890949249, "muon": 5.658008098602295, RELEASE: 5.645872890949249}
# The fixtures were written on one CPU; another rounds fp32 sums in another order (its vector
# width, its thread count), which moves a loss in the 7th digit: 1e-5 relative is far above
# that and far below what any change to the state a resume restores does.
RTOL = 1e-5


def state_text(ckpt: Path) -> str:
    return (ckpt / "trainer_state.json").read_text()


def events(run_dir: Path, event: str, after: int) -> dict[int, float]:
    key = "loss" if event == "train" else "val_loss"
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r[key] for r in records if r["event"] == event and r["step"] > after}


@pytest.mark.parametrize("name", TODAY)
def test_trainer_state_is_written_byte_for_byte_as_before(name):
    text = state_text(FIXTURES / name / "step-000003")
    state = TrainerState.from_dict(json.loads(text))
    assert json.dumps(state.to_dict(), indent=1) == text  # same keys, order, values, spacing


def test_an_earlier_releases_trainer_state_means_what_it_did():
    raw = json.loads(state_text(FIXTURES / RELEASE / "step-000003"))
    assert "micro_batch_size" not in raw and "max_steps" not in raw  # the fixture is old
    state = TrainerState.from_dict(raw)
    assert (state.step, state.tokens, state.preset) == (3, 1536, "andrea-tiny")
    assert state.parallel is None  # train.parallel.mode_before_recorded says which it was
    assert state.max_steps is None and state.schedule_anchor is None and state.spike_guard is None
    assert state.recorded_micro_batch(1, "cpu") is None  # nothing recorded to reuse
    assert state.recorded_tokens_per_step(64) is None
    # Before tokens_per_step and device: one micro-batch per process, on this device.
    two = TrainerState.from_dict({**raw, "world_size": 2, "micro_batch_size": 8})
    assert two.recorded_tokens_per_step(64) == 8 * 64 * 2
    assert two.recorded_micro_batch(2, "cuda") == 8 and two.recorded_micro_batch(1, "cpu") is None
    later = TrainerState.from_dict({**raw, "micro_batch_size": 8, "device": "cpu"})
    assert later.recorded_micro_batch(1, "cuda") is None


def test_a_trainer_state_of_a_step_alone_reads_each_absent_key_as_declared():
    """The oldest reading: every key but the step absent, each read as what its absence
    meant before TrainerState's fields declared it (data_position: the step)."""
    state = TrainerState.from_dict({"step": 5, "unknown": 1})
    assert state == TrainerState(step=5, tokens=0, data_position=5, world_size=1, seed=0)
    assert list(state.to_dict()) == [  # attention once recorded; loss_scaling: fp16's only
        "step", "tokens", "data_position", "best_val_loss", "best_val_step", "skipped_steps",
        "world_size", "seed", "preset", "micro_batch_size", "parallel", "tokens_per_step",
        "device", "max_steps", "schedule_anchor", "spike_guard"]
    assert state.attention is None  # not recorded: model.attention resolves afresh
    recorded = list(TrainerState(step=1, attention="sdpa").to_dict())
    assert recorded[recorded.index("device") + 1] == "attention"
    assert list(TrainerState(step=1, loss_scaling={"scale": 2.0}).to_dict())[-1] == "loss_scaling"


def test_an_imports_trainer_state_keeps_its_keys():
    state = TrainerState(step=0, seed=7, preset="imported", imported_from="/x",
                         imported_sha256="ab")
    assert list(state.to_dict()) == [
        "step", "tokens", "data_position", "best_val_loss", "best_val_step", "skipped_steps",
        "world_size", "seed", "preset", "imported_from", "imported_sha256"]
    assert TrainerState.from_dict(state.to_dict()) == state


def test_a_trainer_state_without_a_step_is_a_one_line_error(tmp_path):
    shutil.copytree(FIXTURES / "adamw", tmp_path / "r")
    (tmp_path / "r" / "step-000003" / "trainer_state.json").write_text('{"tokens": 1}')
    with pytest.raises(UserError, match="trainer_state.json: not a trainer state"):
        ckpt_io.read_trainer_state(tmp_path / "r" / "step-000003")
    assert_user_error(andrea_main("train", "--resume", str(tmp_path / "r")),
                      "the latest checkpoint, step-000003, is damaged (trainer_state.json is "
                      "damaged: not a trainer state (no 'step'))",
                      "the run has no intact checkpoint")


def test_step_folder_names_both_ways():
    for step in (0, 7, 123_456, 1_234_567):
        assert step_of_dir(Path(step_dir_name(step))) == step
    for name in ("step-", "step-x1", "step-000003.partial-12", "latest", "steps-000001"):
        assert step_of_dir(Path(name)) is None


@pytest.mark.parametrize("name", [*TODAY, RELEASE, "longer"])
def test_a_checkpoint_written_before_resumes_with_the_same_losses(tmp_path, data_dir, name):
    fixture = RELEASE if name == "longer" else name
    run_dir = tmp_path / "runs" / name
    shutil.copytree(FIXTURES / fixture, run_dir)
    more = ["--set", "train.max_steps=8"] if name == "longer" else []
    proc = andrea_main("train", "--resume", str(run_dir), "--set", f"data.dir={data_dir}",
                       *more, "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    train, val = OLD_LOSSES[name]
    assert events(run_dir, "train", 3) == pytest.approx(train, rel=RTOL)
    assert events(run_dir, "eval", 3) == pytest.approx(val, rel=RTOL)
    # Written before the attention backend was recorded: model.attention resolves as it did.
    assert "attention: sdpa (auto: no GPU)" in proc.stdout
    assert "resume: attention" not in proc.stdout
    # The checkpoint it writes has today's keys in today's order, whatever it resumed from.
    end = run_dir / step_dir_name(max(train))
    written = json.loads(state_text(end))
    keys = list(json.loads(state_text(FIXTURES / "adamw" / "step-000003")))
    muon = ["muon_ns_precision"] if name == "muon" else []  # recorded where there is Muon
    assert list(written) == [*keys[:keys.index("device") + 1], "attention", "precision", *muon,
                             *keys[keys.index("device") + 1:], "data"]
    assert (written["attention"], written["precision"]) == ("sdpa", "fp32")
    assert [d["dir"] for d in written["data"]] == [str(data_dir.resolve())]
    assert (written["step"], written["tokens"], written["max_steps"]) == (
        max(train), max(train) * 512, max(train))
    assert (written["schedule_anchor"] is None) == (name != "longer")


def test_checkpoints_written_before_evaluate_as_before(tmp_path, data_dir):
    names = [*TODAY, RELEASE]
    args = [a for n in names for a in ("--checkpoint", str(FIXTURES / n))]
    proc = andrea_main("eval", *args, "--data", str(data_dir), "--max-tokens", "8192",
                       "--precision", "fp32", "--no-progress", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert [r["step"] for r in results] == [3, 3, 3]
    assert [r["loss"] for r in results] == pytest.approx([OLD_EVAL[n] for n in names], rel=RTOL)


def test_a_resumed_session_records_what_its_checkpoint_recorded(tmp_path, data_dir, capsys):
    """TrainingState.restore takes up every counter and record that TrainingState.record wrote
    (with fp16's loss scale and the spike guard's window, both non-trivial here): the two
    directions are one object's, and a session resumed from a checkpoint would write it back
    as it was."""
    import torch

    from andrea.config import load_config
    from andrea.train.loop import train
    from andrea.train.rundir import read_state
    from andrea.train.runlock import TrainingLocks
    from andrea.train.setup import set_up
    from andrea.train.signals import SignalWatch
    from andrea.train.torchrun import DistInfo
    from andrea.train.training_state import TrainingState

    cfg = load_config("andrea-tiny", [
        f"data.dir={data_dir}", f"train.runs_dir={tmp_path / 'runs'}", "train.name=r",
        "train.max_steps=6", "train.eval_every=2", "train.checkpoint_every=0",
        "train.precision=fp16", "train.micro_batch_size=2", "train.spike_guard=skip"])
    first = train(cfg, progress=False, stop_after=3)
    written = read_state(first.checkpoint)
    assert written.loss_scaling and written.spike_guard["window"] and written.best_val_loss
    with TrainingLocks() as locks, SignalWatch() as signals:
        s = set_up(load_config(first.run_dir / "config.yaml"), torch.device("cpu"), DistInfo(),
                   signals, locks, resume=str(first.run_dir), overwrite=False)
        s.log.close()
    assert TrainingState(s).record() == written
    assert (s.checkpoint, s.checkpoint_step) == (first.checkpoint, 3)
