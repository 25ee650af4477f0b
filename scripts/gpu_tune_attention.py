#!/usr/bin/env python3
"""Build, check and time every pipelined attention candidate against PyTorch's SDPA (issue 53).

On the GPU machine, from the checkout (no install; at most 330 s, budgeted inside; about 100-150 s
expected on an H200 with 16 cores):

    PYTHONPATH=$PWD python3 scripts/gpu_tune_attention.py $OUT/tune [--cubins DIR]

and before it, on any machine with the NVRTC wheel (a CPU is enough; 2 cores take about 2 min),
the cubins the GPU would otherwise compile in its own time:

    PYTHONPATH=$PWD python3 scripts/gpu_tune_attention.py OUT --prebuild sm_90 --cubins DIR

1. Candidates: andrea.cuda.launch.pipe_candidates (generated from the production TILES) for
   every (dtype, head_dim) of SHAPES, and the first DS_LIMIT of each kernel of the backward
   through dS (dK/dV writing dS, dQ from it), a whole head's backward in one block ("bwd_fused",
   where the 12M preset's window fits), and on sm_90 the wgmma candidates of those kernels
   (andrea.cuda.launch.hopper_candidates, built for sm_90a; among them the overlapped twins,
   a tile's last products in flight during the next tile's softmax, and "bwd_dkdv_dq", dK, dV
   and dQ in one kernel with dQ's shares added in key-block order), ordered so that each shape's
   production tile and its 2-stage twin come first, and the architecture's TUNED choices before
   all (the last tuning's winners). Each is compiled alone
   by NVRTC (libnvrtc through ctypes, which lets go of the GIL: one thread per core; CuPy's own
   compile is the fallback) with the options the runtime uses, and pruned when ptxas spills or
   it does not load. Its cubin is kept in the --cubins folder (Cubins), and a cubin already
   there, the same source, options and NVRTC version, is loaded instead of compiled: so a
   --prebuild folder carried from a CPU leaves the GPU nothing to compile. Compiling stops at
   COMPILE_SHARE of the budget; what is not built by then is listed as skipped (loading goes
   on). The wgmma ones are built and run first in child processes (--probe-wgmma, while this
   one builds and checks the others), and only those that matched float64 there are loaded
   here, from the cubins the children kept: a kernel fault ends a CUDA context, and would end
   this run's measurements with it. "bwd_dkdv_dq", whose blocks wait on each other, has a probe
   child of its own beside the first: a hang there costs the other wgmma candidates nothing.
2. Check: first pack2's one-cvt form, which every kernel's P and dS go through on sm_80+,
   against the integer rounding the emulator runs, over all 2^32 float32 patterns
   (PACK2_CHECK); then each candidate kernel on fresh random inputs of an odd shape (B 2, H 3,
   T 333), outputs NaN-poisoned, against float64 (bf16 1e-2, fp16 2^-9 of max(|ref|, 1); lse 1e-4).
   The backward candidates take the production forward's O and lse; dK/dV through dS is also
   checked on the dS it writes, dQ from dS is given float64's dS (NaN above the diagonal); the
   whole-head backward, whose block holds the sequence, on inputs of FUSED_CHECK_LEN positions;
   dQ added in order runs twice, and a second run that changes any bit fails it ("repeat").
3. Time (CUDA events around back-to-back calls, andrea.bench.time_per_call) at each shape:
   every passing candidate kernel alone; SDPA default, flash, efficient and cuDNN forward,
   backward (autograd, forward prepared) and forward + backward, and flash and efficient again
   under torch.use_deterministic_algorithms ("-det"); the production kernels the
   same way through `cuda_attention` (what training runs) and as bare launches; the best
   candidate per kernel together (forward, preprocess + dQ + dK/dV, and all four); the best
   pair through dS with the best forward; the best whole-head backward with it; the best
   backward adding dQ in order with it (its turn counters zeroed in each call); and where those
   beat production, the fastest through `cuda_attention` with its TUNED entry in place
   (andrea.cuda.launch.TUNED), timed and checked against float64. Each row through autograd
   also runs REPEATS times at twice the shape's batch: "same bits" where every output and
   gradient repeated bit for bit (exact resume needs it), "DIFFER" where not.
4. Prints a table per shape last and writes everything to OUT_DIR/tune.json (written again after
   each shape, so a run cut short keeps what it measured), then `model.attention: auto`'s
   AUTO_TABLE entries for this GPU (andrea/model/attention.py) and the TUNED entries
   (andrea/cuda/launch.py), ready to paste.

Table columns: fwd / bwd / f+b: milliseconds per call (rows "sdpa ..." and "(autograd)": through
autograd; "ours production", "ours best candidates", "ours best, bwd through dS" and "ours
best, whole-head bwd": the kernels launched back to back, bwd = preprocess + dQ + dK/dV, or
preprocess + dK/dV + dQ, or preprocess + the whole-head backward);
TFLOP/s: the f+b causal FLOPs 3.5 * 2*B*H*T^2*D over f+b time; fwd x, bwd x, f+b x: SDPA
default's time over this row's (above 1: faster than SDPA). "ours best, bwd dQ in order":
preprocess + the one kernel.

Without a GPU (or CuPy) it is a dry run: nothing is compiled for a GPU; the candidates of the
first two shapes' (dtype, head_dim) run through the CPU emulator at one tiny shape against
float64, and it exits 0 when they all pass (1 when one fails).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple
from pathlib import Path
from typing import Any

from andrea.cuda.nvrtc import Nvrtc, find_libnvrtc

START = time.monotonic()
BUDGET_S = 330.0
COMPILE_SHARE = 0.40  # of the budget, counted from the start
RESERVE_S = 15.0  # kept back for the summary and the last JSON

# (dtype, B, H, T, D): ANDREA-120M's head shape, ANDREA-12M's batch, 120M in fp16.
SHAPES = [("bfloat16", 8, 12, 1024, 64), ("bfloat16", 32, 12, 256, 32),
          ("float16", 8, 12, 1024, 64)]
KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
# The backward through dS (dK/dV writing dS, then dQ = dS K): its candidates, the first
# DS_LIMIT of each list, so that the compile share still reaches the others' tiers.
DS_KERNELS = ("bwd_dkdv_ds", "bwd_dq_ds")
DS_LIMIT = 15
# A whole head's backward in one block (dS in shared memory), for sequences that fit it: its
# candidates are checked at FUSED_CHECK_LEN positions (odd, within the 12M preset's 256).
FUSED = "bwd_fused"
FUSED_CHECK_LEN = 255
# dK, dV and dQ in one wgmma kernel, dQ's shares added in key-block order through a float32
# buffer (andrea.cuda.launch.DQ_IN_ORDER): its blocks wait on each other, so it has a probe
# child of its own (a hang there costs the other wgmma candidates nothing).
IN_ORDER = "bwd_dkdv_dq"
ALL_KERNELS = (*KERNELS, *DS_KERNELS, FUSED, IN_ORDER)
CHECK_SHAPE = (2, 3, 333)  # B, H, T: odd, not a multiple of any tile
TOL = {"bfloat16": 1e-2, "float16": 2.0**-9, "float32": 1e-5}
# "-det": the same backend with torch.use_deterministic_algorithms on (not warn_only: with it,
# flash's and efficient's backwards only warn and keep their non-deterministic paths), under
# which they take their deterministic ones; cuDNN's has none in torch, which refuses it there.
SDPA_BACKENDS = ("default", "flash", "efficient", "cudnn", "flash-det", "efficient-det")
# Exact resume needs a backward whose bits repeat: each backend's forward + backward runs this
# many times at twice the shape's batch (a batch that trains: llm.c saw cuDNN's backward repeat
# at small batches only), every output compared with the first's bit for bit.
REPEATS = 4
CANDIDATE_LIMIT: int | None = None  # the first N of each kernel's candidates (tests)
# The wgmma candidates first run in a child process (--probe-wgmma), given this long: a kernel
# that faults there (a misread descriptor can end a CUDA context) cannot cost this run the rest.
PROBE_TIMEOUT_S = 60.0


def check_length(kernels) -> int:
    """The sequence length kernels are checked at: CHECK_SHAPE's, or FUSED_CHECK_LEN where the
    whole-head backward is among them (its block must hold the sequence)."""
    return min(CHECK_SHAPE[2], FUSED_CHECK_LEN) if FUSED in kernels else CHECK_SHAPE[2]


def elapsed() -> float:
    return time.monotonic() - START


def left() -> float:
    return BUDGET_S - RESERVE_S - elapsed()


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def flops_fb(b: int, h: int, t: int, d: int) -> float:
    return 3.5 * 2 * b * h * t * t * d


def shape_key(shape: tuple) -> str:
    dtype, b, h, t, d = shape
    return f"{dtype} B{b} H{h} T{t} D{d}"


# ------------------------------------------------------------------------------ candidates
def candidate_list(shapes: list[tuple], limit: int | None = None,
                   wgmma: bool = True) -> list[tuple]:
    """(kernel, dtype, head_dim, PipeConfig) for every (dtype, head_dim) of shapes, in build
    order: tier by tier (production tile, its 2-stage twin, the sm_90a (wgmma) ones where
    `wgmma`, then the rest), shape by shape; the first `limit` of each kernel's lists when
    given (of the backward through dS's mma.sync ones, at most DS_LIMIT). The whole-head
    backward's list is empty where the 12M window does not fit (head_dim 64 and 128)."""
    from andrea.cuda.launch import hopper_candidates, pipe_candidates

    def of(k: str, dt: str, d: int) -> list:
        found = pipe_candidates(k, dt, d)[:limit if k in (*KERNELS, FUSED)
                                          else min(limit or DS_LIMIT, DS_LIMIT)]
        if wgmma:
            found[2:2] = hopper_candidates(k, dt, d)[:limit]
        return found

    combos = list(dict.fromkeys((s[0], s[4]) for s in shapes))
    per = {(dt, d, k): of(k, dt, d) for dt, d in combos for k in ALL_KERNELS}
    out = []
    depth = max(len(v) for v in per.values())
    for i in range(depth):
        for dt, d in combos:
            for k in ALL_KERNELS:
                if i < len(per[dt, d, k]):
                    out.append((k, dt, d, per[dt, d, k][i]))
    return out


# --------------------------------------------------------------------------------- dry run
def dry_run(out_dir: Path, limit: int | None = None) -> int:
    import torch

    from andrea.cuda import emulator as emu_mod
    from andrea.cuda.launch import attention_launches

    combos = list(dict.fromkeys((s[0], s[4]) for s in SHAPES[:2]))
    cands = candidate_list(SHAPES[:2], limit)
    log(f"dry run (no GPU): {len(cands)} candidate kernels through the CPU emulator")
    emu = emu_mod.Emulator(pipes=tuple(cands))
    log("emulator built")
    b, h, t = 1, 2, 37
    results, failed = [], 0
    for dtype, d in combos:
        tdt = getattr(torch, dtype)
        gen = torch.Generator().manual_seed(d)
        q, k, v, dout = (torch.randn(b, h, t, d, generator=gen).to(tdt) for _ in range(4))
        ref = emu_mod.float64_reference(q, k, v, dout, d**-0.5)
        ds_ref = emu_mod.float64_ds(q, k, v, dout, d**-0.5)
        prod_o, prod_lse = emu_mod.attention_forward(q, k, v)
        delta = torch.full((b, h, t), math.nan)
        emu.launch(attention_launches(b, h, t, d, dtype)["bwd_preprocess"], prod_o, dout, delta,
                   b * h * t)
        for kernel, cdt, cd, cfg in cands:
            if (cdt, cd) != (dtype, d):
                continue
            errs = check_candidate(emu.launch, kernel, cfg, (q, k, v, dout),
                                   (prod_o, prod_lse, delta), ref, ds_ref)
            ok = all(e <= (1e-4 if n == "lse" else TOL[dtype]) for n, e in errs.items())
            failed += not ok
            results.append({"kernel": kernel, "dtype": dtype, "head_dim": d, "config": cfg.label(),
                            "errors": errs, "ok": ok})
            print(f"  {dtype:9s} D{d:<3d} {kernel:8s} {cfg.label():18s} "
                  + " ".join(f"{n} {e:.1e}" for n, e in errs.items()) + ("" if ok else "  FAIL"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tune.json").write_text(json.dumps({"dry_run": True, "results": results},
                                                  indent=1))
    log(f"RESULT: dry run, {len(results)} candidate kernels, {failed} failed")
    return 1 if failed else 0


def check_candidate(launch_fn, kernel, cfg, inputs, forward, ref, ds_ref) -> dict[str, float]:
    """Errors of one candidate against float64 (ref: o, lse, dq, dk, dv; ds_ref: dS), outputs
    NaN-poisoned; launch_fn is the emulator's or the GPU launcher's launch. The backward
    candidates take the production forward's O and lse and the preprocess's delta (forward).
    dK/dV through dS is also checked on the dS it writes at and below the diagonal; dQ from dS
    gets float64's dS rounded to the element type, NaN above the diagonal and past T."""
    import torch

    from andrea.cuda.emulator import max_error
    from andrea.cuda.launch import ds_row_stride, pipe_launch

    q, k, v, dout = inputs
    o, lse, delta = forward
    b, h, t, d = q.shape
    dtype = str(q.dtype).removeprefix("torch.")
    scale = d**-0.5
    launch = pipe_launch(kernel, b, h, t, d, dtype, cfg)
    nan = float("nan")

    def err(got, want) -> float:
        return max_error(got.detach().cpu(), want)

    if kernel == "fwd":
        o2, lse2 = torch.full_like(q, nan), torch.full_like(lse, nan)
        launch_fn(launch, q, k, v, o2, lse2, t, scale)
        return {"o": err(o2, ref[0]), "lse": err(lse2, ref[1])}
    if kernel == "bwd_dq":
        dq = torch.full_like(q, nan)
        launch_fn(launch, q, k, v, dout, lse, delta, dq, t, scale)
        return {"dq": err(dq, ref[2])}
    if kernel == "bwd_dkdv":
        dk, dv = torch.full_like(q, nan), torch.full_like(q, nan)
        launch_fn(launch, q, k, v, dout, lse, delta, dk, dv, t, scale)
        return {"dk": err(dk, ref[3]), "dv": err(dv, ref[4])}
    if kernel == FUSED:
        dq, dk, dv = (torch.full_like(q, nan) for _ in range(3))
        launch_fn(launch, q, k, v, dout, lse, delta, dq, dk, dv, t, scale)
        return {"dq": err(dq, ref[2]), "dk": err(dk, ref[3]), "dv": err(dv, ref[4])}
    if kernel == IN_ORDER:  # its float32 dQ buffer poisoned too, its turn counters zeroed
        runs = []
        for _ in range(2):
            grads = tuple(torch.full_like(q, nan) for _ in range(3))
            acc, count = in_order_buffers(q)
            acc.fill_(nan)
            launch_fn(launch, q, k, v, dout, lse, delta, *grads, acc, count, t, scale)
            runs.append(grads)
        (dq, dk, dv), again = runs
        # Its blocks order dQ's adds among themselves: "repeat", the elements a second run
        # changes, must be 0 (a race there can still land within float64's tolerance).
        differ = sum(int((a != b).sum()) for a, b in zip(runs[0], again, strict=True))
        return {"dq": err(dq, ref[2]), "dk": err(dk, ref[3]), "dv": err(dv, ref[4]),
                "repeat": float(differ)}
    stride = ds_row_stride(t)
    lower = torch.ones(t, t, dtype=torch.bool).tril()
    ds = torch.full((b * h, t, stride), nan, dtype=q.dtype, device=q.device)
    if kernel == "bwd_dkdv_ds":
        dk, dv = torch.full_like(q, nan), torch.full_like(q, nan)
        launch_fn(launch, q, k, v, dout, lse, delta, dk, dv, ds, t, stride, scale)
        got_ds = ds[:, :, :t].reshape(b, h, t, t).cpu().masked_fill(~lower, 0.0)
        return {"dk": err(dk, ref[3]), "dv": err(dv, ref[4]), "ds": err(got_ds, ds_ref)}
    ds[:, :, :t] = ds_ref.masked_fill(~lower, nan).reshape(b * h, t, t).to(ds)
    dq = torch.full_like(q, nan)
    launch_fn(launch, k, ds, dq, t, stride, scale)
    return {"dq": err(dq, ref[2])}


def in_order_buffers(q) -> tuple[Any, Any]:
    """IN_ORDER's float32 dQ buffer (uninitialised) and its turn counters (zeros) for q's shape."""
    import torch

    from andrea.cuda.launch import dq_in_order_buffers

    acc_shape, count_shape = dq_in_order_buffers(*q.shape)
    return (torch.empty(acc_shape, device=q.device),
            torch.zeros(count_shape, dtype=torch.int32, device=q.device))


# ------------------------------------------------------------------------------- compiling
def spill_bytes(ptxas_log: str) -> int:
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    return sum(int(a) + int(b) for a, b in found)


def registers(ptxas_log: str) -> int | None:
    found = re.findall(r"Used (\d+) registers", ptxas_log)
    return max(map(int, found)) if found else None


def make_launcher(device) -> Any:
    """andrea's CupyLauncher (PyTorch's stream, dynamic shared memory, the production kernels
    compiled as the runtime does) whose candidate functions come from build_all."""
    from andrea.cuda.attention import CupyLauncher

    class CandidateLauncher(CupyLauncher):
        def __init__(self, device) -> None:
            super().__init__(device)
            self.extra: dict[str, Any] = {}

        def add(self, name: str, fn: Any) -> None:
            self.extra[name] = fn

        def _function(self, name: str) -> Any:
            fn = self.extra.get(name)
            return fn if fn is not None else super()._function(name)

    return CandidateLauncher(device)


def build_order(cands: list[tuple], arch: str) -> list[tuple]:
    """cands with the architecture's TUNED choices first (the last tuning's winners, which the
    rows through autograd run), the others in their order: a short budget still builds them."""
    from andrea.cuda.launch import TUNED

    def tuned(c: tuple) -> bool:
        kernel, dtype, d, cfg = c
        return TUNED.get((arch, dtype, d), {}).get(kernel) == cfg

    return sorted(cands, key=lambda c: not tuned(c))  # stable: the rest keep their order


class Cubins:
    """NVRTC's cubins in a folder, each under a digest of what it is built from (NVRTC's version,
    the options, the name expression, the kernel source), beside a JSON of its lowered name and
    ptxas's log. The GPU run, its probe children and a CPU's --prebuild share one: a cubin
    found there is loaded, not compiled again. NVRTC needs no GPU, so a CPU can build them all
    before a short device call (`--prebuild`)."""

    def __init__(self, folder: Path, nvrtc: Nvrtc) -> None:
        self.folder = folder
        self.nvrtc = nvrtc
        self.version = nvrtc.version()

    def _path(self, source: str, options: list[str], name: str) -> Path:
        key = "\0".join([self.version, " ".join(options), name, source])
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.cubin"

    def find(self, source: str, options: list[str], name: str) -> tuple[Path, dict] | None:
        path = self._path(source, options, name)
        meta = path.with_suffix(".json")
        if path.exists() and meta.exists():
            return path, json.loads(meta.read_text())
        return None

    def build(self, source: str, options: list[str], name: str) -> tuple[Path, dict]:
        """Compiles and keeps it: the cubin and its JSON each land whole (a rename), the JSON
        last, and `find` takes a cubin only once its JSON is there."""
        build = self.nvrtc.compile(source, [name], options)
        path = self._path(source, options, name)
        meta = {"name": name, "lowered": build.lowered[name], "nvrtc": self.version,
                "options": options, "spill_bytes": spill_bytes(build.log),
                "registers": registers(build.log), "log": build.log[-2000:]}
        self.folder.mkdir(parents=True, exist_ok=True)
        for target, data in ((path, build.cubin), (path.with_suffix(".json"),
                                                    json.dumps(meta, indent=1).encode())):
            tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        return path, meta


def build_options(arch: str, name: str) -> list[str]:
    """NVRTC's options for the instance `name` on a GPU of `arch`, as the runtime gives them
    (sm_90a for a wgmma kernel on sm_90)."""
    from andrea.cuda.launch import module_arch, runtime_nvrtc_options

    return runtime_nvrtc_options(module_arch(arch, [name]), arch)


def candidate_row(c: tuple) -> dict:
    """A candidate (kernel, dtype, head_dim, PipeConfig) as the start of its report row."""
    from andrea.cuda.launch import pipe_name_expression

    kernel, dtype, d, cfg = c
    return {"kernel": kernel, "dtype": dtype, "head_dim": d, "config": cfg.label(),
            "name": pipe_name_expression(kernel, dtype, d, cfg)}


def cubin_folder(out_dir: Path, given: Path | None) -> Path:
    return given if given is not None else out_dir / "cubins"


def build_all(cands, arch: str, launcher: Any, cubins: Path,
              stop_at: float | None = None) -> dict[str, dict]:
    """Loads or compiles the candidates in threads. A cubin in the `cubins` folder (this run's
    probe children, an earlier run, a CPU's --prebuild) is loaded whenever; a compile starts
    only until `stop_at` seconds from the start (the compile share of the budget by default)."""
    import cupy

    from andrea.cuda.launch import kernel_source, module_arch, nvrtc_options

    source = kernel_source()
    lib = find_libnvrtc()
    store = Cubins(cubins, Nvrtc(lib)) if lib else None
    how = (f"libnvrtc {lib}, cubins kept in {cubins}" if store
           else "CuPy (no libnvrtc wheel found)")
    log(f"building {len(cands)} candidate kernels for {arch} with {how}")
    stop_at = BUDGET_S * COMPILE_SHARE if stop_at is None else stop_at

    def one(c) -> dict:
        row = {**candidate_row(c), "cfg": c[3]}
        name = row["name"]
        t0 = time.monotonic()
        try:
            options = build_options(arch, name)
            found = store.find(source, options, name) if store else None
            if found is None and elapsed() > stop_at:
                row["status"] = "skipped (compile budget spent)"
                return row
            with cupy.cuda.Device(launcher.device.index):
                if store is not None:
                    path, meta = found or store.build(source, options, name)
                    fn = cupy.RawModule(path=str(path)).get_function(meta["lowered"])
                    row["spill_bytes"] = meta["spill_bytes"]
                    row["cubin"] = "found" if found else "compiled"
                else:
                    target = module_arch(arch, [name])
                    module = cupy.RawModule(code=source, options=tuple(nvrtc_options(target)),
                                            backend="nvrtc", name_expressions=[name])
                    fn = module.get_function(name)
                row["registers"] = fn.num_regs
                row["local_bytes"] = fn.local_size_bytes
            row["compile_s"] = round(time.monotonic() - t0, 2)
            if row.get("spill_bytes", 0) or row["local_bytes"]:
                row["status"] = "pruned (spills / local memory)"
            else:
                row["status"] = "built"
                row["fn"] = fn
        except Exception as exc:  # a candidate that fails to build is recorded, not fatal
            row["status"] = f"build failed: {str(exc)[:300]}"
        return row

    workers = max(2, min(32, os.cpu_count() or 2))
    with ThreadPoolExecutor(workers) as pool:  # map keeps the candidates' order, not the finish
        info = {row["name"]: row for row in pool.map(one, cands)}
    for name, row in info.items():
        if row["status"] == "built":
            launcher.add(name, row["fn"])
    built = sum(r["status"] == "built" for r in info.values())
    found = sum(r.get("cubin") == "found" for r in info.values())
    log(f"built {built} of {len(cands)} ({found} from kept cubins; "
        f"{len(cands) - built} pruned, failed or skipped)")
    return info


def prebuild(out_dir: Path, arch: str, cubins: Path) -> int:
    """--prebuild: every candidate the GPU run would build for `arch`, compiled by this
    machine's NVRTC into `cubins` (no GPU needed), and OUT_DIR/prebuild.json with each one's
    registers and spills. Exit 2 without the NVRTC wheel."""
    from andrea.cuda.launch import WGMMA_ARCH, kernel_source

    if not re.fullmatch(r"sm_\d{2,3}", arch):
        log(f"--prebuild {arch}: not a GPU architecture; give it as the GPU reports it, "
            "for example sm_90 (H100, H200) or sm_80 (A100)")
        return 2
    lib = find_libnvrtc()
    if lib is None:
        log("--prebuild needs NVRTC: pip install nvidia-cuda-nvrtc (the wheel of CUDA 13)")
        return 2
    store = Cubins(cubins, Nvrtc(lib))
    source = kernel_source()
    cands = candidate_list(SHAPES, CANDIDATE_LIMIT, wgmma=arch in WGMMA_ARCH)
    log(f"prebuilding {len(cands)} candidate kernels for {arch} with NVRTC {store.version} "
        f"into {cubins}")

    def one(c) -> dict:
        row = candidate_row(c)
        name = row["name"]
        options = build_options(arch, name)
        try:
            found = store.find(source, options, name)
            _, meta = found or store.build(source, options, name)
            row.update(cubin="found" if found else "compiled", registers=meta["registers"],
                       spill_bytes=meta["spill_bytes"])
        except Exception as exc:  # recorded; the GPU run compiles it there, or fails it there
            row["cubin"] = f"build failed: {str(exc)[:300]}"
        return row

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        rows = list(pool.map(one, cands))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prebuild.json").write_text(json.dumps(
        {"arch": arch, "nvrtc": store.version, "cubins": str(cubins), "candidates": rows},
        indent=1))
    failed = [r for r in rows if r["cubin"] not in ("found", "compiled")]
    spilling = sum(r.get("spill_bytes", 0) > 0 for r in rows)
    log(f"RESULT: {len(rows)} candidates for {arch}: "
        f"{sum(r['cubin'] == 'compiled' for r in rows)} compiled, "
        f"{sum(r['cubin'] == 'found' for r in rows)} already there, {spilling} spilling "
        f"(pruned on the GPU), {len(failed)} failed")
    return 1 if failed else 0


