"""Model FLOPs per token and the peak they are measured against (for MFU).

FLOPs per trained token = 6·N + 12·n_layer·d_model·block_size: 6 per parameter for the forward and
backward matmuls (N counts the token embedding, which is also the LM head, and leaves out the
position embedding, a lookup), plus the attention scores and their product with V (PaLM's
accounting; the causal mask's skipped half is counted, as FlashAttention papers do).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from andrea.config import ModelConfig
from andrea.fileio import atomic_write_text
from andrea.resources import cache_dir

# Dense bf16 tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name().
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is lower, 756e12
    "A100": 312e12,
    "RTX 4090": 165e12,
}


def flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    n = n_params - cfg.block_size * cfg.d_model
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * cfg.block_size


def attention_flops(batch: int, n_head: int, seq_len: int, head_dim: int) -> dict[str, float]:
    """Causal attention FLOPs by mode ("fwd", "bwd", "fwd_bwd"), for `andrea bench`.

    Unlike flops_per_token, the causal mask's skipped half is NOT counted: forward = 2 matmuls of
    2·B·H·T²·D each, halved = 2·B·H·T²·D; backward = 5 such matmuls = 2.5 × forward.
    """
    fwd = 2.0 * batch * n_head * seq_len * seq_len * head_dim
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_cpu_peak(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """The best matmul FLOP/s this CPU reaches in `dtype` with torch's current thread count."""
    g = torch.Generator().manual_seed(0)  # never touch the global RNG a run depends on
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    a @ b  # warm-up: oneDNN picks and caches its kernel on the first call
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def cpu_peak(dtype: torch.dtype, at_least: float = 0.0) -> float:
    """Measured once per (CPU, torch, threads, dtype) and cached on disk. A cached figure below
    `at_least` (a rate a run has reached, so the probe ran on a busy machine) is measured again
    and the higher of the two kept."""
    key = f"{_cpu_model()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{dtype}"
    path = cache_dir() / "cpu_peak.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table or table[key] < at_least:
        table[key] = max(table.get(key, 0.0), measure_cpu_peak(dtype))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(table, indent=1))
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
    return table[key]


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s for MFU, or None when the device is unknown (MFU then reads "n/a")."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                # fp32 runs on TF32 or CUDA cores; quoting MFU against the bf16 peak stays honest.
                return peak
        return None
    if device.type == "cpu":
        return cpu_peak(dtype)
    return None


class MfuMeter:
    """MFU for one run: the device's peak looked up once; on a CPU whose cached peak a run
    outpaces, the peak is probed again once."""

    def __init__(self, device: torch.device, dtype: torch.dtype, flops_token: float) -> None:
        self.device, self.dtype, self.flops_token = device, dtype, flops_token
        self.peak = peak_flops(device, dtype)
        self._reprobed = False

    def __call__(self, tokens_per_s: float) -> float | None:
        value = mfu(tokens_per_s, self.flops_token, self.peak)
        if value is None and self.device.type == "cpu" and not self._reprobed:
            self._reprobed = True
            self.peak = cpu_peak(self.dtype, at_least=tokens_per_s * self.flops_token)
            value = mfu(tokens_per_s, self.flops_token, self.peak)
        return value


def mfu(tokens_per_s: float, flops_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None when unknown or impossible (a peak probed while the
    machine was busy can read below what a run later reaches; that MFU would exceed 1)."""
    if peak is None or peak <= 0 or tokens_per_s <= 0:
        return None
    value = tokens_per_s * flops_token / peak
    return value if value <= 1.0 else None


def format_mfu(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"
