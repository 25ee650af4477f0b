"""Parameter counts: docs/model.md's exact figures, through the package and the real command."""

from __future__ import annotations

import json

import pytest
from conftest import andrea_main

from andrea.config import load_config
from andrea.model.params import closed_form_total, count_params
from andrea.model.transformer import Andrea


@pytest.mark.parametrize(
    "preset, per_layer_attention, attention_total, total",
    [
        ("andrea-120m.yaml", 2_359_296, 28_311_552, 124_373_760),
        ("andrea-12m.yaml", 589_824, 3_538_944, 12_292_992),
        ("andrea-350m.yaml", 4_194_304, 100_663_296, 354_599_936),
        ("andrea-770m.yaml", 6_553_600, 235_929_600, 773_582_080),
        ("andrea-1.5b.yaml", 10_240_000, 491_520_000, 1_556_840_000),
    ],
)
def test_count_params_cli(preset, per_layer_attention, attention_total, total):
    proc = andrea_main("count-params", "--config", preset, "--json")
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout)
    assert counts["attention_per_layer"] == per_layer_attention
    assert counts["attention_total"] == attention_total
    assert counts["total"] == total
    d = load_config(preset).model.d_model
    assert counts["w_q"] == counts["w_k"] == counts["w_v"] == counts["w_o"] == d * d
    assert counts["attention_share"] == pytest.approx(attention_total / total)

    cfg = load_config(preset)
    assert counts["total"] == closed_form_total(cfg.model)
    table = andrea_main("count-params", "--config", preset).stdout
    assert f"{total:,}" in table and f"{per_layer_attention:,}" in table


def test_meta_count_matches_a_real_model_and_biases():
    cfg = load_config("andrea-tiny", ["model.bias=true"]).model
    real = Andrea(cfg)
    unique = {id(p): p.numel() for p in real.parameters()}
    assert sum(unique.values()) == count_params(cfg).total == closed_form_total(cfg)
    assert count_params(cfg).attention_bias == 4 * cfg.d_model



def test_count_params_builds_one_block_whatever_n_layer(monkeypatch):
    """Before: every block was built on the meta device, 4 GB and over 5 minutes for
    model.n_layer 10^6 (what a user checks before training such a model)."""
    from andrea.model import transformer

    built = []
    block_init = transformer.Block.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        block_init(self, *args, **kwargs)

    monkeypatch.setattr(transformer.Block, "__init__", counted)
    for bias in ("false", "true"):
        cfg = load_config("andrea-tiny", ["model.n_layer=300", f"model.bias={bias}"]).model
        counts = count_params(cfg)  # checks the total against the closed form itself
        assert counts.total == closed_form_total(cfg) and counts.n_layer == 300
        assert counts.norms_total == (2 * 300 + 1) * cfg.d_model * (2 if bias == "true" else 1)
    assert len(built) == 2
    proc = andrea_main("count-params", "--config", "andrea-tiny", "--set",
                       "model.n_layer=1000000", "--json")
    assert proc.returncode == 0, proc.stderr
    cfg = load_config("andrea-tiny", ["model.n_layer=1000000"]).model
    assert json.loads(proc.stdout)["total"] == closed_form_total(cfg) == 49_280_024_640


@pytest.mark.parametrize(
    "preset, n_layer, n_head, d_model",
    [("andrea-350m", 24, 16, 1024), ("andrea-770m", 36, 20, 1280), ("andrea-1.5b", 48, 25, 1600)],
)
def test_larger_presets_shape(preset, n_layer, n_head, d_model):
    cfg = load_config(preset)
    m = cfg.model
    assert (m.n_layer, m.n_head, m.head_dim, m.d_model) == (n_layer, n_head, 64, d_model)
    assert (m.block_size, m.vocab_size, m.bias) == (1024, 50304, False)
    assert cfg.data.tokenizer == "gpt2" and cfg.train.micro_batch_size == "auto"
