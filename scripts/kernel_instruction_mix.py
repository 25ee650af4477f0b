#!/usr/bin/env python3
"""What the attention kernels cost in issued instructions, read from their SASS on a CPU.

Each kernel is built as the runtime builds it (NVRTC, andrea.cuda.launch's options, sm_90a for
the wgmma ones), disassembled with cuobjdump, and its instructions counted by class, in the
whole kernel and in its main loop (the widest branch back, the K/V or Q/dO tile loop): the
tensor core products, MUFU (exp2, the softmax's), F2FP (the packing of P and dS to 16 bits),
integer, float32, memory, the rest. A kernel whose warps issue far more instructions per tile
than the products take cycles is bound by issue, not by the tensor cores; these counts show that
without a GPU. They are static counts, each instruction once: "inner" says how many of the main
loop's sit in loops inside it, which run more than once a tile (where it is 0, the loop's count
is what a warp issues per tile, less the branches it skips); "fewest" and "most" are the
instructions on the shortest and the longest trip through it, its forward branches taken or not
(a tile the causal mask crosses takes the longer one, the pipeline's last tiles skip their
copies). Compare kernels with the same tiles, or one kernel before and after a change (run it
from another tree with PYTHONPATH).

Needs NVIDIA's disassembler, from the package index (no GPU, no CUDA install):

    pip install --target /tmp/cutools nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    PATH=/tmp/cutools/nvidia/cu13/bin:$PATH PYTHONPATH=$PWD python scripts/kernel_instruction_mix.py

By default it counts the production kernels and TUNED's of each (dtype, head_dim) TUNED has for
sm_90; name others as NVRTC name expressions, e.g.
'attn_fwd_pipe<bf16_t, 64, 4, 64, 3, 0>'.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from andrea.cuda import launch
from andrea.cuda.nvrtc import Nvrtc, find_libnvrtc

CLASSES = {
    "mma": ("HMMA", "HGMMA"),
    "MUFU": ("MUFU",),
    "F2FP": ("F2FP",),
    "int": ("IADD3", "IMAD", "LOP3", "SHF", "ISETP", "SEL", "LEA", "VIADD", "IMNMX", "VIMNMX",
            "PRMT", "IABS", "POPC", "FLO", "BMSK", "SGXT", "LEA.HI", "I2F", "F2I"),
    "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK"),
    "mem": ("LDS", "STS", "LDSM", "LDG", "STG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "ATOMS", "RED"),
}
OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def default_names(arch: str = "sm_90") -> list[str]:
    """For each (dtype, head_dim) TUNED has for arch: the production kernels, then TUNED's."""
    names = []
    for (tuned_arch, dtype, head_dim), configs in launch.TUNED.items():
        if tuned_arch == arch:
            names += [launch.name_expression(k, dtype, head_dim) for k in launch.KERNEL_TEMPLATES
                      if k != "bwd_preprocess"]
            names += [launch.pipe_name_expression(k, dtype, head_dim, cfg)
                      for k, cfg in configs.items()]
    return names


def parse(sass: str) -> list[tuple[int, str, int | None, bool]]:
    """SASS text -> (address, opcode, branch target or None, conditional) per instruction."""
    found = []
    for line in sass.splitlines():
        if m := OPCODE.match(line):
            target = re.search(r"\bBRA\b[^;]*?(0x[0-9a-f]+)", line)
            conditional = m.group(1) is not None or bool(re.search(r"\bBRA\s+!?P\d", line))
            found.append((int(line.split("/*")[1].split("*/")[0], 16), m.group(2),
                          int(target.group(1), 16) if target else None, conditional))
    return found