# --------------------------------------------------------------------------------- checking
def reference_cpu(q, k, v, dout, scale):
    from andrea.cuda.emulator import float64_reference

    return float64_reference(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), scale)


def check_all(info: dict, launcher, device) -> None:
    """Each built candidate on fresh random inputs of CHECK_SHAPE (check_length positions),
    poisoned outputs."""
    import torch

    from andrea.cuda.attention import attention_forward
    from andrea.cuda.emulator import float64_ds
    from andrea.cuda.launch import attention_launches

    b, h, _ = CHECK_SHAPE
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in info.values():
        if row["status"] == "built":
            groups.setdefault((row["dtype"], row["head_dim"]), []).append(row)

    def prepared(dtype: str, d: int, t: int) -> tuple:
        """Fresh inputs of t positions, float64's results, the production forward and delta."""
        q, k, v, dout = (torch.randn(b, h, t, d, device=device).to(getattr(torch, dtype))
                         for _ in range(4))
        scale = d**-0.5
        ref = reference_cpu(q, k, v, dout, scale)
        ds_ref = float64_ds(*(x.cpu() for x in (q, k, v, dout)), scale)
        with tuned(launcher.arch, dtype, d, None):  # the production forward, TUNED's aside
            po, plse = attention_forward(q, k, v, scale, launcher)
        delta = torch.full((b, h, t), math.nan, device=device)
        launcher.launch(attention_launches(b, h, t, d, dtype)["bwd_preprocess"], po, dout, delta,
                        b * h * t)
        return (q, k, v, dout), (po, plse, delta), ref, ds_ref

    for (dtype, d), rows in groups.items():
        if left() < 60:
            for row in rows:
                row["status"] = "unchecked (out of time)"
            continue
        by_len: dict[int, tuple] = {}
        for row in rows:
            length = check_length((row["kernel"],))
            try:
                if length not in by_len:
                    by_len[length] = prepared(dtype, d, length)
                errs = check_candidate(launcher.launch, row["kernel"], row["cfg"],
                                       *by_len[length])
                torch.cuda.synchronize(device)
            except Exception as exc:
                row["status"] = f"launch failed: {str(exc)[:300]}"
                continue
            row["errors"] = errs
            ok = all(e <= (1e-4 if n == "lse" else TOL[dtype]) for n, e in errs.items())
            if not ok:
                row["status"] = "wrong (" + ", ".join(f"{n} {e:.2g}" for n, e in errs.items()) + ")"
    for row in info.values():
        if row["status"] == "built":
            row["status"] = "ok"
    log(f"checked: {sum(r['status'] == 'ok' for r in info.values())} ok")


