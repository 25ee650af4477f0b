"""Which device and precision a run uses: names checked in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from andrea.config import PRECISION_DTYPES
from andrea.errors import UserError


def pick_device(requested: str, key: str = "--device") -> torch.device:
    """'auto' (a GPU if PyTorch sees one, else the CPU), 'cpu', 'cuda' or 'cuda:N'; `key`: the
    option or config key that asked for it, for the errors."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = requested.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise UserError(f"{key} {requested}: expected auto, cpu, cuda or cuda:N")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or int(index or 0) >= count:
            cpu = f"--set {key}=cpu" if "." in key else f"{key} cpu"  # a config key, an option
            way = (f"use {cpu}" if count == 0 else
                   f"use {cpu} or an index below {count}" if count > 1 else f"use {cpu} or cuda")
            raise UserError(f"{key} {requested}: PyTorch sees {count} GPU"
                            f"{'' if count == 1 else 's'}; {way}")
    return torch.device(requested)


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


# Pre-Volta GPUs whose fp16 arithmetic runs at twice their fp32 rate (P100 sm_60, Jetson TX1 sm_53
# and TX2 sm_62): fp16 pays there. Consumer Pascal (sm_61: GTX 10xx, P4, P40) does fp16 at 1/64
# of fp32 and Maxwell (sm_50, sm_52) has no fp16 arithmetic: fp32.
FAST_FP16_BEFORE_VOLTA = ((5, 3), (6, 0), (6, 2))
DTYPES = {name: getattr(torch, dtype) for name, dtype in PRECISION_DTYPES.items()}


@dataclass(frozen=True)
class Precision:
    """The dtype a run computes in (autocast; float32 is none) and why it was chosen."""

    dtype: torch.dtype
    why: str

    @property
    def name(self) -> str:
        return precision_name(self.dtype)


def precision_name(dtype: torch.dtype) -> str:
    """The train.precision that computes in `dtype`: 'fp32' for torch.float32."""
    return next(name for name, named in DTYPES.items() if named == dtype)


def choose_precision(precision: str, device: torch.device) -> Precision:
    """train.precision (and eval's and generate's --precision): a name is obeyed; auto takes
    what the device computes fastest without losing training quality (gpu_precision; a CPU:
    bf16 where it has bf16 units, else fp32)."""
    if precision in DTYPES:
        scaled = "; fp16 with dynamic loss scaling" if precision == "fp16" else ""
        return Precision(DTYPES[precision], "asked for" + scaled)
    if precision != "auto":
        raise UserError(f"precision '{precision}': expected auto, bf16, fp16 or fp32")
    if device.type == "cuda":
        return gpu_precision(torch.cuda.get_device_capability(device))
    if cpu_has_bf16():
        return Precision(torch.bfloat16, "auto: this CPU has bf16 units (AMX or AVX-512 BF16)")
    return Precision(torch.float32, "auto: this CPU has no bf16 units, and fp16 is slower "
                                    "than fp32 on a CPU")


def precision_warning(dtype: torch.dtype, device: torch.device) -> str | None:
    """The warning line for a precision that costs more than it saves on this device: fp16 on
    a CPU, which has no fp16 arithmetic to speed it up (docs/precision.md measured it)."""
    if dtype != torch.float16 or device.type != "cpu":
        return None
    return ("warning: fp16 on a CPU: it ran 3.4 to 6.8 times slower than fp32 on this "
            "project's CPU (docs/precision.md); set train.precision=auto (fp32 on a CPU, bf16 "
            "on one with bf16 units)")


def gpu_precision(capability: tuple[int, int]) -> Precision:
    """precision: auto on a GPU of this compute capability."""
    cc = f"compute capability {capability[0]}.{capability[1]}"
    if capability >= (8, 0):
        return Precision(torch.bfloat16, f"auto: {cc} has bf16 tensor cores")
    if capability >= (7, 0):
        return Precision(torch.float16, f"auto: {cc} has fp16 tensor cores but no bf16 units "
                                        f"(bf16 would be emulated); fp16 with loss scaling")
    if capability in FAST_FP16_BEFORE_VOLTA:
        return Precision(torch.float16, f"auto: {cc} has no tensor cores but computes fp16 at "
                                        f"twice its fp32 rate; fp16 with loss scaling")
    return Precision(torch.float32, f"auto: {cc} computes fp16 far slower than fp32 (or not "
                                    f"at all) and has no bf16")


def pick_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of choose_precision."""
    return choose_precision(precision, device).dtype


def choose_ns_precision(precision: str, device: torch.device) -> Precision:
    """train.muon_ns_precision: bf16 or fp32 by name; auto: bf16 where the device has fast bf16
    matmuls (a GPU's native bf16 units, not their emulation), else fp32. Never fp16: the
    iterations' range is not loss-scaled. Like train.precision's auto it differs from machine
    to machine, so a checkpoint records it (trainer_state.json's muon_ns_precision)."""
    if precision != "auto":
        return Precision(DTYPES[precision], "asked for")
    if device.type == "cuda":
        # Without bf16 units (T4, V100) bf16 is emulated in fp32 and slower than fp32 itself.
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Precision(torch.bfloat16, "auto: this GPU has bf16 units")
        return Precision(torch.float32, "auto: this GPU has no bf16 units (bf16 would be "
                                        "emulated, slower than fp32)")
    if cpu_has_bf16():
        return Precision(torch.bfloat16, "auto: this CPU has bf16 units (AMX or AVX-512 BF16)")
    return Precision(torch.float32, "auto: this CPU has no bf16 units")


def device_name(device: torch.device) -> str:
    """What kind of device this is, as checkpoints record it: 'cpu', or the GPU's model."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def precision_note(precision: str, device: str) -> str:
    """One line for `andrea config show`: what train.precision means on this machine."""
    try:
        dev = pick_device(device, "train.device")
    except UserError as exc:
        return f"train.precision: {precision}, decided when training starts ({exc})"
    chosen = choose_precision(precision, dev)
    return f"train.precision: {precision} -> {chosen.name} on {device_name(dev)} ({chosen.why})"
