"""Compile gates for kernels/microgpt_cuda.cu and the parts it includes (no GPU needed).

NVRTC (what runs): what NVRTC really gets at run time (andrea.cuda.launch.runtime_nvrtc_options:
the backend's options plus those CuPy appends, -ftz=true among them) and the name expressions,
compiled to cubin for sm_80 and sm_90 (and sm_89 under ANDREA_COMPILE_ALL=1) through libnvrtc
from the nvidia-cuda-nvrtc wheel, called directly (CuPy's compile path asks for a device first).
Its log must show no warning and ptxas's verbose lines no spill.
nvcc: the fp16 instances for sm_75 (two m16n8k8 a step) and sm_86, archs the NVRTC gate does not
build, with all warnings as errors and ptxas spill warnings as errors, -ftz=true as the runtime
compiles. sm_70 (V100) where nvcc still has it: CUDA 13 dropped sm_70 and sm_72, so with nvcc 13
that case is skipped, saying so; sm_70's fp16 path compiled for sm_75 instead
(-DANDREA_HALF_ARCH=700, 48 s of CPU) is a command in kernels/README.md, with its figures.
nvcc's build of every instance for sm_80/89/90 (80 s of CPU; nvcc and NVRTC do not choose
registers alike, and the runtime uses NVRTC's) runs under ANDREA_COMPILE_ALL=1, which
scripts/ptxas_resources.sh sets to print the ptxas resource table per arch.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import background
import pytest

from andrea.cuda import launch as kernel_launch
from andrea.cuda.nvrtc import Nvrtc, find_libnvrtc
from andrea.resources import kernels_dir

KERNEL = kernels_dir() / "microgpt_cuda.cu"
ARCHS = ("sm_80", "sm_89", "sm_90")
EVERY_BUILD = os.environ.get("ANDREA_COMPILE_ALL") == "1"
# sm_89 takes sm_80's source path (no code in the .cu is special to it): its NVRTC build, like
# nvcc's of every instance, runs under ANDREA_COMPILE_ALL=1 (40 s of CPU each)
NVRTC_ARCHS = ARCHS if EVERY_BUILD else ("sm_80", "sm_90")
N_INSTANCES = len(kernel_launch.all_name_expressions())
HALF_NAMES = [n for n in kernel_launch.all_name_expressions() if "<half_t," in n]
ALL, HALF = ("-DANDREA_INSTANTIATE_ALL",), ("-DANDREA_INSTANTIATE_HALF",)
# (arch, defines, what): every instance where bf16 has tensor cores; the fp16 ones elsewhere.
NVCC_BUILDS = [(arch, ALL, "all") for arch in ARCHS] + [
    ("sm_75", HALF, "fp16"),
    ("sm_86", HALF, "fp16"),
    ("sm_70", HALF, "fp16"),
]


@functools.cache
def _nvcc_archs() -> str:
    if shutil.which("nvcc") is None:
        return ""
    return subprocess.run(["nvcc", "--list-gpu-arch"], capture_output=True, text=True).stdout


def _skip_reason(arch: str, defines: tuple[str, ...]) -> str:
    if defines == ALL and not EVERY_BUILD:
        return ("what runs is NVRTC's build, checked below (spills and warnings); nvcc's of "
                "every instance runs under ANDREA_COMPILE_ALL=1 (scripts/ptxas_resources.sh, "
                "80 s of CPU)")
    if f"compute_{arch[3:]}" not in _nvcc_archs():
        return (f"this nvcc has no {arch} target (CUDA 13 dropped sm_70 and sm_72); "
                "kernels/README.md has sm_70's fp16 path compiled for sm_75 instead")
    return ""


def _nvcc_build(arch: str, defines: tuple[str, ...]) -> subprocess.CompletedProcess:
    """nvcc's cubin of DEFINES' instances for ARCH: the process, its output the ptxas log."""
    with tempfile.TemporaryDirectory() as folder:
        return background.run_process(
            ["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-ftz=true", *defines,
             "-Xptxas", "-v,--warn-on-spills", "-Werror", "all-warnings",
             "-o", str(Path(folder, "out.cubin")), str(KERNEL)])


# Each build runs on a low-priority thread from the session's start (tests/background.py); two
# at a time, the machine's cores: all five at once on 2 cores took 102 s against 78 s.
for _arch, _defines, _what in NVCC_BUILDS:
    if shutil.which("nvcc") and not _skip_reason(_arch, _defines):
        background.declare(f"nvcc-{_arch}-{_what}",
                           functools.partial(_nvcc_build, _arch, _defines),
                           wanted_by=["test_kernel_compile.py::test_nvcc_builds_without_spills"])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH on this machine")
@pytest.mark.parametrize("arch,defines,what", NVCC_BUILDS,
                         ids=[f"{a}-{w}" for a, _, w in NVCC_BUILDS])
def test_nvcc_builds_without_spills(arch: str, defines: tuple[str, ...], what: str) -> None:
    if reason := _skip_reason(arch, defines):
        pytest.skip(reason)
    proc = background.result(f"nvcc-{arch}-{what}")
    log = proc.stdout
    assert proc.returncode == 0, log
    count = N_INSTANCES if defines == ALL else len(HALF_NAMES)
    functions = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(functions) == count and all(a == arch for _, a in functions), log
    assert len(spills) == count and all(s == ("0", "0") for s in spills), log
    resources = re.findall(r"Used (\d+) registers.*?(?:(\d+) bytes smem|$)", log, re.M)
    assert len(resources) == count, log
    for (_, _), (regs, _) in zip(functions, resources, strict=True):
        assert int(regs) <= 255
    print(f"\nptxas resources, {arch} ({what}):")
    for (fn, _), (regs, smem) in zip(functions, resources, strict=True):
        print(f"  {fn:72s} {regs:>3s} registers, {smem or 0:>5} bytes smem, 0 spills")


def _spills_by_function(log: str) -> dict[str, tuple[str, str, str]]:
    """ptxas's verbose log -> {function: (registers, spill store bytes, spill load bytes)}."""
    found: dict[str, list[str]] = {}
    function = None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            function = m.group(1)
            found[function] = []
        elif function and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                            line)):
            found[function][1:] = m.groups()
        elif function and (m := re.search(r"Used (\d+) registers", line)):
            found[function][:0] = [m.group(1)]
    return {fn: tuple(v) for fn, v in found.items()}


