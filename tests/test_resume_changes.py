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


def test_a_resume_pointed_at_another_runs_data_names_no_set_it_would_refuse(
    tmp_path, trained_tiny
):
    """Before: `--resume RUN --set data.dir=DIR`, DIR holding data prepared from another text,
    was refused with 'to use that data as it is, add to the command what it was prepared with
    (--set data.source=own.txt)', and that --set is one a resume refuses (data.source defines
    the run). Now the line gives only what a resume can do: another data.dir, or that folder
    prepared again."""
    from andrea.config import load_config
    from andrea.data.prepare import ensure_prepared

    text = tmp_path / "own.txt"
    text.write_text("another text to train on, repeated. " * 3000)
    other = tmp_path / "other-byte"
    ensure_prepared(load_config("andrea-tiny", [f"data.source={text}", f"data.dir={other}"]))
    run = tmp_path / "t"
    shutil.copytree(trained_tiny.run_dir, run)
    line = assert_user_error(
        andrea_main("train", "--resume", str(run), "--set", "train.max_steps=41",
                    "--set", f"data.dir={other}", "--no-progress"),
        f"{other}: holds data prepared with source {text}", "use another data folder")
    assert "data.source=" not in line, line