def main_loop(instructions: list[tuple[int, str, int | None, bool]]) -> dict[str, object]:
    """The widest loop (a branch back to an earlier address: the K/V or Q/dO tile loop): its
    opcodes, how many of them sit in loops inside it (which run more than once a tile), and the
    fewest and the most a warp issues on one trip through it, its forward branches taken or not
    (inner loops once)."""
    spans = sorted(((addr - target, target, addr) for addr, _, target, _ in instructions
                    if target is not None and target <= addr), reverse=True)
    if not spans:
        return {"opcodes": [], "inner": 0, "fewest": 0, "most": 0}
    _, start, end = spans[0]
    inner = [(a, b) for _, a, b in spans[1:] if start <= a and b < end]
    body = [x for x in instructions if start <= x[0] <= end]
    at = {addr: i for i, (addr, *_) in enumerate(body)}
    fewest, most = [None] * len(body), [None] * len(body)  # issued before instruction i
    fewest[0] = most[0] = 0
    for i, (addr, _, target, conditional) in enumerate(body[:-1]):
        if fewest[i] is None:
            continue
        jumps = target is not None and addr < target <= end
        nexts = ([at[target]] if jumps else []) + ([i + 1] if conditional or not jumps else [])
        if target is not None and target > end and not conditional:
            nexts = []  # leaves the loop
        for j in nexts:
            fewest[j] = fewest[i] + 1 if fewest[j] is None else min(fewest[j], fewest[i] + 1)
            most[j] = most[i] + 1 if most[j] is None else max(most[j], most[i] + 1)
    return {"opcodes": [op for _, op, _, _ in body],
            "inner": sum(any(a <= addr <= b for a, b in inner) for addr, *_ in body),
            "fewest": fewest[-1] + 1, "most": most[-1] + 1}


def classify(opcodes: list[str]) -> dict[str, int]:
    counts = collections.Counter(opcodes)
    row = {"total": len(opcodes)}
    for cls, ops in CLASSES.items():
        row[cls] = sum(counts[op] for op in ops)
    row["other"] = row["total"] - sum(row[cls] for cls in CLASSES)
    return row


def instruction_mix(nvrtc: Nvrtc, name: str, arch: str, folder: Path) -> dict[str, dict]:
    """One kernel's SASS instructions by class, the whole kernel's and its main loop's, built
    for `arch` as the runtime builds it."""
    build = nvrtc.compile(launch.kernel_source(), [name], launch.runtime_nvrtc_options(
        launch.module_arch(arch, [name]), arch))
    cubin = folder / "kernel.cubin"
    cubin.write_bytes(build.cubin)
    sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    instructions = parse(sass)
    loop = main_loop(instructions)
    return {"kernel": classify([op for _, op, _, _ in instructions]),
            "loop": {**classify(loop["opcodes"]), "inner": loop["inner"],
                     "fewest": loop["fewest"], "most": loop["most"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="NVRTC name expressions (default: TUNED's)")
    parser.add_argument("--arch", default="sm_90", help="the GPU architecture (default sm_90)")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("cuobjdump", "nvdisasm") if shutil.which(tool) is None]
    if missing:
        print(f"{', '.join(missing)} not on PATH: pip install --target /tmp/cutools "
              "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, then put "
              "/tmp/cutools/nvidia/cu13/bin on PATH", file=sys.stderr)
        return 2
    library = find_libnvrtc()
    if library is None:
        print("libnvrtc not found: pip install nvidia-cuda-nvrtc", file=sys.stderr)
        return 2
    nvrtc = Nvrtc(library)
    names = args.names or default_names(args.arch)
    print(f"NVRTC {nvrtc.version()}, {args.arch}: SASS instructions per kernel (static, loop "
          "bodies once)")
    header = ["total", "mma", "MUFU", "F2FP", "int", "fp32", "mem", "other", "inner", "fewest",
              "most"]
    print(f"{'kernel':50s} {'part':5s}" + "".join(f"{h:>7s}" for h in header))
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            mix = instruction_mix(nvrtc, name, args.arch, Path(tmp))
            for part, row in mix.items():
                print(f"{name if part == 'kernel' else '':50s} {part:5s}"
                      + "".join(f"{row[h]:7d}" if h in row else " " * 7 for h in header),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