# ---------------------------------------------------------------------------------- timing
def timed_ms(fn, prepare=None) -> float:
    import torch

    from andrea.bench import CudaTimer, time_per_call

    del torch
    timer = CudaTimer()
    return time_per_call(timer, repeats=3, warmup=2, timed=fn, prepare=prepare).ms


def autograd_times(attend, q, k, v, dout) -> dict:
    """Forward (no grad), backward (autograd, forward prepared) and both, of attend(q, k, v)."""
    import torch

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def fwd(_):
        with torch.no_grad():
            attend(q, k, v)

    def forward_graph():
        return attend(*leaves)

    def bwd(out):
        torch.autograd.grad(out, leaves, dout)

    def fb(_):
        bwd(forward_graph())

    return {"fwd": timed_ms(fwd), "bwd": timed_ms(bwd, forward_graph), "fb": timed_ms(fb)}


def same_bits(attend, shape, device) -> bool:
    """Whether REPEATS forward + backward passes of attend at twice the shape's batch give the
    same output and gradients, bit for bit."""
    import torch

    dtype, b, h, t, d = shape
    q, k, v, dout = (torch.randn(2 * b, h, t, d, device=device).to(getattr(torch, dtype))
                     for _ in range(4))
    first = None
    for _ in range(REPEATS):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = attend(*leaves)
        got = [out.detach(), *torch.autograd.grad(out, leaves, dout)]
        if first is None:
            first = got
        elif not all(torch.equal(x, y) for x, y in zip(first, got, strict=True)):
            return False
    return True


