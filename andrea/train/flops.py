"""Model FLOPs per token and the peak they are measured against (for MFU).

FLOPs per trained token = 6·N + 12·n_layer·d_model·T: 6 per parameter for the forward and
backward matmuls (N counts the token embedding, which is also the LM head, and leaves out the
position embedding, a lookup), plus the attention scores and their product with V over the T
positions of the token's window (PaLM's accounting; the causal mask's skipped half is counted,
as FlashAttention papers do). T is block_size, or a sequence-length warm-up's shorter length.
"""

from __future__ import annotations

import re

import torch

from andrea.config import ModelConfig
from andrea.train.device import DTYPES

# Dense peak FLOP/s by the dtype a run computes in (train.precision), for the GPUs people train
# on; a GPU is found by its name as torch.cuda.get_device_name() gives it (a key matching as
# whole words, the first that matches). From each vendor datasheet or architecture whitepaper,
# the dense figure (not "with sparsity"), the tensor-core rate with fp32 accumulation (what
# autocast's matmuls use; GeForce Turing/Ampere/Ada cards halve it against fp16 accumulation),
# and fp32 on the CUDA cores (andrea leaves TF32 off). No bf16 before Ampere (sm_80).
#   T4: NVIDIA T4 datasheet (65 fp16 "mixed precision", 8.1 fp32)
#   P100: Tesla P100 datasheet, PCIe 16 GB (18.7 fp16, 9.3 fp32; no tensor cores); SXM2 21.2/10.6
#   V100: Tesla V100 datasheet, SXM2 (125 tensor, 15.7 fp32); PCIe 112/14
#   RTX 2080 Ti: Turing whitepaper, reference clocks (53.8 fp16 with fp32 accumulate, 13.4)
#   RTX 3090: Ampere GA102 whitepaper (71 fp16/bf16 with fp32 accumulate, 35.6)
#   RTX 4090: Ada whitepaper (165.2 fp16/bf16 with fp32 accumulate, 82.6)
#   A10: NVIDIA A10 datasheet (125 bf16/fp16, 31.2); A100: A100 datasheet (312, 19.5)
#   L4: NVIDIA L4 datasheet (121 bf16/fp16, 30.3); L40S: L40S datasheet (362.05, 91.6)
#   H100: H100 datasheet, SXM (989 bf16/fp16, 67 fp32); PCIe 756/51; H200: H200 datasheet (989, 67)
TERA = 1e12
GPU_PEAKS: dict[str, dict[str, float]] = {
    "T4": {"fp16": 65 * TERA, "fp32": 8.1 * TERA},
    "P100-SXM2": {"fp16": 21.2 * TERA, "fp32": 10.6 * TERA},
    "P100": {"fp16": 18.7 * TERA, "fp32": 9.3 * TERA},
    "V100-PCIE": {"fp16": 112 * TERA, "fp32": 14 * TERA},
    "V100": {"fp16": 125 * TERA, "fp32": 15.7 * TERA},
    "RTX 2080 Ti": {"fp16": 53.8 * TERA, "fp32": 13.4 * TERA},
    "RTX 3090": {"fp16": 71 * TERA, "bf16": 71 * TERA, "fp32": 35.6 * TERA},
    "RTX 4090": {"fp16": 165.2 * TERA, "bf16": 165.2 * TERA, "fp32": 82.6 * TERA},
    "A10": {"fp16": 125 * TERA, "bf16": 125 * TERA, "fp32": 31.2 * TERA},
    "A100": {"fp16": 312 * TERA, "bf16": 312 * TERA, "fp32": 19.5 * TERA},
    "L4": {"fp16": 121 * TERA, "bf16": 121 * TERA, "fp32": 30.3 * TERA},
    "L40S": {"fp16": 362.05 * TERA, "bf16": 362.05 * TERA, "fp32": 91.6 * TERA},
    "H100 PCIe": {"fp16": 756 * TERA, "bf16": 756 * TERA, "fp32": 51 * TERA},
    "H100": {"fp16": 989 * TERA, "bf16": 989 * TERA, "fp32": 67 * TERA},
    "H200": {"fp16": 989 * TERA, "bf16": 989 * TERA, "fp32": 67 * TERA},
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def gpu_peak(name: str, dtype: torch.dtype) -> float | None:
    """The dense peak FLOP/s of the GPU called `name` in `dtype`, or None (not listed, or no
    such units: bf16 on a T4)."""
    for key, peaks in GPU_PEAKS.items():
        if re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", name):
            return peaks.get(DTYPE_NAMES.get(dtype, ""))
    return None


def flops_per_token(cfg: ModelConfig, n_params: int, seq_len: int | None = None) -> float:
    """Model FLOPs of one token trained in windows of `seq_len` tokens (block_size if None)."""
    n = n_params - cfg.block_size * cfg.d_model
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * (seq_len or cfg.block_size)


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
# 1024^3 matmuls reads anywhere from half to all of the machine depending on the neighbours, so
# the same run would read 58-98% against it, or above 100%.
CPU_NO_MFU = (
    "MFU is n/a on a CPU: its peak FLOP/s is not known here and a measured one varies with the "
    "machine's load; compare tokens/s with a baseline instead"
)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s in `dtype` for MFU, or None (MFU then reads "n/a"): a CPU
    (see CPU_NO_MFU) or a GPU not in GPU_PEAKS."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), dtype)
    return None


def no_mfu_reason(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why MFU reads n/a on `device` in `dtype` (one line), or None when it has a known peak."""
    if device.type == "cpu":
        return CPU_NO_MFU
    if peak_flops(device, dtype) is not None:
        return None
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return (f"MFU is n/a: no {DTYPE_NAMES.get(dtype, dtype)} peak FLOP/s known for {what} "
            f"(andrea/train/flops.py GPU_PEAKS)")


class MfuMeter:
    """MFU for one run against the device's peak, looked up once; None where there is none
    (no_mfu_reason says why). `devices`: how many devices (processes) the model FLOP/s given to it
    are shared among; MFU is per device, so 8 GPUs at one GPU's utilisation read as that one's."""

    def __init__(self, device: torch.device, dtype: torch.dtype, devices: int = 1) -> None:
        self.devices = devices
        self.peak = peak_flops(device, dtype)

    def __call__(self, flops_per_s: float) -> float | None:
        """MFU of `flops_per_s` model FLOP/s (tokens/s x flops_per_token) over all devices."""
        return mfu(flops_per_s / self.devices, self.peak)


def mfu(flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation of one device, or None when the peak is unknown or the figure
    impossible (above 1: a wrong peak, never printed)."""
    if peak is None or peak <= 0 or flops_per_s <= 0:
        return None
    value = flops_per_s / peak
    return value if value <= 1.0 else None


