"""Which device and precision a run uses: names checked in one place."""

from __future__ import annotations

from pathlib import Path

import torch

from andrea.errors import UserError


def pick_device(requested: str) -> torch.device:
    """'auto' (a GPU if PyTorch sees one, else the CPU), 'cpu', 'cuda' or 'cuda:N'."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = requested.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise UserError(f"device '{requested}': expected auto, cpu, cuda or cuda:N")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or int(index or 0) >= count:
            raise UserError(
                f"device '{requested}': PyTorch sees {count} GPU(s); use cpu or another index"
            )
    return torch.device(requested)


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtype(precision: str, device: torch.device) -> torch.dtype:
    """bf16 autocast where the hardware has fast bf16 matmuls (a GPU's native bf16 units, not
    their emulation), else fp32 (for 'auto'). train.precision and train.muon_ns_precision."""
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if precision != "auto":
        raise UserError(f"precision '{precision}': expected auto, bf16 or fp32")
    if device.type == "cuda":
        # Without bf16 units (T4, V100) bf16 is emulated in fp32 and slower than fp32 itself.
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native else torch.float32
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def device_name(device: torch.device) -> str:
    """What kind of device this is, as checkpoints record it: 'cpu', or the GPU's model."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