@contextlib.contextmanager
def deterministic_algorithms(on: bool) -> Iterator[None]:
    """torch.use_deterministic_algorithms(on), strict: an op without a deterministic form
    raises (that row records the error), and flash's and efficient's backwards take their
    deterministic paths, which warn_only would not. Memory torch.empty gives is left unfilled
    (the mode fills it with NaN by default), so the rows time the kernels alone."""
    import torch
    import torch.utils.deterministic

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(on)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]


def sdpa_attend(backend: str):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}.get(backend.removesuffix("-det"))

    def attend(q, k, v):
        with sdpa_kernel(chosen) if chosen is not None else _null():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return attend


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def kernel_args(kernel, q, k, v, dout, o, lse, delta, grads, ds, t, scale, in_order=None):
    """A kernel's arguments; ds: the dS buffer [B*H, T, stride] of the backward through dS;
    in_order: IN_ORDER's float32 dQ buffer and turn counters."""
    dq, dk, dv = grads
    if kernel == IN_ORDER:
        return (q, k, v, dout, lse, delta, dq, dk, dv, *in_order, t, scale)
    if kernel == "fwd":
        return (q, k, v, o, lse, t, scale)
    if kernel == "bwd_dq":
        return (q, k, v, dout, lse, delta, dq, t, scale)
    if kernel == "bwd_dkdv":
        return (q, k, v, dout, lse, delta, dk, dv, t, scale)
    if kernel == FUSED:
        return (q, k, v, dout, lse, delta, dq, dk, dv, t, scale)
    if kernel == "bwd_dkdv_ds":
        return (q, k, v, dout, lse, delta, dk, dv, ds, t, ds.shape[-1], scale)
    return (k, ds, dq, t, ds.shape[-1], scale)