# sm_75's and sm_86's fp16 modules are left to nvcc above (the same -ftz=true; NVRTC's own
# register choices there cost another 15-20 s of CPU each).


def _nvrtc_build(arch: str) -> dict:
    """NVRTC's build of every name expression for ARCH with the runtime's options: its log, the
    cubin's size and the lowered names. ctypes lets go of the GIL in nvrtcCompileProgram, so
    builds in threads use every core."""
    nvrtc = Nvrtc(find_libnvrtc())
    options = kernel_launch.runtime_nvrtc_options(arch)
    assert options[:2] == kernel_launch.nvrtc_options(arch) and "-ftz=true" in options
    names = kernel_launch.all_name_expressions()
    build = nvrtc.compile(kernel_launch.kernel_source(), names, options)  # what the runtime gets
    assert build.cubin[:4] == b"\x7fELF"  # a real device binary, not PTX
    for name, symbol in build.lowered.items():
        assert symbol.startswith("_Z") and symbol.encode() in build.cubin, name
    return {"log": build.log, "options": options, "lowered": list(build.lowered.values()),
            "size": len(build.cubin), "version": nvrtc.version(), "count": len(names)}


# On a low-priority thread from the session's start (tests/background.py): ctypes lets go of the
# GIL in nvrtcCompileProgram, so the two threads use both cores.
for _arch in NVRTC_ARCHS if find_libnvrtc() is not None else ():
    background.declare(
        f"nvrtc-{_arch}", functools.partial(_nvrtc_build, _arch),
        wanted_by=["test_kernel_compile.py::test_nvrtc_compiles_with_runtime_options_without_spills"])


