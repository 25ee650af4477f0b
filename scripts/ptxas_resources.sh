#!/usr/bin/env bash
# The ptxas resource table (registers, shared memory, spills) of every kernel instance in
# kernels/microgpt_cuda.cu for sm_80, sm_89 and sm_90: the nvcc compile-gate tests, run with
# their output shown. Needs nvcc on PATH, no GPU. The plain test suite checks the same limits
# on NVRTC's build (what runs) and leaves nvcc's builds of every instance to this script.
#
#   scripts/ptxas_resources.sh
set -euo pipefail
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,/^set -euo pipefail$/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
ANDREA_COMPILE_ALL=1 exec "${PYTHON:-python}" -m pytest -q -s -p no:cacheprovider tests/test_kernel_compile.py -k nvcc