def time_shape(shape, info, launcher, device) -> dict:
    import torch

    from andrea.cuda.attention import attention_forward, cuda_attention
    from andrea.cuda.launch import (
        attention_launches,
        block_shared_limit,
        ds_row_stride,
        pipe_launch,
    )

    dtype, b, h, t, d = shape
    tdt = getattr(torch, dtype)
    scale = d**-0.5
    q, k, v, dout = (torch.randn(b, h, t, d, device=device).to(tdt) for _ in range(4))
    production = functools.partial(tuned, launcher.arch, dtype, d, None)  # TUNED's entry aside
    with production():
        o, lse = attention_forward(q, k, v, scale, launcher)
    prod = attention_launches(b, h, t, d, dtype)
    delta = torch.empty((b, h, t), device=device)
    launcher.launch(prod["bwd_preprocess"], o, dout, delta, b * h * t)
    grads = tuple(torch.empty_like(q) for _ in range(3))
    ds = torch.zeros((b * h, t, ds_row_stride(t)), dtype=tdt, device=device)
    in_order = in_order_buffers(q)
    o2, lse2 = torch.empty_like(o), torch.empty_like(lse)
    res: dict[str, Any] = {"shape": shape_key(shape), "flops_fb": flops_fb(b, h, t, d),
                           "sdpa": {}, "candidates": [], "production": {}, "best": {}}

    for backend in SDPA_BACKENDS:
        if left() < 20:
            break
        try:
            with deterministic_algorithms(backend.endswith("-det")):
                attend = sdpa_attend(backend)
                res["sdpa"][backend] = autograd_times(attend, q, k, v, dout)
                res["sdpa"][backend]["same_bits"] = same_bits(attend, shape, device)
        except Exception as exc:
            res["sdpa"][backend] = {"error": str(exc)[:300]}
    # The production kernels as training runs them: cuda_attention, through autograd.
    try:
        with production():
            ours = functools.partial(cuda_attention, scale=scale, launcher=launcher)
            res["production_autograd"] = autograd_times(ours, q, k, v, dout)
            res["production_autograd"]["same_bits"] = same_bits(ours, shape, device)
    except Exception as exc:
        res["production_autograd"] = {"error": str(exc)[:300]}
    log(f"{shape_key(shape)}: SDPA and cuda_attention timed")

    def bound(launch, kernel):
        """The kernel's launch with its arguments, converted once (what a timing loop calls)."""
        if kernel == "bwd_preprocess":
            return launcher.bound(prod["bwd_preprocess"], o, dout, delta, b * h * t)
        out_o, out_lse = (o2, lse2) if kernel == "fwd" else (o, lse)
        call = launcher.bound(launch, *kernel_args(kernel, q, k, v, dout, out_o, out_lse, delta,
                                                   grads, ds, t, scale, in_order))
        if kernel != IN_ORDER:
            return call
        count = in_order[1]

        def zeroed_then_called():  # the turn counters start at zero, as training's do
            count.zero_()
            call()
        return zeroed_then_called

    def sequence(launches: dict[str, Any], kernels: tuple[str, ...]):
        calls = [bound(launches.get(kernel), kernel) for kernel in kernels]

        def go(_):
            for call in calls:
                call()
        return go

    bwd_kernels = ("bwd_preprocess", "bwd_dq", "bwd_dkdv")
    best: dict[str, tuple[float, Any, Any]] = {}  # kernel -> (ms, launch, PipeConfig)
    # CuPy's device and stream (PyTorch's current one, where the timer's events go) set once:
    # a timed call is then the kernel launch alone.
    with launcher.context():
        res["production"] = {"kernels_ms": {
            kernel: timed_ms(sequence(prod, (kernel,))) for kernel in (*KERNELS, "bwd_preprocess")
        }}
        for row in info.values():
            if row["status"] != "ok" or (row["dtype"], row["head_dim"]) != (dtype, d):
                continue
            if left() < 25:
                res["cut_short"] = True
                break
            try:  # a whole-head backward whose block cannot hold this sequence is refused
                launch = pipe_launch(row["kernel"], b, h, t, d, dtype, row["cfg"])
                if (row["kernel"] == FUSED
                        and launch.dynamic_shared_bytes > block_shared_limit(launcher.arch)):
                    continue
                ms = timed_ms(sequence({row["kernel"]: launch}, (row["kernel"],)))
            except Exception as exc:
                row.setdefault("timing_errors", []).append(str(exc)[:200])
                continue
            res["candidates"].append({"kernel": row["kernel"], "config": row["config"], "ms": ms,
                                      "registers": row.get("registers"),
                                      "smem": launch.dynamic_shared_bytes})
            if row["kernel"] not in best or ms < best[row["kernel"]][0]:
                best[row["kernel"]] = (ms, launch, row["cfg"])
        log(f"{shape_key(shape)}: {len(res['candidates'])} candidate kernels timed")
        res["production"].update(fwd=timed_ms(sequence(prod, ("fwd",))),
                                 bwd=timed_ms(sequence(prod, bwd_kernels)),
                                 fb=timed_ms(sequence(prod, ("fwd", *bwd_kernels))))
        if all(kernel in best for kernel in KERNELS):
            chosen = {kernel: best[kernel][1] for kernel in KERNELS}
            res["best"] = {
                "configs": {kernel: chosen[kernel].name for kernel in KERNELS},
                "pipe_configs": {kernel: astuple(best[kernel][2]) for kernel in KERNELS},
                "fwd": timed_ms(sequence(chosen, ("fwd",))),
                "bwd": timed_ms(sequence(chosen, bwd_kernels)),
                "fb": timed_ms(sequence(chosen, ("fwd", *bwd_kernels))),
            }
        if all(kernel in best for kernel in ("fwd", *DS_KERNELS)):
            # the backward through dS, with the best forward
            chosen = {kernel: best[kernel][1] for kernel in ("fwd", *DS_KERNELS)}
            ds_bwd = ("bwd_preprocess", *DS_KERNELS)
            res["best_ds"] = {
                "configs": {kernel: chosen[kernel].name for kernel in DS_KERNELS},
                "pipe_configs": {kernel: astuple(best[kernel][2])
                                 for kernel in ("fwd", *DS_KERNELS)},
                "fwd": timed_ms(sequence(chosen, ("fwd",))),
                "bwd": timed_ms(sequence(chosen, ds_bwd)),
                "fb": timed_ms(sequence(chosen, ("fwd", *ds_bwd))),
                "ds_buffer_bytes": ds.numel() * ds.element_size(),
            }
        if all(kernel in best for kernel in ("fwd", FUSED)):
            # a whole head's backward in one block, with the best forward
            chosen = {kernel: best[kernel][1] for kernel in ("fwd", FUSED)}
            res["best_fused"] = {
                "configs": {FUSED: chosen[FUSED].name},
                "pipe_configs": {kernel: astuple(best[kernel][2]) for kernel in ("fwd", FUSED)},
                "fwd": timed_ms(sequence(chosen, ("fwd",))),
                "bwd": timed_ms(sequence(chosen, ("bwd_preprocess", FUSED))),
                "fb": timed_ms(sequence(chosen, ("fwd", "bwd_preprocess", FUSED))),
            }
        if all(kernel in best for kernel in ("fwd", IN_ORDER)):
            # dQ added in order inside dK/dV, with the best forward (its counters' zeroing in)
            chosen = {kernel: best[kernel][1] for kernel in ("fwd", IN_ORDER)}
            res["best_in_order"] = {
                "configs": {IN_ORDER: chosen[IN_ORDER].name},
                "pipe_configs": {kernel: astuple(best[kernel][2])
                                 for kernel in ("fwd", IN_ORDER)},
                "fwd": timed_ms(sequence(chosen, ("fwd",))),
                "bwd": timed_ms(sequence(chosen, ("bwd_preprocess", IN_ORDER))),
                "fb": timed_ms(sequence(chosen, ("fwd", "bwd_preprocess", IN_ORDER))),
            }
    winner = tuned_winner(res)
    if winner is not None and left() > 25:
        try:
            res["tuned_autograd"] = tuned_path(shape, winner, launcher, device, (q, k, v, dout))
        except Exception as exc:
            res["tuned_autograd"] = {"error": str(exc)[:300]}
    return res


