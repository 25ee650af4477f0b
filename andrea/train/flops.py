"""Model FLOPs per token and the peak they are measured against (for MFU).

FLOPs per trained token = 6·N + 12·n_layer·d_model·block_size: 6 per parameter for the forward and
backward matmuls (N counts the token embedding, which is also the LM head, and leaves out the
position embedding, a lookup), plus the attention scores and their product with V (PaLM's
accounting; the causal mask's skipped half is counted, as FlashAttention papers do).
"""

from __future__ import annotations

import torch

from andrea.config import ModelConfig

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


# Why a CPU gets no MFU. A CPU's peak is not knowable from here (FMA units per core, AMX, clocks
# hidden by the hypervisor: three 2-core machines of this project differ 6x in bf16 matmul
# rate), and a measured matmul rate is no substitute on a shared machine: a probe of a few
# 1024^3 matmuls read anywhere from half to all of the machine depending on the neighbours,
# was cached and reused by later runs, so the same run printed 58-98% or "n/a" (above 100%).
CPU_NO_MFU = (
    "MFU is n/a on a CPU: its peak FLOP/s is not known here and a measured one varies with the "
    "machine's load; compare tokens/s with a baseline instead"
)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense bf16 peak FLOP/s for MFU, or None (MFU then reads "n/a"): a CPU (see CPU_NO_MFU)
    or a GPU not in GPU_PEAK_BF16."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                # fp32 runs on TF32 or CUDA cores; quoting MFU against the bf16 peak stays honest.
                return peak
    return None


def no_mfu_reason(device: torch.device) -> str | None:
    """Why MFU reads n/a on `device` (one line), or None when it has a known peak."""
    if device.type == "cpu":
        return CPU_NO_MFU
    if peak_flops(device, torch.bfloat16) is not None:
        return None
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"MFU is n/a: no peak FLOP/s known for {what} (andrea/train/flops.py GPU_PEAK_BF16)"


class MfuMeter:
    """MFU for one run against the device's peak, looked up once; None where there is none
    (`why_na` says why). `devices`: how many devices (processes) the tokens/s given to it are
    shared among; MFU is per device, so 8 GPUs at one GPU's utilisation read as that one's."""

    def __init__(self, device: torch.device, dtype: torch.dtype, flops_token: float,
                 devices: int = 1) -> None:
        self.device, self.dtype, self.flops_token = device, dtype, flops_token
        self.devices = devices
        self.peak = peak_flops(device, dtype)
        self.why_na = no_mfu_reason(device)

    def __call__(self, tokens_per_s: float) -> float | None:
        return mfu(tokens_per_s / self.devices, self.flops_token, self.peak)


def mfu(tokens_per_s: float, flops_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None when the peak is unknown or the figure impossible
    (above 1: a wrong peak, never printed)."""
    if peak is None or peak <= 0 or tokens_per_s <= 0:
        return None
    value = tokens_per_s * flops_token / peak
    return value if value <= 1.0 else None


def format_mfu(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"
