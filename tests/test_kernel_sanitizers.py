"""Sanitizer gates on the emulated kernels: ThreadSanitizer (a missing barrier) and
AddressSanitizer (an out-of-bounds access), each on one small case, clean on the real kernel
file and shown to catch a deliberately broken copy of it.

The sanitizer programs run forward + backward once with the block's threads as OS threads
(what ThreadSanitizer tracks) and every tensor as its own exactly sized heap allocation.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from pathlib import Path

import background
import pytest

from andrea.cuda import emulator as kernel_emulator
from andrea.cuda.launch import PipeConfig

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="the CPU kernel emulator needs g++, which is not on PATH"
)

BH, SEQ_LEN = 1, 17  # T not a multiple of any tile: the bounds checks matter
# Two query blocks and two streamed tiles in every production kernel (bf16 D=32's 64 rows), so
# each kernel refills the shared memory of a tile its warps read: the barrier before the refill
# (barrier:fwd-reuse, dq-reuse, dkdv-reuse) matters. At SEQ_LEN one tile is all there is, and
# in the emulator's fibers the tensor-core path's warp collectives keep the warps in step, so
# without these barriers only the scalar paths (fp32, sm_70's fp16) missed float64.
REUSE_SEQ_LEN = 100

# The barrier after a K/V tile is loaded: without it warps read shared memory other threads
# are still writing.
BARRIER = "__syncthreads();  // barrier:fwd-loaded (K/V tile visible to every warp)"
# The bounds check of the tile loader: without it, rows past T are read from past the tensors.
BOUNDS = "if (row0 + r < seq_len)  // bounds: rows past the sequence read as zeros"


# The pipelined candidates (attn_*_pipe), and with them the sm_90a kernels (attn_*_wgmma) and
# their overlapped twins (3 stages): a 2-stage cp.async pipeline of 32-row tiles in blocks of 64
# rows (a warpgroup), at a T where every kernel's stages are reused (4 tiles of 32 rows; each
# block's dynamic shared memory is an exactly sized heap buffer). Their one barrier per tile,
# and their async loader's bounds check.
PIPE = PipeConfig(4, 32, 2, wgmma=True)
PIPE_SEQ_LEN = 100
PIPE_BARRIER = ("__syncthreads();  // barrier:pipe (everyone's have; everyone is done with "
                "tile it-1-LAG)")
PIPE_BOUNDS = "const bool in = row0 + r < rows;  // bounds: rows past the matrix land as zeros"
PIPE_CLEAN = "test_pipelined_candidates_are_clean_under_sanitizer"
# The wgmma kernels' loader into the core-matrix layout, its bounds check.
CM_BOUNDS = "const bool in = row0 + r < rows;  // bounds: zeros land for rows past the matrix"


def broken(original: str, replace: str, by: str) -> str:
    assert original.count(replace) == 1, f"marker not found once in the kernel file: {replace}"
    return original.replace(replace, by)


def no_barrier() -> str:
    return broken(kernel_emulator.kernel_source(), BARRIER, "/* barrier removed */")


def no_bounds_check() -> str:
    return broken(kernel_emulator.kernel_source(), BOUNDS, "if (true)")


def no_pipe_barrier() -> str:
    return broken(kernel_emulator.kernel_source(), PIPE_BARRIER, "/* barrier removed */")


def no_pipe_bounds_check() -> str:
    return broken(kernel_emulator.kernel_source(), PIPE_BOUNDS, "const bool in = true;")


def no_cm_bounds_check() -> str:
    return broken(kernel_emulator.kernel_source(), CM_BOUNDS, "const bool in = true;")


# Each program is built on a low-priority thread from the session's start (tests/background.py).
# build name: (sanitizer, the kernel file's text (None: the file as it is), the test that runs it)
# A name with "-pipe" builds the pipelined candidates' program (PIPE).
PROGRAMS = {
    "sanitizer-thread-pipe": ("thread", None, PIPE_CLEAN),
    "sanitizer-address-pipe": ("address", None, PIPE_CLEAN),
    "sanitizer-thread-pipe-no-barrier": ("thread", no_pipe_barrier,
                                         "test_thread_sanitizer_catches_a_removed_pipe_barrier"),
    "sanitizer-address-pipe-no-bounds-check": (
        "address", no_pipe_bounds_check,
        "test_address_sanitizer_catches_a_removed_async_bounds_check"),
    "sanitizer-address-pipe-no-cm-bounds-check": (
        "address", no_cm_bounds_check,
        "test_address_sanitizer_catches_a_removed_core_matrix_bounds_check"),
    "sanitizer-thread": ("thread", None, "test_kernels_are_clean_under_sanitizer"),
    "sanitizer-address": ("address", None, "test_kernels_are_clean_under_sanitizer"),
    "sanitizer-thread-no-barrier": ("thread", no_barrier,
                                    "test_thread_sanitizer_catches_a_removed_barrier"),
    "sanitizer-address-no-bounds-check": ("address", no_bounds_check,
                                          "test_address_sanitizer_catches_a_removed_bounds_check"),
}


def build(sanitizer: str, kernel_text: Callable[[], str] | None, pipe: bool) -> Path:
    text = kernel_text() if kernel_text else None
    return kernel_emulator.build_sanitizer_program(sanitizer, "bfloat16", 32, text,
                                                   PIPE if pipe else None)


if shutil.which("g++"):
    for _name, (_sanitizer, _text, _test) in PROGRAMS.items():
        background.declare(_name, functools.partial(build, _sanitizer, _text, "-pipe" in _name),
                           wanted_by=[f"test_kernel_sanitizers.py::{_test}"])


def run(program: str, seq_len: int | None = None):
    seq_len = seq_len or (PIPE_SEQ_LEN if "-pipe" in program else SEQ_LEN)
    return kernel_emulator.run_sanitizer_program(background.result(program), BH, seq_len)


@pytest.mark.parametrize("seq_len", [SEQ_LEN, REUSE_SEQ_LEN])
@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_kernels_are_clean_under_sanitizer(sanitizer: str, seq_len: int) -> None:
    proc = run(f"sanitizer-{sanitizer}", seq_len)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Sanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.stdout.startswith("checksum ")


def test_thread_sanitizer_catches_a_removed_barrier() -> None:
    proc = run("sanitizer-thread-no-barrier")
    assert proc.returncode != 0
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr, proc.stderr[-3000:]
    assert "attn_fwd" in proc.stderr  # the race is reported in the kernel that lost the barrier


def test_address_sanitizer_catches_a_removed_bounds_check() -> None:
    proc = run("sanitizer-address-no-bounds-check")
    assert proc.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "load_tile" in proc.stderr


@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_pipelined_candidates_are_clean_under_sanitizer(sanitizer: str) -> None:
    proc = run(f"sanitizer-{sanitizer}-pipe")
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Sanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.stdout.startswith("checksum ")


def test_thread_sanitizer_catches_a_removed_pipe_barrier() -> None:
    """Without the barrier a thread's cp.async into the stage of tile it-1 races the other
    warps still reading it (the emulated copy writes its destination at issue and at the
    wait)."""
    proc = run("sanitizer-thread-pipe-no-barrier")
    assert proc.returncode != 0
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr, proc.stderr[-3000:]
    assert "attn_fwd_pipe" in proc.stderr


def test_address_sanitizer_catches_a_removed_async_bounds_check() -> None:
    proc = run("sanitizer-address-pipe-no-bounds-check")
    assert proc.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "load_block_async" in proc.stderr


def test_address_sanitizer_catches_a_removed_core_matrix_bounds_check() -> None:
    """The wgmma kernels' loader (attn_hopper.cuh) reads past the tensors without its check."""
    proc = run("sanitizer-address-pipe-no-cm-bounds-check")
    assert proc.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "load_block_cm_async" in proc.stderr
