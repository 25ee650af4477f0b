"""Config loading: presets, overrides, and every error class through the real command."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import yaml
from conftest import assert_user_error, run_andrea

from andrea.config import TrainConfig, load_config
from andrea.errors import UserError


def write(tmp_path, text: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_presets_match_design_table():
    small = load_config("andrea-12m.yaml").model
    assert (small.n_layer, small.n_head, small.head_dim, small.d_model) == (6, 12, 32, 384)
    assert (small.block_size, small.vocab_size) == (256, 4096)
    big = load_config("andrea-120m").model  # the .yaml suffix is optional
    assert (big.n_layer, big.n_head, big.head_dim, big.d_model) == (12, 12, 64, 768)
    assert (big.block_size, big.vocab_size) == (1024, 50304)
    assert load_config("andrea-120m").data.tokenizer == "gpt2"


def test_overrides_are_typed_and_applied():
    cfg = load_config("andrea-12m", ["train.lr=3e-4", "model.n_layer=4", "train.compile=true"])
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.model.n_layer == 4
    assert cfg.train.compile is True
    with pytest.raises(UserError, match="model.n_layer: expected an integer"):
        load_config("andrea-12m", ["model.n_layer=four"])


def test_path_and_d_model_derivation(tmp_path):
    path = write(tmp_path, "model: {n_head: 2, head_dim: 8, d_model: 16}\n")
    cfg = load_config(str(path))
    assert cfg.model.d_model == 16
    assert cfg.train.name == "cfg"  # run name defaults to the file's stem


def test_config_show_prints_resolved_yaml():
    proc = run_andrea("config", "show", "--config", "andrea-12m.yaml", "--set", "train.lr=2e-4")
    assert proc.returncode == 0, proc.stderr
    shown = yaml.safe_load(proc.stdout)
    assert shown["model"]["d_model"] == 384
    assert shown["train"]["lr"] == pytest.approx(2e-4)
    assert set(shown) == {"model", "data", "train"}


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("model:\n  n_haed: 4\n", ["model.n_haed", "did you mean 'model.n_head'"]),
        ("modle:\n  n_head: 4\n", ["unknown section 'modle'", "did you mean 'model'"]),
        ("model:\n  n_head: four\n", ["model.n_head", "expected an integer", "'four'"]),
        ("train:\n  compile: 3\n", ["train.compile", "true or false"]),
        ("model:\n  n_layer: 0\n", ["model.n_layer", "positive"]),
        ("model:\n  block_size: -5\n", ["model.block_size", "positive"]),
        ("model:\n  dropout: 1.0\n", ["model.dropout", "[0, 1)"]),
        ("model:\n  dropout: -0.1\n", ["model.dropout", "[0, 1)"]),
        (
            "model:\n  n_head: 12\n  head_dim: 64\n  d_model: 512\n",
            ["model.d_model", "512", "12 * 64 = 768"],
        ),
        ("train:\n  schedule: cosin\n", ["train.schedule", "did you mean 'cosine'"]),
        ("model:\n  n_head: 4\n   head_dim: 8\n", ["YAML syntax error", "line 3"]),
        ("train:\n  name: ../elsewhere\n", ["train.name", "'../elsewhere'", "not a folder name"]),
        ("train:\n  name: ..\n", ["train.name", "not a folder name"]),
    ],
)
def test_config_errors_through_the_cli(tmp_path, text, fragments):
    path = write(tmp_path, text)
    proc = run_andrea("count-params", "--config", str(path))
    assert_user_error(proc, str(path), *fragments)


def test_missing_file_names_it_and_the_presets(tmp_path):
    missing = tmp_path / "nope.yaml"
    proc = run_andrea("count-params", "--config", str(missing))
    assert_user_error(proc, str(missing), "andrea-12m.yaml")


def test_override_errors_through_the_cli():
    proc = run_andrea("config", "show", "-c", "andrea-12m", "--set", "model.n_layer=2.5")
    assert_user_error(proc, "--set model.n_layer=2.5", "expected an integer")
    proc = run_andrea("config", "show", "-c", "andrea-12m", "--set", "trian.lr=1")
    assert_user_error(proc, "trian.lr", "did you mean 'train'")
    proc = run_andrea("config", "show", "-c", "andrea-12m", "--set", "train.lr")
    assert_user_error(proc, "SECTION.KEY=VALUE")


def test_unknown_keys_suggest_only_close_matches_else_list_the_section():
    def err(key: str) -> str:
        return assert_user_error(run_andrea("config", "show", "-c", "andrea-tiny", "--set",
                                            f"{key}=1"), f"'{key}'")

    assert err("train.max_step").endswith("did you mean 'train.max_steps'?")
    for far in ("train.nope", "train.steps"):  # once 'train.compile' and 'train.eps'
        line = err(far)
        assert "did you mean" not in line
        assert line.endswith("; the train keys are: " + ", ".join(
            f.name for f in dataclasses.fields(TrainConfig)))
    assert "the model keys are: n_layer, n_head, head_dim, d_model," in err("model.layers")
