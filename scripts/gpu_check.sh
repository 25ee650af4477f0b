#!/usr/bin/env bash
# One command for a GPU machine: the CUDA attention backend's GPU tests, compute-sanitizer
# (memcheck, racecheck) on a small case, `andrea bench`, then 20 training steps of ANDREA-120M
# with each attention backend. Full logs go to LOGDIR; a short table is printed last (and kept
# as LOGDIR/summary.txt). Uses the machine's own torch and CuPy; installs nothing else.
#
#   scripts/gpu_check.sh LOGDIR
#
# Under 5 minutes on one H200. On a machine without a GPU it is a dry run: the tests run with the
# GPU ones skipped (reasons shown), the sanitizers and training are skipped with the reason, and
# the benchmark runs in its --quick CPU form. Exit code: 0 when nothing failed, 1 otherwise.
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: scripts/gpu_check.sh LOGDIR   (full logs go to LOGDIR)" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
LOGDIR=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
START=$SECONDS
FAILED=0
SUMMARY=()

note() {  # note WHAT RESULT: one row of the final table; also echoed as progress
    local row
    row=$(printf '%-34s %s' "$1" "$2")
    SUMMARY+=("$row")
    echo "[$((SECONDS - START)) s] $row"
}

# 0. The package from this checkout, without touching the machine's torch or CuPy: first with
# the build backend already installed (a GPU machine may have no network), then with pip's own
# isolated build, briefly. `python -m andrea` from the repository root works either way.
if "$PY" -m pip install -e . --no-deps --no-build-isolation >"$LOGDIR/install.log" 2>&1 ||
    "$PY" -m pip install -e . --no-deps --retries 0 --timeout 10 >>"$LOGDIR/install.log" 2>&1; then
    note "install" "pip install -e . --no-deps: ok"
else
    note "install" "pip install failed (see install.log); running the checkout with python -m"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
andrea() { "$PY" -m andrea "$@"; }

{
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    "$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import cupy
    print("cupy", cupy.__version__, "cuda runtime", cupy.cuda.runtime.runtimeGetVersion())
except Exception as exc:
    print("cupy unavailable:", type(exc).__name__, exc)
EOF
} >"$LOGDIR/environment.txt" 2>&1

GPU_REASON=$("$PY" - <<'EOF'
import torch
from andrea.attention import cuda_unavailable_reason
dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
print(cuda_unavailable_reason(64, dev) or "")
EOF
)
HAVE_GPU=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
if [ -n "$GPU_REASON" ]; then
    note "cuda backend" "unavailable: $GPU_REASON"
fi

# 1. The tests of the CUDA backend (CPU ones too; the GPU ones skip with a reason if they must).
if "$PY" -c "import pytest" 2>/dev/null; then
    "$PY" -m pytest tests/test_cuda_backend.py -v -rs -p no:cacheprovider >"$LOGDIR/pytest.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || FAILED=1
    note "pytest test_cuda_backend.py" "$(tail -n 1 "$LOGDIR/pytest.log" | tr -d '=' | xargs) (rc $rc)"
else
    FAILED=1
    note "pytest test_cuda_backend.py" "NOT RUN: pytest is not installed (pip install pytest)"
fi

# 2. compute-sanitizer on a small forward + backward (python -m andrea.cuda_attention). PyTorch's
# caching allocator would hide out-of-bounds accesses inside its big blocks: turn it off.
SANITIZER=$(command -v compute-sanitizer || true)
for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [ -z "$SANITIZER" ] && [ -x "$candidate" ] && SANITIZER=$candidate
done
for tool in memcheck racecheck; do
    if [ -n "$GPU_REASON" ]; then
        note "compute-sanitizer $tool" "skipped: $GPU_REASON"
    elif [ -z "$SANITIZER" ]; then
        note "compute-sanitizer $tool" "skipped: compute-sanitizer is not on this machine"
    else
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 240 "$SANITIZER" --tool "$tool" \
            --error-exitcode 99 "$PY" -m andrea.cuda_attention >"$LOGDIR/sanitizer-$tool.log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || FAILED=1
        summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOGDIR/sanitizer-$tool.log" | tail -n 1)
        note "compute-sanitizer $tool" "rc $rc; ${summary:-no summary line (see log)}"
    fi
done

# 3. andrea bench: the full benchmark on a GPU, its --quick form on a CPU.
BENCH_ARGS=()
[ "$HAVE_GPU" = 1 ] || BENCH_ARGS=(--quick)
if andrea bench --json "${BENCH_ARGS[@]}" >"$LOGDIR/bench.json" 2>"$LOGDIR/bench.log"; then
    "$PY" - "$LOGDIR/bench.json" >"$LOGDIR/bench.txt" <<'EOF'
import sys
from andrea.bench import BenchResult, format_table
print(format_table(BenchResult.from_json(open(sys.argv[1]).read())))
EOF
    note "andrea bench ${BENCH_ARGS[*]}" "ok (bench.txt, bench.json)"
else
    FAILED=1
    note "andrea bench ${BENCH_ARGS[*]}" "FAILED: $(tail -n 1 "$LOGDIR/bench.log")"
fi

# 4. 20 training steps of ANDREA-120M (its own batch recipe) with each backend.
TRAIN_BACKENDS=(cuda sdpa)
for backend in "${TRAIN_BACKENDS[@]}"; do
    if [ "$HAVE_GPU" != 1 ]; then
        note "train 120M x20 $backend" "skipped: no GPU (20 steps of ANDREA-120M need one)"
        continue
    fi
    if [ "$backend" = cuda ] && [ -n "$GPU_REASON" ]; then
        note "train 120M x20 $backend" "skipped: $GPU_REASON"
        continue
    fi
    andrea train --config andrea-120m --overwrite --no-progress \
        --set model.attention="$backend" --set train.max_steps=20 --set train.warmup_steps=2 \
        --set train.eval_every=0 --set train.checkpoint_every=0 --set train.log_every=1 \
        --set train.runs_dir="$LOGDIR/runs" --set train.name="andrea-120m-$backend" \
        --set data.dir="$LOGDIR/data-gpt2" >"$LOGDIR/train-$backend.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || FAILED=1
    figures=$("$PY" - "$LOGDIR/runs/andrea-120m-$backend/metrics.jsonl" <<'EOF' 2>&1
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in rows if r["event"] == "train"]
steady = [r for r in train if r["step"] > 3] or train  # the first steps include warm-up
tok = statistics.median(r["tokens_per_s"] for r in steady)
mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
mfu = f"{statistics.median(mfus):.1%}" if mfus else "n/a"
print(f"{tok:,.0f} tokens/s, MFU {mfu}, loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}")
EOF
)
    note "train 120M x20 $backend" "rc $rc; ${figures}"
done

# 5. The short table, last.
{
    echo
    echo "== gpu_check summary ($((SECONDS - START)) s; logs in $LOGDIR) =="
    printf '%s\n' "${SUMMARY[@]}"
    if [ -f "$LOGDIR/bench.txt" ]; then
        echo
        cat "$LOGDIR/bench.txt"
    fi
    echo
    [ $FAILED -eq 0 ] && echo "RESULT: ok" || echo "RESULT: FAILED (see the logs)"
} | tee "$LOGDIR/summary.txt"
exit $FAILED
