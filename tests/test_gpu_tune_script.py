"""scripts/gpu_tune_attention.py's GPU path without a GPU: a stand-in CuPy whose kernels run on
the CPU emulator, torch.cuda's few calls stubbed, wall-clock timers. What the one GPU run would
do (build, prune, check against float64, time the candidates, the production kernels and SDPA,
pick the best per kernel, table and JSON) runs here with everything but the device; a
candidate that computes wrong results is flagged and never timed. NVRTC's own build of a
candidate (libnvrtc through ctypes) is checked where the wheel is installed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import astuple
from pathlib import Path

import pytest
import torch

from andrea import bench
from andrea.cuda import emulator as kernel_emulator
from andrea.cuda import launch as kernel_launch
from andrea.cuda.nvrtc import Build, Nvrtc, find_libnvrtc

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="the CPU kernel emulator needs g++, which is not on PATH"
)

SCRIPT = Path(__file__).parents[1] / "scripts" / "gpu_tune_attention.py"
SHAPE = ("bfloat16", 1, 2, 40, 32)
LIMIT = 2  # candidates per kernel: the production tile at 1 and 2 stages


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_tune_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def is_candidate(name: str) -> bool:
    return any(f"_{kind}<" in name for kind in ("pipe", "ds", "wgmma", "overlap", "fused"))


def fake_cupy(candidates: kernel_emulator.Emulator, launches: list) -> object:
    """CuPy as the script and CupyLauncher use it; each kernel call runs on the emulator."""
    production = kernel_emulator.default_emulator()

    class Kernel:
        num_regs = 96
        local_size_bytes = 0

        def __init__(self, name: str) -> None:
            self.name = name
            self.max_dynamic_shared_size_bytes = 48 * 1024

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            launches.append((self.name, shared_mem, self.max_dynamic_shared_size_bytes))
            lib = candidates if is_candidate(self.name) else production
            values = []
            for a in args:  # CuPy's rules: an int is 64 bits (a pointer here), numpy's as typed
                kind = type(a).__name__
                values.append(ctypes.c_void_p(a) if kind == "int" else
                              ctypes.c_int(int(a)) if kind == "int32" else ctypes.c_float(a))
            params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            rc = lib.lib.andrea_emu_launch(self.name.encode(), *grid, *block, 0, shared_mem,
                                           params)
            assert rc == 0, self.name

    class RawModule:
        def __init__(self, code=None, options=(), backend="nvrtc", name_expressions=(),
                     path=None):
            if path is None:  # CuPy's own compile
                assert code == kernel_launch.kernel_source()
                self.holds = None
            else:  # a cubin of FakeNvrtc's
                data = Path(path).read_bytes()
                assert data.startswith(FakeNvrtc.CUBIN), data[:40]
                self.holds = data.removeprefix(FakeNvrtc.CUBIN).decode()

        def compile(self):
            pass

        def get_function(self, name):
            assert self.holds in (None, name)
            return Kernel(name)

    class Ctx:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = type(sys)("cupy")
    fake.RawModule = RawModule
    fake.cuda = type(sys)("cupy.cuda")
    fake.cuda.Device = lambda index=None: Ctx()
    fake.cuda.Stream = type("Stream", (), {"from_external": classmethod(lambda cls, obj: Ctx())})
    return fake


class FakeNvrtc:
    """NVRTC as the script's Cubins use it: a cubin that names its instance (which the stand-in
    CuPy loads), every compile counted in `compiled`."""
    CUBIN = b"stand-in cubin of "
    compiled: list[str] = []

    def __init__(self, path: Path) -> None:
        pass

    def version(self) -> str:
        return "13.0"

    def compile(self, source: str, names: list[str], options: list[str]) -> Build:
        assert source == kernel_launch.kernel_source() and len(names) == 1
        (name,) = names
        self.compiled.append(name)
        return Build(self.CUBIN + name.encode(), {name: name},
                     "ptxas info    : Used 96 registers, used 1 barriers\n"
                     "ptxas         .     0 bytes stack frame, 0 bytes spill stores, "
                     "0 bytes spill loads\n")


@pytest.fixture
def gpu_world(monkeypatch, tmp_path):
    """The script's GPU path on the CPU: candidates built through a stand-in NVRTC (the kept
    cubins in OUT/cubins; tune.Nvrtc.compiled lists each compile) and run by a stand-in CuPy on
    the emulator. (tune, OUT, the launches, the candidates)."""
    tune = load_script()
    monkeypatch.setattr(tune, "SHAPES", [SHAPE])
    monkeypatch.setattr(tune, "CHECK_SHAPE", (1, 2, 45))
    monkeypatch.setattr(tune, "CANDIDATE_LIMIT", LIMIT)
    monkeypatch.setattr(tune, "find_libnvrtc", lambda: Path("libnvrtc.so.13"))
    monkeypatch.setattr(tune, "Nvrtc", type("Nvrtc", (FakeNvrtc,), {"compiled": []}))
    cands = tune.candidate_list([SHAPE], LIMIT)
    emu = kernel_emulator.Emulator(pipes=tuple(cands))
    launches: list = []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(emu, launches))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "stand-in")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
        "S", (), {"cuda_stream": 7})())
    monkeypatch.setattr(bench, "CudaTimer", bench.WallTimer)
    monkeypatch.setattr(kernel_launch, "_MODULES", {})
    # An entry pasted from an earlier run, whose kernels this emulator does not hold: the
    # production rows and the checks' forward set it aside (a launch of it would fail here).
    monkeypatch.setitem(kernel_launch.TUNED, ("sm_90", "bfloat16", 32), {
        "fwd": kernel_launch.PipeConfig(4, 64, 3), "bwd_fused": kernel_launch.PipeConfig(8, 32, 1)})
    make = tune.make_launcher

    def cpu_launcher(device):
        launcher = make(device)
        launcher.device_type = "cpu"  # the tensors live on the CPU here
        return launcher

    monkeypatch.setattr(tune, "make_launcher", cpu_launcher)
    # Here the probe's child runs in-process (the stand-in CuPy is this process's), in a thread
    # beside the parent, not a process: its checks and the parent's take turns (the emulator
    # and TUNED are one process's here).
    in_turn = threading.RLock()
    check_all = tune.check_all

    def check_all_in_turn(*args):
        with in_turn:
            return check_all(*args)

    monkeypatch.setattr(tune, "check_all", check_all_in_turn)

    def child(cmd, timeout):
        assert cmd[1] == str(SCRIPT.resolve()) and cmd[3] == "--probe-wgmma" and timeout > 0
        assert cmd[6] == "--probe-kernels" and cmd[8] == "--cubins"
        with in_turn:
            return subprocess.CompletedProcess(cmd, tune.probe_run(
                Path(cmd[2]), torch.device("cpu"), tuple(cmd[7].split(",")), Path(cmd[9])))

    monkeypatch.setattr(tune, "run_child", child)
    return tune, tmp_path, launches, cands


def test_gpu_path_builds_checks_times_and_reports(gpu_world, capsys, monkeypatch) -> None:
    tune, out, launches, cands = gpu_world
    # the two probe children run side by side: each waits here until the other has started
    both = threading.Barrier(2, timeout=10)
    child = tune.run_child
    monkeypatch.setattr(tune, "run_child",
                        lambda cmd, timeout: (both.wait(), child(cmd, timeout))[1])
    assert tune.gpu_run(out, torch.device("cpu")) == 0
    report = json.loads((out / "tune.json").read_text())
    kernels = set(tune.ALL_KERNELS)
    # on sm_90 the first LIMIT of each kernel's mma.sync and wgmma candidates (wgmma: all but
    # the whole-head backward; dQ in order: wgmma only)
    assert report["arch"] == "sm_90" and len(report["candidates"]) == len(cands) == 12 + 6 * LIMIT
    assert {row["kernel"] for row in report["candidates"] if "wgmma" in row["config"]} == {
        *tune.KERNELS, *tune.DS_KERNELS, tune.IN_ORDER}
    # the kernels whose blocks wait on each other in a probe child of their own
    assert re.fullmatch(rf"wgmma probe: {5 * LIMIT} of {5 * LIMIT} ok in \d+ s",
                        report["wgmma_probe"]), report["wgmma_probe"]
    assert re.fullmatch(rf"in order probe: {LIMIT} of {LIMIT} ok in \d+ s",
                        report["in_order_probe"]), report["in_order_probe"]
    assert all(row["status"] == "ok" for row in report["candidates"]), report["candidates"]
    # each candidate compiled once: the wgmma ones by the probe children, whose cubins this
    # process loaded (kept in OUT/cubins), the others here
    names = [kernel_launch.pipe_name_expression(*c) for c in cands]
    assert sorted(tune.Nvrtc.compiled) == sorted(names)
    assert all(row["cubin"] == ("found" if "wgmma" in row["config"] else "compiled")
               for row in report["candidates"]), report["candidates"]
    assert len(list((out / "cubins").glob("*.cubin"))) == len(cands)
    # the backward through dS was checked on the dS it writes, not only on dK and dV; dQ in
    # order on its bits repeating in a second run too
    assert all("ds" in row["errors"] for row in report["candidates"]
               if row["kernel"] == "bwd_dkdv_ds")
    assert all(row["errors"]["repeat"] == 0.0 for row in report["candidates"]
               if row["kernel"] == tune.IN_ORDER)
    (shape,) = report["shapes"]
    assert shape["shape"] == "bfloat16 B1 H2 T40 D32"
    assert {c["kernel"] for c in shape["candidates"]} == kernels
    assert set(shape["best"]["configs"]) == set(tune.KERNELS)
    assert set(shape["best_ds"]["configs"]) == set(tune.DS_KERNELS)
    assert set(shape["best_fused"]["configs"]) == {tune.FUSED}
    assert set(shape["best_in_order"]["configs"]) == {tune.IN_ORDER}
    assert shape["best_ds"]["ds_buffer_bytes"] == 1 * 2 * 40 * 128 * 2  # B*H x T x stride, bf16
    for part in ("fwd", "bwd", "fb"):
        assert shape["production"][part] > 0 and shape["best"][part] > 0
        assert shape["best_ds"][part] > 0 and shape["best_fused"][part] > 0
        assert shape["best_in_order"][part] > 0
        assert shape["sdpa"]["default"][part] > 0 and shape["production_autograd"][part] > 0
    assert "error" in shape["sdpa"]["cudnn"]  # no cuDNN attention on a CPU: said, not fatal
    # each row through autograd says whether its bits repeat (the CPU's do)
    assert shape["sdpa"]["default"]["same_bits"] is True
    assert shape["production_autograd"]["same_bits"] is True
    text = capsys.readouterr().out
    assert "ours best candidates" in text and "ours best, bwd through dS" in text
    assert "ours best, whole-head bwd" in text and "ours best, bwd dQ in order" in text
    assert "f+b x" in text
    # auto's table entry, ready to paste: SDPA's f+b time over the custom op's
    (entry,) = [line for line in text.splitlines()
                if line.startswith('    ("sm_90"') and "Measured(" in line]
    # (the custom op with the TUNED line in place where candidates beat production; the wall
    # timers here decide that, test_the_winner_runs_through_autograd_as_training_would forces it)
    ours = shape.get("tuned_autograd") if (shape.get("tuned_autograd") or {}).get("ok") else (
        shape["production_autograd"])
    ratio = shape["sdpa"]["default"]["fb"] / ours["fb"]
    backend = "cuda" if ratio >= 1 else "sdpa"
    assert entry.startswith(f'    ("sm_90", "bfloat16", 32): Measured("{backend}", {ratio:.2f}, ')
    # candidates ran with their dynamic shared memory; the production kernels with none
    assert any(is_candidate(name) and shared > 0 for name, shared, _ in launches)
    assert all(shared == 0 for name, shared, _ in launches if not is_candidate(name))


def test_the_winner_runs_through_autograd_as_training_would(gpu_world, monkeypatch,
                                                            capsys) -> None:
    """Where candidates win, the one GPU call also runs them as training would: cuda_attention
    through autograd with their TUNED entry in place (timed, and checked against float64),
    which the AUTO_TABLE line then measures; TUNED is as it was afterwards."""
    from andrea.cuda import attention as ca

    tune, out, _, _ = gpu_world
    pasted = dict(kernel_launch.TUNED)
    monkeypatch.setattr(tune, "tuned_winner", lambda res: res.get("best_ds") or None)
    through_ds = []
    run_ds = ca._backward_through_ds
    monkeypatch.setattr(ca, "_backward_through_ds", lambda *a: (through_ds.append(1), run_ds(*a)))
    assert tune.gpu_run(out, torch.device("cpu")) == 0
    (shape,) = json.loads((out / "tune.json").read_text())["shapes"]
    tuned = shape["tuned_autograd"]
    assert tuned["ok"] and set(tuned["errors"]) == {"o", "dq", "dk", "dv"}, tuned
    assert all(tuned[part] > 0 for part in ("fwd", "bwd", "fb")) and through_ds
    assert kernel_launch.TUNED == pasted
    text = capsys.readouterr().out
    assert "ours tuned (autograd)" in text
    (auto,) = [line for line in text.splitlines() if "Measured(" in line]
    assert auto.endswith("with its TUNED line")
    assert f'{shape["sdpa"]["default"]["fb"] / tuned["fb"]:.2f}' in auto
    (line,) = [line for line in text.splitlines() if "PipeConfig(" in line]
    assert line.startswith('    ("sm_90", "bfloat16", 32): {"fwd": PipeConfig(')
    assert '"bwd_dkdv_ds"' in line and '"bwd_dq_ds"' in line


def test_the_wgmma_candidates_run_first_in_a_child_process(gpu_world, monkeypatch) -> None:
    """A wgmma kernel that faults ends its CUDA context: the probe's child process runs them
    first, and the run keeps those that matched float64 there, none if the child died, and
    every mma.sync candidate either way."""
    tune, out, _, cands = gpu_world
    run_probe = tune.run_child

    def one_wrong(cmd, timeout):
        proc = run_probe(cmd, timeout)
        found = Path(cmd[2]) / "probe.json"
        rows = json.loads(found.read_text())
        rows[0]["status"] = "wrong (o 0.5)"
        found.write_text(json.dumps(rows))
        return proc

    first = next(c for c in cands if c[3].wgmma and c[0] != tune.IN_ORDER)
    first_in_order = next(c for c in cands if c[0] == tune.IN_ORDER)
    # the first candidate's build finishes last: the probe still reports in the candidates' order
    module_arch = kernel_launch.module_arch

    def first_builds_last(arch, names):
        if names == [kernel_launch.pipe_name_expression(*first)]:
            time.sleep(0.5)
        return module_arch(arch, names)

    monkeypatch.setattr(kernel_launch, "module_arch", first_builds_last)
    monkeypatch.setattr(tune, "run_child", one_wrong)
    assert tune.gpu_run(out, torch.device("cpu")) == 0
    report = json.loads((out / "tune.json").read_text())
    assert re.match(rf"wgmma probe: {5 * LIMIT - 1} of {5 * LIMIT} ok in \d+ s; "
                    + re.escape(f"{first[0]} bfloat16 D32 {first[3].label()}: wrong (o 0.5)"),
                    report["wgmma_probe"]), report["wgmma_probe"]
    assert re.fullmatch(rf"in order probe: {LIMIT - 1} of {LIMIT} ok in \d+ s; "
                        + re.escape(f"{tune.IN_ORDER} bfloat16 D32 "
                                    f"{first_in_order[3].label()}: wrong (o 0.5)"),
                        report["in_order_probe"]), report["in_order_probe"]
    configs = {(row["kernel"], row["config"]) for row in report["candidates"]}
    assert (first[0], first[3].label()) not in configs and len(configs) == len(cands) - 2
    assert (tune.IN_ORDER, first_in_order[3].label()) not in configs

    monkeypatch.setattr(tune, "run_child", lambda cmd, timeout: subprocess.CompletedProcess(
        cmd, 1, "", "CUDA error: an illegal instruction was encountered"))
    assert tune.gpu_run(out, torch.device("cpu")) == 0
    report = json.loads((out / "tune.json").read_text())
    assert re.match(r"wgmma probe failed \(exit 1, \d+ s\): CUDA error: an illegal",
                    report["wgmma_probe"]), report["wgmma_probe"]
    assert not any("wgmma" in row["config"] for row in report["candidates"])
    assert len(report["candidates"]) == sum(not c[3].wgmma for c in cands)
    assert all(row["status"] == "ok" for row in report["candidates"])


def test_the_probes_take_every_shapes_wgmma_candidates() -> None:
    """The probe children build and check the wgmma candidates of every (dtype, head_dim) the
    run times, the in-order one apart: the main run only loads what passed there."""
    tune = load_script()
    wgmma = [c for c in tune.candidate_list(tune.SHAPES) if c[3].wgmma]
    probed = [tune.probe_candidates(kernels) for kernels in tune.PROBES.values()]
    assert sorted(map(str, wgmma)) == sorted(str(c) for cands in probed for c in cands)
    assert {(c[1], c[2]) for c in probed[0]} == {(s[0], s[4]) for s in tune.SHAPES}
    assert {c[0] for c in probed[1]} == {tune.IN_ORDER}


def test_the_tuned_choices_build_first_and_kept_cubins_load_past_the_compile_share(
        gpu_world, monkeypatch) -> None:
    """A short budget still builds the last tuning's winners (TUNED's entry for the GPU first in
    the build order). Past the compile share nothing compiles, but a cubin already kept (by the
    probe children, an earlier run or a CPU's --prebuild) still loads: a probe child that
    answers late loses none of its candidates."""
    tune, out, _, cands = gpu_world
    mma = [c for c in cands if not c[3].wgmma]
    last = mma[-1]  # made the tuned forward: it moves to the front, the rest keep their order
    monkeypatch.setitem(kernel_launch.TUNED, ("sm_90", last[1], last[2]), {last[0]: last[3]})
    ordered = tune.build_order(mma, "sm_90")
    assert ordered[0] == last and ordered[1:] == mma[:-1]
    assert tune.build_order(mma, "sm_80") == mma  # no entry for that GPU: as listed

    launcher = tune.make_launcher(torch.device("cpu"))
    kept = out / "kept"
    first = tune.build_all(cands, "sm_90", launcher, kept)
    assert all(r["status"] == "built" and r["cubin"] == "compiled" for r in first.values())
    assert len(tune.Nvrtc.compiled) == len(cands)
    # the clock past the compile share: what is kept loads, nothing compiles
    again = tune.build_all(cands, "sm_90", launcher, kept, stop_at=0.0)
    assert all(r["status"] == "built" and r["cubin"] == "found" for r in again.values())
    none = tune.build_all(cands, "sm_90", launcher, out / "empty", stop_at=0.0)
    assert all(r["status"] == "skipped (compile budget spent)" for r in none.values())
    assert len(tune.Nvrtc.compiled) == len(cands)
    # a kept cubin is of one source, options and NVRTC version: another is compiled afresh
    newer = type("Nvrtc", (tune.Nvrtc,), {"version": lambda self: "13.1"})
    monkeypatch.setattr(tune, "Nvrtc", newer)
    again = tune.build_all(cands[:1], "sm_90", launcher, kept, stop_at=0.0)
    assert [r["status"] for r in again.values()] == ["skipped (compile budget spent)"]


def test_a_cpu_prebuild_leaves_the_gpu_nothing_to_compile(gpu_world) -> None:
    """--prebuild ARCH compiles every candidate the GPU run builds there, no GPU needed;
    that folder given to the GPU run as --cubins, it compiles nothing and runs every
    candidate."""
    tune, out, _, cands = gpu_world
    kept = out / "kept"
    assert tune.main([str(out / "pre"), "--prebuild", "sm_90", "--cubins", str(kept)]) == 0
    pre = json.loads((out / "pre" / "prebuild.json").read_text())
    assert pre["arch"] == "sm_90" and pre["nvrtc"] == "13.0"
    names = [kernel_launch.pipe_name_expression(*c) for c in cands]
    assert [r["name"] for r in pre["candidates"]] == names
    assert all(r["cubin"] == "compiled" and r["registers"] == 96 and r["spill_bytes"] == 0
               for r in pre["candidates"])
    assert sorted(tune.Nvrtc.compiled) == sorted(names)
    assert tune.main([str(out / "pre"), "--prebuild", "sm_90", "--cubins", str(kept)]) == 0
    assert len(tune.Nvrtc.compiled) == len(names)  # all there already
    # sm_80 has no wgmma candidates (and sm_80's cubins are others)
    assert tune.main([str(out / "pre80"), "--prebuild", "sm_80", "--cubins", str(kept)]) == 0
    pre80 = json.loads((out / "pre80" / "prebuild.json").read_text())
    assert len(pre80["candidates"]) == sum(not c[3].wgmma for c in cands)

    # an architecture spelled otherwise is refused, nothing built
    assert tune.main([str(out / "bad"), "--prebuild", "sm_90a", "--cubins", str(kept)]) == 2
    assert tune.main([str(out / "bad"), "--prebuild", "h100", "--cubins", str(kept)]) == 2
    assert not (out / "bad").exists()

    assert tune.gpu_run(out / "gpu", torch.device("cpu"), kept) == 0
    assert len(tune.Nvrtc.compiled) == len(names) + len(pre80["candidates"])
    report = json.loads((out / "gpu" / "tune.json").read_text())
    assert all(r["status"] == "ok" and r["cubin"] == "found" for r in report["candidates"])


@pytest.mark.skipif(find_libnvrtc() is None, reason="the nvidia-cuda-nvrtc wheel is not installed")
def test_a_prebuild_keeps_nvrtcs_own_cubins_with_their_registers(tmp_path, monkeypatch) -> None:
    """The real NVRTC: a mma.sync and a wgmma candidate for sm_90 (sm_90a), kept as cubins (ELF)
    beside their lowered names, registers and spills; a second prebuild finds them."""
    tune = load_script()
    two = [c for c in tune.candidate_list([SHAPE], 1) if c[0] == "fwd"]
    assert [c[3].wgmma for c in two] == [False, True]
    monkeypatch.setattr(tune, "candidate_list", lambda shapes, limit, wgmma=True: two)
    kept = tmp_path / "kept"
    for state in ("compiled", "found"):
        assert tune.prebuild(tmp_path, "sm_90", kept) == 0
        rows = json.loads((tmp_path / "prebuild.json").read_text())["candidates"]
        assert [r["cubin"] for r in rows] == [state, state]
        assert all(0 < r["registers"] <= 255 and r["spill_bytes"] == 0 for r in rows), rows
    cubins = sorted(kept.glob("*.cubin"))
    assert len(cubins) == 2 and all(c.read_bytes()[:4] == b"\x7fELF" for c in cubins)
    metas = [json.loads(c.with_suffix(".json").read_text()) for c in cubins]
    assert {m["options"][1] for m in metas} == {"-arch=sm_90", "-arch=sm_90a"}
    assert all(m["lowered"].startswith("_Z") for m in metas)


def test_a_wrong_candidate_is_flagged_and_not_timed(gpu_world, monkeypatch) -> None:
    tune, out, _, _ = gpu_world
    monkeypatch.setattr(tune, "find_libnvrtc", lambda: None)  # CuPy's compile path, as well
    tune.TOL = {**tune.TOL, "bfloat16": 1e-9}  # nothing in bf16 is that close to float64
    assert tune.gpu_run(out, torch.device("cpu")) == 0
    report = json.loads((out / "tune.json").read_text())
    assert all(row["status"].startswith("wrong") for row in report["candidates"])
    assert report["shapes"][0]["candidates"] == [] and not report["shapes"][0]["best"]
    assert "best_ds" not in report["shapes"][0] and "best_fused" not in report["shapes"][0]


def test_large_dynamic_shared_memory_is_opted_into(monkeypatch) -> None:
    """CupyLauncher raises a function's max dynamic shared memory before a launch past 48 KiB
    and passes the launch's bytes (the candidate then runs correctly on the emulator)."""
    from andrea.cuda import attention as ca

    cfg = kernel_launch.PipeConfig(8, 64, 2)
    launches: list = []
    emu = kernel_emulator.Emulator(pipes=(("fwd", "float32", 32, cfg),))
    cupy = fake_cupy(emu, launches)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
        "S", (), {"cuda_stream": 7})())
    launcher = ca.CupyLauncher(torch.device("cuda", 0))
    monkeypatch.setattr(launcher, "_function", lambda name: cupy.RawModule(
        code=kernel_launch.kernel_source()).get_function(name))
    launch = kernel_launch.pipe_launch("fwd", 1, 1, 20, 32, "float32", cfg)
    assert launch.dynamic_shared_bytes > 48 * 1024
    q, k, v = (torch.randn(1, 1, 20, 32, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    o, lse = torch.full_like(q, float("nan")), torch.full((1, 1, 20), float("nan"))
    launcher.launch(launch, q, k, v, o, lse, 20, 0.2)
    (name, shared, limit), = launches
    assert name == launch.name and shared == limit == launch.dynamic_shared_bytes
    ro, rlse, *_ = kernel_emulator.float64_reference(q, k, v, torch.zeros_like(q), 0.2)
    assert kernel_emulator.max_error(o, ro) < 1e-5 and kernel_emulator.max_error(lse, rlse) < 1e-5


@pytest.mark.skipif(find_libnvrtc() is None, reason="the nvidia-cuda-nvrtc wheel is not installed")
def test_nvrtc_builds_a_candidate_with_registers_and_no_spill() -> None:
    tune = load_script()
    nvrtc = tune.Nvrtc(tune.find_libnvrtc())  # the script's compiler is the package's
    assert (tune.Nvrtc, tune.find_libnvrtc) == (Nvrtc, find_libnvrtc)
    cfg = kernel_launch.PipeConfig(4, 64, 2)
    name = kernel_launch.pipe_name_expression("fwd", "bfloat16", 32, cfg)
    build = nvrtc.compile(kernel_launch.kernel_source(), [name],
                          kernel_launch.runtime_nvrtc_options("sm_90"))
    assert build.cubin[:4] == b"\x7fELF" and build.lowered[name].startswith("_Z13attn_fwd_pipe")
    assert "registers" in build.log and tune.spill_bytes(build.log) == 0
    assert tune.spill_bytes("8 bytes spill stores, 4 bytes spill loads") == 12


@pytest.mark.skipif(find_libnvrtc() is None, reason="the nvidia-cuda-nvrtc wheel is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_pack2_packs_a_pair_with_one_cvt_and_its_gpu_check_builds(arch: str, tmp_path) -> None:
    """Every P and dS tile goes through pack2 before its product: on sm_80+ it is one hardware
    cvt a pair (the integer rounding cost 5-12 instructions a value, as many issue slots as the
    products). The PTX says which form was built; the tuner's check of its bits over every
    float32 (PACK2_CHECK) builds with the runtime's options."""
    tune = load_script()
    build = Nvrtc(find_libnvrtc()).compile(tune.pack2_source(), ["pack2_check"],
                                           kernel_launch.runtime_nvrtc_options(arch))
    assert build.cubin[:4] == b"\x7fELF" and build.lowered["pack2_check"] == "pack2_check"
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the PTX is not read")
    source = tmp_path / "pack2.cu"
    source.write_text(tune.pack2_source())
    ptx = subprocess.run(["nvcc", "-ptx", f"-arch={arch}", "-std=c++17", "-o", "-", str(source)],
                         capture_output=True, text=True, check=True).stdout
    assert ptx.count("cvt.rn.bf16x2.f32") == 1 and ptx.count("cvt.rn.f16x2.f32") == 1, ptx


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (and CuPy)")
def test_gpu_pack2_rounds_every_float_as_the_integer_form() -> None:
    pytest.importorskip("cupy")
    tune = load_script()
    device = torch.device("cuda", torch.cuda.current_device())
    assert tune.pack2_differences(device) == {"bfloat16": 0, "float16": 0}


def test_tuned_entries_paste_into_tuned_and_pick_the_faster_backward(monkeypatch) -> None:
    """The TUNED lines the script prints: the faster of the two backward routes where it
    beats production and ran right through the custom op, none where production is fastest;
    pasted, they launch those kernels."""
    tune = load_script()
    cfg = kernel_launch.PipeConfig
    fwd, dq, dkdv = cfg(4, 64, 2, wgmma=True), cfg(4, 64, 3), cfg(4, 64, 2, 3, 2)
    shape = {"shape": "bfloat16 B8 H12 T1024 D64", "production": {"fb": 1.0},
             "best": {"fb": 0.8, "pipe_configs": {"fwd": list(astuple(fwd)),
                                                  "bwd_dq": list(astuple(dq)),
                                                  "bwd_dkdv": list(astuple(dkdv))}},
             "best_ds": {"fb": 0.7, "pipe_configs": {"fwd": list(astuple(fwd)),
                                                     "bwd_dkdv_ds": list(astuple(dkdv)),
                                                     "bwd_dq_ds": list(astuple(cfg(8, 128, 2)))}},
             "tuned_autograd": {"ok": True}}
    slower = {**shape, "shape": "bfloat16 B32 H12 T256 D32", "production": {"fb": 0.5}}
    (line,) = tune.tuned_entries({"arch": "sm_90", "shapes": [shape, slower]})
    key, _, value = line.partition(": ")
    entry = eval(value.split("  #")[0].rstrip(","), {"PipeConfig": cfg})  # noqa: S307
    assert eval(key.strip()) == ("sm_90", "bfloat16", 64)  # noqa: S307
    assert entry == {"fwd": fwd, "bwd_dkdv_ds": dkdv, "bwd_dq_ds": cfg(8, 128, 2)}
    monkeypatch.setitem(kernel_launch.TUNED, ("sm_90", "bfloat16", 64), entry)
    launches = kernel_launch.tuned_launches(8, 12, 1024, 64, "bfloat16", "sm_90")
    assert list(launches) == ["fwd", "bwd_preprocess", "bwd_dkdv_ds", "bwd_dq_ds"]
    assert launches["bwd_dq_ds"].name == "attn_bwd_dq_ds<bf16_t, 64, 8, 128, 2, 0>"
    assert launches["fwd"].name == "attn_fwd_wgmma<bf16_t, 64, 4, 64, 2, 0>"
    assert '"fwd": PipeConfig(4, 64, 2, wgmma=True)' in line
    shape["best_ds"]["fb"] = 0.9  # now recomputing S and dP wins
    (line,) = tune.tuned_entries({"arch": "sm_90", "shapes": [shape]})
    assert '"bwd_dq": PipeConfig(4, 64, 3)' in line and "_ds" not in line
    shape["tuned_autograd"]["ok"] = False  # the custom op through it missed float64: no line
    assert tune.tuned_entries({"arch": "sm_90", "shapes": [shape]}) == []
    # the 12M preset's shape, where a whole head's backward in one block wins: pasted, it runs
    # at 256 positions, and a longer sequence keeps the production backward
    fused = {"fb": 0.5, "pipe_configs": {"fwd": list(astuple(cfg(4, 64, 2))),
                                         "bwd_fused": list(astuple(cfg(8, 64, 1)))}}
    small = {**slower, "production": {"fb": 1.0}, "best_fused": fused,
             "tuned_autograd": {"ok": True}}
    (line,) = tune.tuned_entries({"arch": "sm_90", "shapes": [small]})
    assert line.startswith('    ("sm_90", "bfloat16", 32): {"fwd": PipeConfig(4, 64, 2), '
                           '"bwd_fused": PipeConfig(8, 64, 1)}')
    monkeypatch.setitem(kernel_launch.TUNED, ("sm_90", "bfloat16", 32),
                        eval(line.partition(": ")[2].split("  #")[0].rstrip(","),  # noqa: S307
                             {"PipeConfig": cfg}))
    assert list(kernel_launch.tuned_launches(32, 12, 256, 32, "bfloat16", "sm_90")) == [
        "fwd", "bwd_preprocess", "bwd_fused"]
    assert list(kernel_launch.tuned_launches(8, 12, 1024, 32, "bfloat16", "sm_90")) == [
        "fwd", "bwd_preprocess", "bwd_dq", "bwd_dkdv"]


def test_a_backward_whose_bits_do_not_repeat_is_found() -> None:
    """same_bits compares every output and gradient of the repeats bit for bit: a backward
    that sums in another order each time (as atomics do) is caught, by one ulp."""
    tune = load_script()
    calls = []

    def attend(q, k, v):
        calls.append(1)
        out = q * k + v
        return out + (out.detach() * 2.0**-20 if len(calls) == 3 else 0)

    shape = ("float32", 1, 2, 8, 4)
    assert tune.same_bits(lambda q, k, v: q * k + v, shape, torch.device("cpu"))
    assert not tune.same_bits(attend, shape, torch.device("cpu"))


def test_the_det_rows_ask_for_the_deterministic_paths_strictly() -> None:
    """Under warn_only, PyTorch's flash and efficient backwards only warn and keep their
    non-deterministic paths, so the "-det" rows set the mode strictly (an op without a
    deterministic form raises instead), leave torch.empty's memory unfilled as training does,
    and put everything back after."""
    import torch.utils.deterministic as det

    tune = load_script()
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    with tune.deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert det.fill_uninitialized_memory is False
    assert (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            det.fill_uninitialized_memory) == before
    with tune.deterministic_algorithms(False):
        assert not torch.are_deterministic_algorithms_enabled()


def test_an_in_order_backward_whose_bits_do_not_repeat_is_wrong() -> None:
    """dQ in order's blocks order their adds among themselves: a second run that changes an
    element (a race on a GPU, which can still land within float64's tolerance) fails the check."""
    tune = load_script()
    cands = tune.candidate_list([SHAPE], LIMIT)  # gpu_world's: its emulator build, cached
    emu = kernel_emulator.Emulator(pipes=tuple(cands))
    _, dtype, d, cfg = next(c for c in cands if c[0] == tune.IN_ORDER)
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 2, 70, d, generator=gen).to(torch.bfloat16)
                     for _ in range(4))
    ref = kernel_emulator.float64_reference(q, k, v, dout, d**-0.5)
    o, lse = kernel_emulator.attention_forward(q, k, v)
    delta = torch.full((1, 2, 70), math.nan)
    emu.launch(kernel_launch.attention_launches(1, 2, 70, d, dtype)["bwd_preprocess"], o, dout,
               delta, 140)
    calls = []

    def second_run_differs(launch, *args):
        emu.launch(launch, *args)
        calls.append(1)
        if len(calls) == 2:
            args[6].view(-1)[5] += 1  # one element of dQ
    inputs, forward = (q, k, v, dout), (o, lse, delta)
    errs = tune.check_candidate(emu.launch, tune.IN_ORDER, cfg, inputs, forward, ref, None)
    assert errs["repeat"] == 0.0 and max(errs.values()) <= tune.TOL[dtype]
    errs = tune.check_candidate(second_run_differs, tune.IN_ORDER, cfg, inputs, forward, ref,
                                None)
    assert errs["repeat"] == 1.0 and errs["dq"] <= tune.TOL[dtype]  # within tolerance, yet wrong