# ---------------------------------------------------------------------------------- report
def table(res: dict) -> str:
    base = res["sdpa"].get("default", {})
    rows = [(f"sdpa {name}", r) for name, r in res["sdpa"].items()]
    rows.append(("ours production (autograd)", res.get("production_autograd", {})))
    if res.get("tuned_autograd"):
        rows.append(("ours tuned (autograd)", res["tuned_autograd"]))
    rows.append(("ours production", res.get("production", {})))
    if res.get("best"):
        rows.append(("ours best candidates", res["best"]))
    if res.get("best_ds"):
        rows.append(("ours best, bwd through dS", res["best_ds"]))
    if res.get("best_fused"):
        rows.append(("ours best, whole-head bwd", res["best_fused"]))
    if res.get("best_in_order"):
        rows.append(("ours best, bwd dQ in order", res["best_in_order"]))
    out = [f"== {res['shape']}  (f+b {res['flops_fb'] / 1e9:.1f} GFLOP; sdpa and (autograd) rows "
           "through autograd, the others the kernels back to back)",
           f"{'backend':27s} {'fwd ms':>8s} {'bwd ms':>8s} {'f+b ms':>8s} {'TFLOP/s':>8s} "
           f"{'fwd x':>6s} {'bwd x':>6s} {'f+b x':>6s}  repeats"]
    for name, r in rows:
        if "error" in r or "fb" not in r:
            out.append(f"{name:27s} {r.get('error', 'not timed')[:60]}")
            continue
        ratio = [f"{base[m] / r[m]:6.2f}" if m in base else "     -"
                 for m in ("fwd", "bwd", "fb")]
        bits = {True: "  same bits", False: "  DIFFER", None: ""}[r.get("same_bits")]
        out.append(f"{name:27s} {r['fwd']:8.3f} {r['bwd']:8.3f} {r['fb']:8.3f} "
                   f"{res['flops_fb'] / r['fb'] / 1e9:8.1f} {' '.join(ratio)}{bits}")
    for best in ("best", "best_ds", "best_fused", "best_in_order"):
        for kernel, name in res.get(best, {}).get("configs", {}).items():
            out.append(f"  best {kernel}: {name}")
    if res.get("best_ds"):
        out.append(f"  dS buffer: {res['best_ds']['ds_buffer_bytes'] / 2**20:.0f} MiB")
    for kernel in ALL_KERNELS:
        ranked = sorted((c for c in res["candidates"] if c["kernel"] == kernel),
                        key=lambda c: c["ms"])[:3]
        prod_ms = res.get("production", {}).get("kernels_ms", {}).get(kernel)
        prod = f"production {prod_ms:.3f} ms; " if prod_ms is not None else ""
        top = "; ".join(f"{c['config']} {c['ms']:.3f} ({c['registers']} regs)" for c in ranked)
        out.append(f"  {kernel:11s} {prod}top: {top or 'none timed'}")
    return "\n".join(out)


def jsonable(info: dict) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("fn", "cfg")} for row in info.values()]


def auto_table_entries(report: dict, date: str) -> list[str]:
    """`model.attention: auto`'s entries for this GPU (AUTO_TABLE, andrea/model/attention.py),
    as lines to paste there: per measured (dtype, head_dim), SDPA's forward + backward time over
    the production kernels' through cuda_attention (what training runs); "cuda" from 1.0 up.
    Where the shape has a TUNED line, cuda_attention with it in place: paste both."""
    lines = []
    for res in report["shapes"]:
        sdpa = (res.get("sdpa") or {}).get("default") or {}
        ours, note = res.get("production_autograd") or {}, ""
        if (res.get("tuned_autograd") or {}).get("ok"):
            ours, note = res["tuned_autograd"], ", with its TUNED line"
        if not sdpa.get("fb") or not ours.get("fb"):
            continue
        dtype, *_, head_dim = res["shape"].split()
        ratio = sdpa["fb"] / ours["fb"]
        backend = "cuda" if ratio >= 1.0 else "sdpa"
        lines.append(f'    ("{report["arch"]}", "{dtype}", {int(head_dim.removeprefix("D"))}): '
                     f'Measured("{backend}", {ratio:.2f}, "{date}"),  # {res["shape"]}{note}')
    return lines


def tuned_winner(res: dict) -> dict | None:
    """A shape's best candidates where they beat the production kernels back to back (forward
    + backward): res["best"] (the backward recomputing S and dP), res["best_ds"] (through dS)
    or res["best_fused"] (a whole head's backward in one block) or res["best_in_order"] (dQ
    added in order inside dK/dV), whichever is fastest; None where production is fastest or
    nothing was timed."""
    prod = (res.get("production") or {}).get("fb")
    options = [r for r in (res.get(key) for key in ("best", "best_ds", "best_fused",
                                                    "best_in_order")) if r and r.get("fb")]
    if not prod or not options:
        return None
    winner = min(options, key=lambda r: r["fb"])
    return winner if winner["fb"] < prod else None


@contextlib.contextmanager
def tuned(arch: str, dtype: str, head_dim: int, pipe_configs: dict | None) -> Iterator[None]:
    """andrea.cuda.launch.TUNED with an entry of these configs for the while, as if pasted;
    None: with no entry, so that cuda_attention runs the production kernels (TILES), whatever
    was pasted before."""
    from andrea.cuda import attention as ca
    from andrea.cuda import launch as kernel_launch

    key = (arch, dtype, head_dim)
    before = kernel_launch.TUNED.get(key)
    if pipe_configs is None:
        kernel_launch.TUNED.pop(key, None)
    else:
        kernel_launch.TUNED[key] = {kernel: kernel_launch.PipeConfig(*cfg)
                                    for kernel, cfg in pipe_configs.items()}
    ca._launches.cache_clear()
    try:
        yield
    finally:
        if before is None:
            kernel_launch.TUNED.pop(key, None)
        else:
            kernel_launch.TUNED[key] = before
        ca._launches.cache_clear()


