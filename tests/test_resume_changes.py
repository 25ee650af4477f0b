"""What a user changes between stopping a run and resuming it: the keys a resume may change,
and those it refuses in one line, however the change is made."""

from __future__ import annotations

import shutil

import pytest
from conftest import andrea_main, assert_user_error


@pytest.mark.parametrize("edit", [("  lr: 0.003\n", "  lr: 0.001\n", "train.lr 0.001"),
                                  ("optimizer: adamw", "optimizer: muon", "train.optimizer muon")])
def test_a_fixed_key_edited_in_the_runs_config_yaml_is_refused_as_its_set_is(
    tmp_path, trained_tiny, edit
):
    """Before: train.lr edited in runs/t/config.yaml between stop and resume trained on at the
    new lr (the schedule jumping to it) without a word, where --set train.lr was refused; an
    edited train.optimizer called the checkpoint's optimizer state damaged and sent the user to
    another step folder, which failed the same way. Now both are the one line --set gets,
    naming config.yaml, the key, and what the checkpoint was trained with."""
    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    config = run / "config.yaml"
    old, new, named = edit
    assert old in config.read_text()
    config.write_text(config.read_text().replace(old, new))
    line = assert_user_error(
        andrea_main("train", "--resume", str(run / "step-000020"), "--no-progress"),
        f"{config}: {named} where {run / 'step-000020'} was trained with",
        "put them back as the run trained them")
    assert "damaged" not in line
    assert (run / "latest").read_text().strip() == "step-000040"  # nothing written
