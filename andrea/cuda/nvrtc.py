"""libnvrtc of the nvidia-cuda-nvrtc wheel through ctypes, for the compile gates
(tests/test_kernel_compile.py) and the kernel tuner (scripts/gpu_tune_attention.py): NVRTC with
the runtime's options without CuPy, whose compile path asks for a device first. ctypes lets go
of the GIL in nvrtcCompileProgram, so builds in threads use every core. The runtime itself
compiles through CuPy (andrea.cuda.launch.compiled_module).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path


def find_libnvrtc() -> Path | None:
    """libnvrtc.so of the installed nvidia-cuda-nvrtc wheel (nvidia/<cuda>/lib), or None."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for found in sorted(Path(root).glob("*/lib/libnvrtc.so*")):
            return found
    return None


@dataclass(frozen=True)
class Build:
    cubin: bytes
    lowered: dict[str, str]  # name expression -> the kernel's symbol in the cubin
    log: str  # NVRTC's log, with ptxas's verbose lines (registers, spills) per kernel


class Nvrtc:
    def __init__(self, path: Path) -> None:
        # libnvrtc dlopens its builtins library by name: load it first from the same folder.
        for builtins in sorted(path.parent.glob("libnvrtc-builtins.so*")):
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            break
        self.lib = ctypes.CDLL(str(path))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._ok(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return f"{major.value}.{minor.value}"

    def compile(self, source: str, names: list[str], options: list[str]) -> Build:
        """One program of `source` holding the instances `names` (NVRTC name expressions),
        compiled to cubin with `options` and ptxas's verbose output; a failure raises
        RuntimeError with NVRTC's log."""
        lib = self.lib
        prog = ctypes.c_void_p()
        self._ok(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(),
                                        b"microgpt_cuda.cu", 0, None, None), "create")
        try:
            for name in names:
                self._ok(lib.nvrtcAddNameExpression(prog, name.encode()), name, prog)
            opts = [o.encode() for o in [*options, "--ptxas-options=-v"]]
            argv = (ctypes.c_char_p * len(opts))(*opts)
            self._ok(lib.nvrtcCompileProgram(prog, len(opts), argv), "compile", prog)
            size = ctypes.c_size_t()
            self._ok(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size", prog)
            cubin = ctypes.create_string_buffer(size.value)
            self._ok(lib.nvrtcGetCUBIN(prog, cubin), "cubin", prog)
            lowered = {}
            for name in names:
                symbol = ctypes.c_char_p()
                self._ok(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(symbol)),
                         name, prog)
                lowered[name] = symbol.value.decode()
            return Build(cubin.raw, lowered, self._log(prog))
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def _ok(self, rc: int, what: str, prog: ctypes.c_void_p | None = None) -> None:
        if rc:
            raise RuntimeError(f"NVRTC {what}: {self.lib.nvrtcGetErrorString(rc).decode()}\n"
                               f"{self._log(prog) if prog is not None else ''}")

    def _log(self, prog: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, buf)
        return buf.value.decode(errors="replace")