def tuned_path(shape, winner: dict, launcher, device, inputs) -> dict:
    """The winner as training would run it: cuda_attention through autograd with its TUNED
    entry in place, timed at the shape and checked against float64 at CHECK_SHAPE (a whole-head
    backward at FUSED_CHECK_LEN positions, which its block holds)."""
    import torch

    from andrea.cuda.attention import cuda_attention
    from andrea.cuda.emulator import max_error

    dtype, *_, d = shape
    scale = d**-0.5
    with tuned(launcher.arch, dtype, d, winner["pipe_configs"]):
        ours = functools.partial(cuda_attention, scale=scale, launcher=launcher)
        res = autograd_times(ours, *inputs)
        res["same_bits"] = same_bits(ours, shape, device)
        b, h, _ = CHECK_SHAPE
        t = check_length(winner["pipe_configs"])
        q, k, v, dout = (torch.randn(b, h, t, d, device=device).to(getattr(torch, dtype))
                         for _ in range(4))
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = cuda_attention(*leaves, scale=scale, launcher=launcher)
        out.backward(dout)
    ref = reference_cpu(q, k, v, dout, scale)
    res["errors"] = {name: max_error(got.detach().cpu(), want) for name, got, want in zip(
        ("o", "dq", "dk", "dv"), (out, *(x.grad for x in leaves)), (ref[0], *ref[2:]),
        strict=True)}
    res["ok"] = all(e <= TOL[dtype] for e in res["errors"].values())
    return res


def tuned_entries(report: dict) -> list[str]:
    """andrea.cuda.launch.TUNED's entries for this GPU, as lines to paste there: per measured
    shape, its tuned_winner, where cuda_attention through it also matched float64."""
    from andrea.cuda.launch import PipeConfig

    lines = []
    for res in report["shapes"]:
        winner = tuned_winner(res)
        if winner is None or not (res.get("tuned_autograd") or {}).get("ok"):
            continue
        prod = res["production"]["fb"]
        dtype, *_, head_dim = res["shape"].split()
        configs = ", ".join(f'"{kernel}": {PipeConfig(*cfg).code()}'
                            for kernel, cfg in winner["pipe_configs"].items())
        lines.append(f'    ("{report["arch"]}", "{dtype}", {int(head_dim.removeprefix("D"))}): '
                     f'{{{configs}}},  # {res["shape"]}: f+b {winner["fb"]:.3f} ms, production '
                     f'{prod:.3f}')
    return lines


def summary(report: dict, info: dict, out: Path) -> str:
    lines = [""]
    for res in report["shapes"]:
        if "candidates" in res:
            lines.append(table(res))
        else:
            lines.append(f"== {res['shape']}: {res.get('skipped') or res.get('error', '')[-500:]}")
    entries = auto_table_entries(report, time.strftime("%Y-%m-%d"))
    if entries:
        lines += ["AUTO_TABLE entries (andrea/model/attention.py), the production kernels:",
                  *entries]
    tuned = tuned_entries(report)
    if tuned:
        lines += ["TUNED entries (andrea/cuda/launch.py), the candidates that beat production "
                  "(then run again: AUTO_TABLE should measure them):", *tuned]
    statuses: dict[str, int] = {}
    for row in list(info.values()):
        key = row["status"].split(" (")[0].split(":")[0]
        statuses[key] = statuses.get(key, 0) + 1
    lines.append(f"candidates: {statuses}; elapsed {elapsed():.0f} s; JSON: {out}")
    return "\n".join(lines)


# On sm_80+ pack2 (kernels/attn_common.cuh) packs P and dS with one cvt a pair; the emulator and
# the older architectures round in integer arithmetic. This kernel packs every float32 bit
# pattern both ways, in either half, and counts where they differ (NaN inputs left out: the
# cvt's NaN is canonical, any NaN will do).
PACK2_CHECK = r"""
extern "C" __global__ void pack2_check(unsigned long long* differ) {
  const u32 bits = (u32)((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return;
  const float f = __uint_as_float(bits), g = -f * 0.75f;
  const u32 b = pack2(f, g, bf16_t{}), h = pack2(g, f, half_t{});
  if (b != ((u32)bf16_bits(f) | ((u32)bf16_bits(g) << 16))) atomicAdd(differ, 1ull);
  if (h != ((u32)half_bits(g) | ((u32)half_bits(f) << 16))) atomicAdd(differ + 1, 1ull);
}
"""


def pack2_source() -> str:
    """PACK2_CHECK after the kernels' common header, the one text it needs."""
    from andrea.cuda.launch import kernel_source

    return kernel_source("attn_common.cuh") + PACK2_CHECK


def pack2_differences(device) -> dict[str, int]:
    """Runs PACK2_CHECK over all 2^32 float32 patterns on the GPU, built with the runtime's
    NVRTC options: how many of them pack2 rounds differently from the integer form, by type."""
    import cupy
    import torch

    from andrea.cuda.attention import device_arch
    from andrea.cuda.launch import nvrtc_options

    with cupy.cuda.Device(device.index):
        module = cupy.RawModule(code=pack2_source(), options=tuple(nvrtc_options(
            device_arch(device))))
        differ = cupy.zeros(2, dtype=cupy.uint64)
        module.get_function("pack2_check")((1 << 24,), (256,), (differ,))
        torch.cuda.synchronize(device)
        bf16, fp16 = (int(x) for x in differ.get())
    return {"bfloat16": bf16, "float16": fp16}


# The probe children, by what their report line says: the kernels each builds and checks.
PROBES = {"wgmma_probe": (*KERNELS, *DS_KERNELS), "in_order_probe": (IN_ORDER,)}


def probe_candidates(kernels: tuple[str, ...]) -> list[tuple]:
    """What --probe-wgmma runs: the wgmma candidates of `kernels` for every (dtype, head_dim) of
    SHAPES, the run's whole list of them."""
    return [c for c in candidate_list(SHAPES, CANDIDATE_LIMIT) if c[3].wgmma and c[0] in kernels]


def probe_run(out_dir: Path, device, kernels: tuple[str, ...] = PROBES["wgmma_probe"],
              cubins: Path | None = None) -> int:
    """--probe-wgmma: builds (into the `cubins` folder the parent loads them from) and checks
    probe_candidates(kernels), and writes OUT_DIR/probe.json, each with its status; a kernel
    fault ends this process (the parent reads that as a failure)."""
    import torch

    from andrea.cuda.attention import device_arch

    launcher = make_launcher(device)
    info = build_all(probe_candidates(kernels), device_arch(device), launcher,
                     cubin_folder(out_dir, cubins))
    check_all(info, launcher, device)
    torch.cuda.synchronize(device)  # a fault that was still pending surfaces here
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"kernel": r["kernel"], "dtype": r["dtype"], "head_dim": r["head_dim"],
             "config": astuple(r["cfg"]), "status": r["status"]} for r in info.values()]
    (out_dir / "probe.json").write_text(json.dumps(rows, indent=1))
    return 0


