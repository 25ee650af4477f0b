"""Compile gates for kernels/microgpt_cuda.cu (no GPU needed).

nvcc: every kernel instance for sm_80, sm_89 and sm_90 with all warnings as errors and ptxas
register-spill warnings as errors. The ptxas resource table per arch is printed into the test's
captured output: shown by `pytest -s` (scripts/ptxas_resources.sh) or on failure, not in every
`-q` run.
NVRTC: the runtime's exact options (andrea.cuda.launch.nvrtc_options) and name expressions,
compiled to cubin through libnvrtc from the nvidia-cuda-nvrtc wheel, called directly (CuPy's
compile path asks for a device first).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from andrea.cuda import launch as kernel_launch
from andrea.resources import kernels_dir

KERNEL = kernels_dir() / "microgpt_cuda.cu"
ARCHS = ("sm_80", "sm_89", "sm_90")
N_INSTANCES = len(kernel_launch.all_name_expressions())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH on this machine")
@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_builds_without_spills(arch: str, tmp_path: Path) -> None:
    cmd = [
        "nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-DANDREA_INSTANTIATE_ALL",
        "-Xptxas", "-v,--warn-on-spills", "-Werror", "all-warnings",
        "-o", str(tmp_path / "k.cubin"), str(KERNEL),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    functions = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(functions) == N_INSTANCES and all(a == arch for _, a in functions), log
    assert len(spills) == N_INSTANCES and all(s == ("0", "0") for s in spills), log
    resources = re.findall(r"Used (\d+) registers.*?(?:(\d+) bytes smem|$)", log, re.M)
    assert len(resources) == N_INSTANCES, log
    for (_, _), (regs, _) in zip(functions, resources, strict=True):
        assert int(regs) <= 255
    print(f"\nptxas resources, {arch}:")
    for (fn, _), (regs, smem) in zip(functions, resources, strict=True):
        print(f"  {fn:72s} {regs:>3s} registers, {smem or 0:>5} bytes smem, 0 spills")


def _libnvrtc() -> Path | None:
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for found in sorted(Path(root).glob("cu*/lib/libnvrtc.so.*")):
            if ".alt." not in found.name:
                return found
    return None


def _check(lib: ctypes.CDLL, rc: int, what: str, prog: ctypes.c_void_p | None = None) -> None:
    if rc == 0:
        return
    log = ""
    if prog is not None:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    pytest.fail(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}\n{log}")


@pytest.mark.skipif(_libnvrtc() is None, reason="the nvidia-cuda-nvrtc wheel is not installed")
def test_nvrtc_compiles_with_runtime_options() -> None:
    path = _libnvrtc()
    # libnvrtc dlopens its builtins library by name; load it first from the same directory.
    for builtins in path.parent.glob("libnvrtc-builtins.so.*"):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(path))
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    prog = ctypes.c_void_p()
    source = KERNEL.read_bytes()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"microgpt_cuda.cu", 0,
                                       None, None), "nvrtcCreateProgram")
    try:
        names = kernel_launch.all_name_expressions()
        for name in names:
            _check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), name, prog)
        opts = [o.encode() for o in kernel_launch.nvrtc_options("sm_90")]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        _check(lib, lib.nvrtcCompileProgram(prog, len(opts), argv), "compile", prog)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size", prog)
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin", prog)
        assert cubin.raw[:4] == b"\x7fELF"  # a real device binary, not PTX
        for name in names:
            lowered = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)),
                   name, prog)
            assert lowered.value and lowered.value.startswith(b"_Z")
            assert lowered.value in cubin.raw, name
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    print(f"NVRTC {major.value}.{minor.value}: cubin of {size.value} bytes, {len(names)} kernels")