@pytest.mark.skipif(find_libnvrtc() is None, reason="the nvidia-cuda-nvrtc wheel is not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_nvrtc_compiles_with_runtime_options_without_spills(arch: str) -> None:
    if arch not in NVRTC_ARCHS:
        pytest.skip(f"{arch} compiles sm_80's source path: its build runs under "
                    "ANDREA_COMPILE_ALL=1")
    build = background.result(f"nvrtc-{arch}")
    log, options, lowered_names = build["log"], build["options"], build["lowered"]
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not warnings, f"{arch}: NVRTC warned under {options}:\n" + "\n".join(warnings)
    resources = _spills_by_function(log)
    assert set(resources) == set(lowered_names), log
    spilled = {fn: r for fn, r in resources.items() if len(r) != 3 or r[1:] != ("0", "0")}
    assert not spilled, f"{arch}: spills (registers, store, load bytes) under {options}: {spilled}"
    print(f"NVRTC {build['version']} {arch}: cubin of {build['size']} bytes, "
          f"{build['count']} kernels, no spills")


def _load_instruction_mix():
    path = Path(__file__).parents[1] / "scripts" / "kernel_instruction_mix.py"
    spec = importlib.util.spec_from_file_location("kernel_instruction_mix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDGSTS.E.BYPASS.128 [R9], desc[UR30][R10.64], !P0 ;
        /*0030*/              @!P0 BRA 0x20 ;
        /*0040*/               @P2 BRA 0x70 ;
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT ;
        /*0060*/                   MUFU.EX2 R19, R19 ;
        /*0070*/                   F2FP.BF16.F32.PACK_AB R4, R5, R4 ;
        /*0080*/                   IMAD.SHL.U32 R7, R6, 0x2000, RZ ;
        /*0090*/               @P1 BRA 0x10 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
"""


def test_instruction_mix_counts_the_widest_loop_by_class() -> None:
    """scripts/kernel_instruction_mix.py's reading of SASS: the main loop is the widest branch
    back (0x10-0x90 here, the inner copy loop inside it, the closing self-branch left out); its
    shortest trip takes the forward branch past the product and the exp2, its longest does not."""
    mix = _load_instruction_mix()
    instructions = mix.parse(SASS)
    assert [op for _, op, _, _ in instructions][:3] == ["MOV", "S2R", "LDGSTS"]
    assert instructions[4] == (0x40, "BRA", 0x70, True) and instructions[-1][3] is False
    loop = mix.main_loop(instructions)
    assert mix.classify(loop["opcodes"]) == {"total": 9, "mma": 1, "MUFU": 1, "F2FP": 1,
                                             "int": 1, "fp32": 0, "mem": 1, "other": 4}
    assert (loop["inner"], loop["fewest"], loop["most"]) == (2, 7, 9)
    whole = mix.classify([op for _, op, _, _ in instructions])
    assert whole["total"] == 12 and whole["other"] == 7


@pytest.mark.skipif(find_libnvrtc() is None or shutil.which("cuobjdump") is None
                    or shutil.which("nvdisasm") is None,
                    reason="needs libnvrtc and NVIDIA's cuobjdump and nvdisasm on PATH")
def test_instruction_mix_of_a_real_kernel(tmp_path) -> None:
    mix = _load_instruction_mix()
    name = "attn_fwd_wgmma<bf16_t, 64, 8, 64, 2, 0>"
    found = mix.instruction_mix(Nvrtc(find_libnvrtc()), name, "sm_90", tmp_path)
    assert found["loop"]["mma"] == 8 and found["loop"]["F2FP"] == 16  # 2 products x 4 k-steps
    assert 0 < found["loop"]["total"] < found["kernel"]["total"]
    assert found["loop"]["inner"] == 0  # every tile copy unrolled
    assert found["loop"]["fewest"] < found["loop"]["most"] <= found["loop"]["total"]
