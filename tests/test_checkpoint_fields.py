"""A checkpoint's trainer state, RNG and optimizer files are untrusted input: a value of another
type or range, a missing or extra key, is refused in one line naming the file, the key and the
value, even where its checksum was recomputed to match (an edit, not a damaged copy)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import andrea_main, assert_user_error
from safetensors.torch import load_file, save_file

import andrea.model.attention  # noqa: F401  (registers the backends a checkpoint may record)
import andrea.train.parallel  # noqa: F401  (and the modes)
from andrea.errors import UserError
from andrea.train.rundir import CHECKSUMS, TRAINER_STATE, TrainerState, read_state


def resign(ckpt: Path, name: str) -> None:
    """checksums.json made to match the file as it is now, as someone editing it would."""
    sums = json.loads((ckpt / CHECKSUMS).read_text())
    sums["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / CHECKSUMS).write_text(json.dumps(sums))


def edit_state(ckpt: Path, key: str, value: object) -> None:
    state = json.loads((ckpt / TRAINER_STATE).read_text())
    state[key] = value
    (ckpt / TRAINER_STATE).write_text(json.dumps(state))
    resign(ckpt, TRAINER_STATE)


@pytest.fixture
def state(trained_tiny) -> dict:
    return json.loads((trained_tiny.checkpoint / TRAINER_STATE).read_text())


BAD_VALUES = [
    ("step", "four"), ("step", None), ("step", -3), ("step", 4.5), ("step", 1e30),
    ("step", True), ("step", 2**64), ("seed", "x"), ("seed", False), ("best_val_loss", "NaN"),
    ("best_val_loss", float("inf")), ("schedule_anchor", {"a": 1}),
    ("schedule_anchor", {"step": 3, "lr": -1}), ("spike_guard", [1, 2]),
    ("spike_guard", {"window": "x"}), ("spike_guard", {"streak": -1}),
    ("spike_guard", {"window": [[1.0, "a"]]}), ("tokens_per_step", 0), ("tokens", -1),
    ("data_position", -100), ("data_position", 1e20), ("world_size", 0),
    ("micro_batch_size", 0), ("micro_batch_size", "auto"), ("device", ""),
    ("device", "cpu\n"), ("attention", "garbage"), ("attention", "auto"),
    ("parallel", "garbage"), ("precision", "auto"), ("precision", "float32"), ("max_steps", 0),
    ("muon_ns_precision", "auto"), ("muon_ns_precision", "fp16"),
    ("loss_scaling", {"scale": 0}), ("loss_scaling", {"evil": 1}), ("preset", 7),
    ("imported_sha256", "xyz"),
    ("data", {"dir": "/d"}), ("data", ["/d"]), ("data", [{"dir": "/d", "train": "ab"}]),
    ("data", [{"dir": "", "train": "ab", "val": "cd"}]),
    ("data", [{"dir": "/d", "train": "ab", "val": "xyz"}]),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES)
def test_a_trainer_state_value_of_another_type_or_range_is_refused(state, key, value):
    with pytest.raises(ValueError, match=f"'{key}' is "):
        TrainerState.from_dict({**state, key: value})


def test_the_trainer_states_andrea_writes_read_back_as_written(state, tmp_path):
    assert TrainerState.from_dict(state).to_dict() == state
    imported = TrainerState(step=0, seed=3, preset="imported", imported_from=str(tmp_path),
                            imported_sha256="0" * 64).to_dict()
    assert TrainerState.from_dict(imported).to_dict() == imported
    assert TrainerState.from_dict({"step": 7}).data_position == 7  # an older file's


def test_a_resume_from_an_edited_trainer_state_names_its_key_and_value(tmp_path, trained_tiny):
    run = tmp_path / "runs" / "x"
    shutil.copytree(trained_tiny.run_dir, run)
    ckpt = run / "step-000040"
    edit_state(ckpt, "step", "four")
    # Refused as any damaged checkpoint is (rundir.checkpoint_problem): before a thing is read.
    for named, what in (("runs/x", "runs/x: the latest checkpoint, step-000040, is damaged"),
                        ("runs/x/step-000040", "runs/x/step-000040: damaged checkpoint")):
        assert_user_error(andrea_main("train", "--resume", named, cwd=tmp_path),
                          f"{what} ({TRAINER_STATE} is damaged: 'step' is \"four\", not an "
                          f"integer)", "the newest intact checkpoint is runs/x/step-000020: "
                          "andrea train --resume runs/x/step-000020")
    # The other one named is one a resume takes: not one whose trainer state is edited too.
    edit_state(run / "step-000020", "world_size", 0)
    with pytest.raises(UserError, match=r"'step' is \"four\".*the run has no other intact one"):
        read_state(ckpt)


def _cut(t: dict) -> None:
    t["cpu.rank0"] = t["cpu.rank0"][:7]


def _as_float(t: dict) -> None:
    t["cpu.rank0"] = t["cpu.rank0"].float()


def _renamed(t: dict) -> None:
    t["generator"] = t.pop("cpu.rank0")


def _another_rank(t: dict) -> None:
    t["cpu.rank1"] = t["cpu.rank0"].clone()


def _step_of_five(t: dict) -> None:
    t["tok_emb.weight.step"] = t["tok_emb.weight.step"].repeat(5)


def _one_parameter_gone(t: dict) -> None:
    for field in ("exp_avg", "exp_avg_sq", "step"):
        del t[f"tok_emb.weight.{field}"]


def _one_field_gone(t: dict) -> None:
    del t["tok_emb.weight.exp_avg_sq"]


def _leftover(t: dict) -> None:
    t["evil.exp_avg"] = t["tok_emb.weight.exp_avg"].clone()


def _int_moments(t: dict) -> None:
    t["tok_emb.weight.exp_avg"] = t["tok_emb.weight.exp_avg"].to(torch.int32)


EDITS = [
    ("rng.safetensors", _cut, "'cpu.rank0' has dtype uint8 and shape [7], not the "
     f"{torch.get_rng_state().numel()} bytes"),
    ("rng.safetensors", _as_float, "'cpu.rank0' has dtype float32"),
    ("rng.safetensors", _renamed, "no 'cpu.rank0'"),
    ("rng.safetensors", _another_rank, "'cpu.rank1' is no generator of the 1 process"),
    ("optimizer.safetensors", _step_of_five, "'tok_emb.weight.step' has dtype float32 and "
     "shape [5], where the optimizer holds a floating tensor of shape []"),
    ("optimizer.safetensors", _one_parameter_gone, "'tok_emb.weight"),
    ("optimizer.safetensors", _one_field_gone, "no 'tok_emb.weight.exp_avg_sq'"),
    ("optimizer.safetensors", _leftover, "'evil.exp_avg' is no state of this optimizer's"),
    ("optimizer.safetensors", _int_moments, "'tok_emb.weight.exp_avg' has dtype int32"),
]


@pytest.mark.parametrize(("name", "edit", "said"), EDITS, ids=[e[1].__name__ for e in EDITS])
def test_an_edited_rng_or_optimizer_file_is_refused_naming_the_key(
        tmp_path, trained_tiny, name, edit, said):
    run = tmp_path / "runs" / "x"
    shutil.copytree(trained_tiny.run_dir, run)
    path = run / "step-000040" / name
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "andrea-checkpoint/1"})
    resign(path.parent, name)
    assert_user_error(andrea_main("train", "--resume", "runs/x", "--set", "train.max_steps=42",
                                  cwd=tmp_path),
                      f"runs/x/step-000040/{name}: ", said, "the checkpoint is damaged")
    assert (run / "latest").read_text().strip() == "step-000040"  # nothing trained
