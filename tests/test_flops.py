"""MFU: a figure only against a known peak (a listed GPU); n/a on a CPU, with the reason."""

from __future__ import annotations

import pytest
import torch

from andrea.train.flops import CPU_NO_MFU, MfuMeter, mfu, no_mfu_reason, peak_flops
from andrea.train.metrics import format_mfu


def test_mfu_is_na_where_the_peak_is_unknown():
    assert peak_flops(torch.device("meta"), torch.float32) is None
    assert format_mfu(mfu(1000.0, 1e6, None)) == "n/a"
    assert mfu(1000.0, 1e6, 1e12) == pytest.approx(1e-3)
    assert format_mfu(mfu(1000.0, 1e6, 1e12)) == "0.1%"
    assert mfu(1000.0, 1e6, 1e8) is None  # above 100%: a wrong peak, never printed
    assert "no bf16 peak FLOP/s known for meta" in no_mfu_reason(torch.device("meta"))


def test_a_cpu_has_no_mfu_and_says_why(tmp_path, monkeypatch):
    """Not a probed peak (it varied with the machine's load, so MFU jumped between runs and
    steps): every rate reads n/a, and nothing is measured or cached."""
    monkeypatch.setenv("ANDREA_CACHE_DIR", str(tmp_path))
    for dtype in (torch.float32, torch.bfloat16):
        meter = MfuMeter(torch.device("cpu"), dtype, 1e6)
        assert meter.peak is None and meter.why_na == CPU_NO_MFU
        assert [meter(rate) for rate in (1.0, 1e3, 1e6, 1e9)] == [None] * 4
    assert "n/a on a CPU" in CPU_NO_MFU and "tokens/s" in CPU_NO_MFU
    assert list(tmp_path.iterdir()) == []


def test_a_listed_gpu_gets_its_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    meter = MfuMeter(torch.device("cuda"), torch.bfloat16, 6e9)
    assert meter.peak == 989e12 and meter.why_na is None
    assert meter(989e12 / 6e9 / 2) == pytest.approx(0.5)
    # Against the device's own peak in the dtype the run computes in, found by whole words.
    for name, dtype, peak in [
        ("Tesla T4", torch.float16, 65e12), ("Tesla T4", torch.float32, 8.1e12),
        ("NVIDIA A10", torch.bfloat16, 125e12), ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert MfuMeter(torch.device("cuda"), dtype, 6e9).peak == pytest.approx(peak), name
    for name, dtype in [("Tesla T4", torch.bfloat16), ("NVIDIA A10G", torch.float16)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        meter = MfuMeter(torch.device("cuda"), dtype, 6e9)
        assert meter.peak is None and name in meter.why_na, name  # no bf16 units; unlisted
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU 9")
    meter = MfuMeter(torch.device("cuda"), torch.bfloat16, 6e9)
    assert meter(1e3) is None and "Mystery GPU 9" in meter.why_na
