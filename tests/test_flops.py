"""MFU: a figure only against a known peak (a listed GPU); n/a on a CPU, with the reason."""

from __future__ import annotations

import pytest
import torch

from andrea.train.flops import CPU_NO_MFU, MfuMeter, mfu, no_mfu_reason, peak_flops
from andrea.train.metrics import format_mfu


def test_mfu_is_na_where_the_peak_is_unknown():
    assert peak_flops(torch.device("meta"), torch.float32) is None
    assert format_mfu(mfu(1e9, None)) == "n/a"
    assert mfu(1e9, 1e12) == pytest.approx(1e-3)
    assert format_mfu(mfu(1e9, 1e12)) == "0.1%"
    assert mfu(1e9, 1e8) is None  # above 100%: a wrong peak, never printed
    assert "no bf16 peak FLOP/s known for meta" in no_mfu_reason(torch.device("meta"))


def test_a_cpu_has_no_mfu_and_says_why(tmp_path, monkeypatch):
    """Not a probed peak (it varied with the machine's load, so MFU jumped between runs and
    steps): every rate reads n/a, and nothing is measured or cached."""
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path))
    for dtype in (torch.float32, torch.bfloat16):
        meter = MfuMeter(torch.device("cpu"), dtype)
        assert meter.peak is None and no_mfu_reason(torch.device("cpu"), dtype) == CPU_NO_MFU
        assert [meter(rate) for rate in (1.0, 1e6, 1e9, 1e12)] == [None] * 4
    assert "n/a on a CPU" in CPU_NO_MFU and "tokens/s" in CPU_NO_MFU
    assert list(tmp_path.iterdir()) == []


def test_a_listed_gpu_gets_its_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    meter = MfuMeter(torch.device("cuda"), torch.bfloat16)
    assert meter.peak == 989e12 and no_mfu_reason(torch.device("cuda")) is None
    assert meter(989e12 / 2) == pytest.approx(0.5)
    assert MfuMeter(torch.device("cuda"), torch.bfloat16, devices=8)(8 * 0.4 * 989e12) == (
        pytest.approx(0.4))  # per device
    # Against the device's own peak in the dtype the run computes in, found by whole words.
    for name, dtype, peak in [
        ("Tesla T4", torch.float16, 65e12), ("Tesla T4", torch.float32, 8.1e12),
        ("NVIDIA A10", torch.bfloat16, 125e12), ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert MfuMeter(torch.device("cuda"), dtype).peak == pytest.approx(peak), name
    for name, dtype in [("Tesla T4", torch.bfloat16), ("NVIDIA A10G", torch.float16)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        meter = MfuMeter(torch.device("cuda"), dtype)
        # no bf16 units; unlisted
        assert meter.peak is None and name in no_mfu_reason(torch.device("cuda"), dtype), name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU 9")
    meter = MfuMeter(torch.device("cuda"), torch.bfloat16)
    assert meter(1e12) is None and "Mystery GPU 9" in no_mfu_reason(torch.device("cuda"))


def test_mfu_counts_a_sequence_warm_ups_shorter_windows(tmp_path, data_dir, monkeypatch):
    """A token trained in a window of T positions costs 6·N + 12·n_layer·d_model·T FLOPs: during
    a sequence-length warm-up T is the shorter length, so each step's MFU and the run's (its
    steps' FLOPs over their seconds, warm-up steps left out as for tokens/s) count that, not
    block_size. A GPU's peak is patched in: a CPU has none."""
    from conftest import tiny_config

    import andrea.train.flops as flops
    from andrea.model.transformer import Andrea
    from andrea.runs import read_metrics
    from andrea.train.loop import train
    from andrea.train.metrics import recorded_speed

    peak = 3e11  # MFU readable at 4 decimals from 300 to 300,000 tokens/s
    monkeypatch.setattr(flops, "peak_flops", lambda device, dtype: peak)
    cfg = tiny_config(tmp_path, data_dir, "train.max_steps=6", "train.seq_warmup_length=16",
                      "train.seq_warmup_steps=3")
    assert train(cfg, progress=False).state == "finished"
    m = cfg.model
    n = Andrea(m).num_params() - m.block_size * m.d_model  # the position embedding left out

    def per_token(length: int) -> float:
        return 6 * n + 12 * m.n_layer * m.d_model * length

    records, _ = read_metrics(tmp_path / "t" / "metrics.jsonl")
    steps = [r for r in records if r["event"] == "train"]
    lengths = [16, 16, 16, 64, 64, 64]
    assert len(steps) == 6
    for r, length in zip(steps, lengths, strict=True):
        expected = r["tokens_per_s"] * per_token(length) / peak
        assert r["mfu"] == pytest.approx(expected, rel=1e-3, abs=6e-5), (r, length)
    # The run's: the first step of each window length warms up and is left out.
    tokens = [r["tokens"] for r in steps]
    tokens = [b - a for a, b in zip([0, *tokens[:-1]], tokens, strict=True)]
    timed = [1, 2, 4, 5]
    model_flops = sum(tokens[i] * per_token(lengths[i]) for i in timed)
    end = records[-1]
    assert end["event"] == "end" and end["warmup_steps"] == 2
    assert end["train_tokens"] == sum(tokens[i] for i in timed)
    assert end["mfu"] == pytest.approx(model_flops / end["train_seconds"] / peak, rel=1e-3,
                                       abs=6e-5)
    # A run without its end record (still going, or killed) reads the last step's train_mfu.
    assert steps[-1]["train_mfu"] == end["mfu"]
    records[-1:] = []
    assert recorded_speed(records)[1] == end["mfu"]
