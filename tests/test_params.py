"""Parameter counts: DESIGN.md's exact figures, through the package and the real command."""

from __future__ import annotations

import json

import pytest
from conftest import run_andrea

from andrea.config import load_config
from andrea.model.params import closed_form_total, count_params
from andrea.model.transformer import Andrea


@pytest.mark.parametrize(
    "preset, per_layer_attention, attention_total, total",
    [
        ("andrea-120m.yaml", 2_359_296, 28_311_552, 124_373_760),
        ("andrea-12m.yaml", 589_824, 3_538_944, 12_292_992),
    ],
)
def test_count_params_cli(preset, per_layer_attention, attention_total, total):
    proc = run_andrea("count-params", "--config", preset, "--json")
    assert proc.returncode == 0, proc.stderr
    counts = json.loads(proc.stdout)
    assert counts["attention_per_layer"] == per_layer_attention
    assert counts["attention_total"] == attention_total
    assert counts["total"] == total
    d = load_config(preset).model.d_model
    assert counts["w_q"] == counts["w_k"] == counts["w_v"] == counts["w_o"] == d * d
    assert counts["attention_share"] == pytest.approx(attention_total / total)

    table = run_andrea("count-params", "--config", preset).stdout
    assert f"{total:,}" in table and f"{per_layer_attention:,}" in table


def test_meta_count_matches_a_real_model_and_biases():
    cfg = load_config("andrea-tiny", ["model.bias=true"]).model
    real = Andrea(cfg)
    unique = {id(p): p.numel() for p in real.parameters()}
    assert sum(unique.values()) == count_params(cfg).total == closed_form_total(cfg)
    assert count_params(cfg).attention_bias == 4 * cfg.d_model