def run_child(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def wgmma_probe(out_dir: Path, probe: str = "wgmma_probe",
                cubins: Path | None = None) -> tuple[set, str]:
    """Runs --probe-wgmma in a child process on PROBES[probe]'s kernels: the (kernel, dtype,
    head_dim, PipeConfig) of the wgmma candidates that built and matched float64 there, their
    cubins kept in the `cubins` folder for this process to load, and one line on how it went.
    A child that faults, hangs or fails allows none of them, and this process's CUDA context
    is untouched."""
    from andrea.cuda.launch import PipeConfig

    what = probe.replace("_", " ")
    probe_dir = out_dir / probe.replace("_", "-")
    found = probe_dir / "probe.json"
    found.unlink(missing_ok=True)  # only this child's answer counts
    cmd = [sys.executable, str(Path(__file__).resolve()), str(probe_dir), "--probe-wgmma",
           "--budget", str(BUDGET_S), "--probe-kernels", ",".join(PROBES[probe]),
           "--cubins", str(cubin_folder(out_dir, cubins))]
    t0 = time.monotonic()
    try:
        proc = run_child(cmd, PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return set(), f"{what}: no answer in {PROBE_TIMEOUT_S:.0f} s; none of its candidates"
    took = f"{time.monotonic() - t0:.0f} s"
    if proc.returncode != 0 or not found.exists():
        tail = (proc.stderr or proc.stdout)[-600:].strip()
        return set(), (f"{what} failed (exit {proc.returncode}, {took}): {tail}; none of its "
                       "candidates")
    rows = json.loads(found.read_text())

    def label(r: dict) -> str:
        return f"{r['kernel']} {r['dtype']} D{r['head_dim']} {PipeConfig(*r['config']).label()}"

    allowed = {(r["kernel"], r["dtype"], r["head_dim"], PipeConfig(*r["config"]))
               for r in rows if r["status"] == "ok"}
    wrong = [f"{label(r)}: {r['status']}" for r in rows if r["status"] != "ok"]
    return allowed, (f"{what}: {len(allowed)} of {len(rows)} ok in {took}"
                     + ("; " + "; ".join(wrong) if wrong else ""))


def gpu_run(out_dir: Path, device, cubins: Path | None = None) -> int:
    import torch

    from andrea.cuda.attention import device_arch
    from andrea.cuda.launch import WGMMA_ARCH

    arch = device_arch(device)
    launcher = make_launcher(device)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "arch": arch,
                              "torch": torch.__version__, "budget_s": BUDGET_S, "shapes": []}
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "tune.json"
    folder = cubin_folder(out_dir, cubins)
    cands = candidate_list(SHAPES, CANDIDATE_LIMIT, wgmma=arch in WGMMA_ARCH)
    wgmma = [c for c in cands if c[3].wgmma]
    # The wgmma candidates only where a probe's child process built and ran them without a
    # fault; the probes run side by side (a child's fault or trap ends its own CUDA context
    # only) while this process builds and checks the others.
    names = [name for name in PROBES if any(c[0] in PROBES[name] for c in wgmma)]
    pool = ThreadPoolExecutor(max(1, len(names)))
    probes = {name: pool.submit(wgmma_probe, out_dir, name, folder) for name in names}
    info: dict[str, dict] = {}

    def watchdog() -> None:
        # A kernel that never returns (or a device that hangs) would leave the device call with
        # nothing printed: past the budget, print what was measured and leave at once.
        print(f"\n[watchdog] {elapsed():.0f} s, past the budget: stopping\n"
              + summary(report, info, out), flush=True)
        os._exit(3)

    timer = threading.Timer(BUDGET_S + 10 - elapsed(), watchdog)
    timer.daemon = True
    timer.start()
    try:
        report["pack2_differences"] = pack2_differences(device)
        log(f"pack2 (cvt) against the integer rounding, all 2^32 floats but NaN: "
            f"{report['pack2_differences']} differ")
    except Exception as exc:  # the candidates' own checks against float64 still run
        report["pack2_differences"] = f"failed: {exc}"
        log(f"pack2 check failed: {exc}")
    compile_end = BUDGET_S * COMPILE_SHARE
    info.update(build_all(build_order([c for c in cands if not c[3].wgmma], arch), arch,
                          launcher, folder, compile_end))
    report["candidates"] = jsonable(info)  # written now too: a run cut short keeps the builds
    out.write_text(json.dumps(report, indent=1, default=str))
    check_all(info, launcher, device)
    if probes:
        allowed = set()
        for name, probe in probes.items():
            found, said = probe.result()
            log(said)
            report[name] = said
            allowed |= found
        pool.shutdown()
        # the probes' cubins: loaded, however late they answered
        probed = build_all(build_order([c for c in wgmma if c in allowed], arch), arch,
                           launcher, folder, compile_end)
        check_all(probed, launcher, device)
        info.update(probed)
    report["candidates"] = jsonable(info)
    out.write_text(json.dumps(report, indent=1, default=str))
    for shape in SHAPES:
        if left() < 40:
            log(f"{shape_key(shape)}: skipped, out of time")
            report["shapes"].append({"shape": shape_key(shape), "skipped": "out of time"})
            continue
        try:
            report["shapes"].append(time_shape(shape, info, launcher, device))
            print(table(report["shapes"][-1]), flush=True)  # as soon as it is measured
        except Exception:
            report["shapes"].append({"shape": shape_key(shape),
                                     "error": traceback.format_exc()[-2000:]})
            log(f"{shape_key(shape)}: failed\n{traceback.format_exc()[-2000:]}")
        out.write_text(json.dumps(report, indent=1, default=str))
    timer.cancel()
    report["elapsed_s"] = round(elapsed(), 1)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(summary(report, info, out))
    return 0


def main(argv: list[str] | None = None) -> int:
    global BUDGET_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path,
                        help="folder for tune.json (prebuild.json with --prebuild)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for the whole run (default {BUDGET_S:.0f})")
    parser.add_argument("--dry-run", action="store_true",
                        help="the emulator's check even where a GPU is visible")
    parser.add_argument("--dry-limit", type=int, default=None,
                        help="dry run: only the first N candidates of each kernel")
    parser.add_argument("--probe-wgmma", action="store_true",
                        help="only build and check the wgmma candidates (the child process "
                             "the GPU run starts), writing OUT_DIR/probe.json")
    parser.add_argument("--probe-kernels", default=",".join(PROBES["wgmma_probe"]),
                        help="--probe-wgmma: of these kernels (comma-separated)")
    parser.add_argument("--cubins", type=Path, default=None,
                        help="NVRTC's cubins: loaded from here where built before, kept here "
                             "when built (default OUT_DIR/cubins)")
    parser.add_argument("--prebuild", metavar="ARCH", default=None,
                        help="only compile every candidate for ARCH (sm_90: the H100 and H200) "
                             "into --cubins with this machine's NVRTC, no GPU needed, and "
                             "write OUT_DIR/prebuild.json; then carry the folder to the GPU "
                             "machine and give it there as --cubins")
    args = parser.parse_args(argv)
    BUDGET_S = args.budget
    if args.prebuild:
        return prebuild(args.out_dir, args.prebuild, cubin_folder(args.out_dir, args.cubins))
    import torch

    gpu = torch.cuda.is_available() and not args.dry_run
    if gpu:
        try:
            import cupy  # noqa: F401
        except ImportError as exc:
            log(f"CUDA is visible but CuPy is not importable ({exc}): dry run instead")
            gpu = False
    if not gpu and args.probe_wgmma:
        log("--probe-wgmma needs a GPU and CuPy")
        return 2
    if not gpu:
        return dry_run(args.out_dir, args.dry_limit)
    device = torch.device("cuda", torch.cuda.current_device())
    if args.probe_wgmma:
        return probe_run(args.out_dir, device, tuple(args.probe_kernels.split(",")),
                         args.cubins)
    return gpu_run(args.out_dir, device, args.cubins)


if __name__ == "__main__":
    sys.exit(main())
