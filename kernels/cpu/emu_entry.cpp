// emu_entry.cpp - the CPU build of kernels/microgpt_cuda.cu: a shared library that launches
// its kernels by NVRTC name expression, with kernel parameters passed like cuLaunchKernel's
// kernelParams (args[i] points at the i-th argument's value). Built by andrea/cuda/emulator.py.
#include "cuda_emulator.h"
// The kernel source with its parts written in place (andrea.cuda.launch.kernel_source), or a
// modified text; found through -I, where the build writes it.
#include "microgpt_cuda.cu"

#include <cstring>
#include <type_traits>
#include <utility>

namespace {

template <class... A, size_t... I>
void call_with(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <class... A>
void run(void (*f)(A...), dim3 grid, dim3 block, int mode, size_t dynamic_bytes, void** args) {
  andrea_emu::launch(
      grid, block, (andrea_emu::Mode)mode,
      [&] { call_with(f, args, std::index_sequence_for<A...>{}); }, dynamic_bytes);
}

struct Entry {
  const char* name;
  void (*launch)(dim3, dim3, int, size_t, void**);
  int warps, tile_n, shared_bytes;
  int min_blocks, passes;  // __launch_bounds__'s promise (0: none), dK/dV's column passes
};

// A pipelined candidate's promise and passes from its trailing template arguments (MINB, or
// MINB and PASSES for dK/dV).
constexpr int min_blocks_of(int min_blocks, int = 1) { return min_blocks; }
constexpr int passes_of(int, int passes = 1) { return passes; }

#define ANDREA_KIND(KERNEL, K, TYPE, TN, D)                                                   \
  Entry{#KERNEL "<" TN ", " #D ">",                                                            \
        [](dim3 g, dim3 b, int m, size_t s, void** a) {                                        \
          run(&KERNEL<TYPE, D>, g, b, m, s, a);                                                \
        },                                                                                     \
        TileCfg<TYPE, D, K>::W, TileCfg<TYPE, D, K>::N, (int)sizeof(Smem<TYPE, D, K>),         \
        MinBlocks<TYPE, D, K>::value, K == KIND_DKDV ? DkdvPasses<TYPE, D>::value : 1}
#define ANDREA_TILED(TYPE, TN, D)                                                             \
  ANDREA_KIND(attn_fwd, KIND_FWD, TYPE, TN, D), ANDREA_KIND(attn_bwd_dq, KIND_DQ, TYPE, TN, D), \
      ANDREA_KIND(attn_bwd_dkdv, KIND_DKDV, TYPE, TN, D), ANDREA_PREPROCESS(TYPE, TN, D)
#define ANDREA_ENTRIES(TYPE, TN, D)                                                           \
  ANDREA_TILED(TYPE, TN, D), ANDREA_NAIVE(attn_fwd_naive, TYPE, TN, D),                        \
      ANDREA_NAIVE(attn_bwd_dq_naive, TYPE, TN, D), ANDREA_NAIVE(attn_bwd_dkdv_naive, TYPE, TN, D)
// The naive baseline kernels: ANDREA_NAIVE_THREADS threads, no tiles, no shared memory.
#define ANDREA_NAIVE(KERNEL, TYPE, TN, D)                                                     \
  Entry{#KERNEL "<" TN ", " #D ">",                                                            \
        [](dim3 g, dim3 b, int m, size_t s, void** a) {                                        \
          run(&KERNEL<TYPE, D>, g, b, m, s, a);                                                \
        },                                                                                     \
        ANDREA_NAIVE_THREADS / 32, 0, 0, 0, 1}

// A pipelined candidate (attn_*_pipe, attn_bwd_*_ds): NAME is andrea.cuda.launch's name
// expression, BYTES its dynamic shared memory (the layout's `bytes`, in parentheses), the rest
// the template arguments.
#define ANDREA_PIPE(NAME, KERNEL, BYTES, TYPE, D, W, N, STAGES, ...)                           \
  Entry{NAME,                                                                                  \
        [](dim3 g, dim3 b, int m, size_t s, void** a) {                                        \
          run(&KERNEL<TYPE, D, W, N, STAGES, __VA_ARGS__>, g, b, m, s, a);                     \
        },                                                                                     \
        W, N, BYTES, min_blocks_of(__VA_ARGS__), passes_of(__VA_ARGS__)}

// The whole-head backward (attn_bwd_fused): its shared memory grows with the sequence, so the
// table's figure is FusedSmem's at SEQ_LEN positions (andrea.cuda.launch.FUSED_MIN_SEQ_LEN).
#define ANDREA_FUSED(NAME, TYPE, D, W, N, MINB, SEQ_LEN)                                       \
  Entry{NAME,                                                                                  \
        [](dim3 g, dim3 b, int m, size_t s, void** a) {                                        \
          run(&attn_bwd_fused<TYPE, D, W, N, MINB>, g, b, m, s, a);                            \
        },                                                                                     \
        W, N, FusedSmem<TYPE, D, W, N>::bytes(SEQ_LEN), MINB, 1}

// ANDREA_EMU_HALF_ONLY: the tiled fp16 kernels alone, for the builds of another arch's fp16 path
// (-DANDREA_HALF_ARCH=750 or 700; the naive kernels have no per-arch path), a sixth of the code.
#define ANDREA_PREPROCESS(TYPE, TN, D)                                                        \
  Entry{"attn_bwd_preprocess<" TN ", " #D ">",                                                 \
        [](dim3 g, dim3 b, int m, size_t s, void** a) {                                        \
          run(&attn_bwd_preprocess<TYPE, D>, g, b, m, s, a);                                   \
        },                                                                                     \
        4, 0, 0, 0, 1}

// ANDREA_EMU_PIPE_ONLY: the candidates (emu_pipe_entries.inc) and the preprocess kernels their
// backward uses, no other production kernel: a candidate library builds in a fraction of the time.
const Entry kEntries[] = {
#if defined(ANDREA_EMU_PIPE_ONLY)
    ANDREA_PREPROCESS(float, "float", 32),   ANDREA_PREPROCESS(float, "float", 64),
    ANDREA_PREPROCESS(float, "float", 128),  ANDREA_PREPROCESS(bf16_t, "bf16_t", 32),
    ANDREA_PREPROCESS(bf16_t, "bf16_t", 64), ANDREA_PREPROCESS(bf16_t, "bf16_t", 128),
    ANDREA_PREPROCESS(half_t, "half_t", 32), ANDREA_PREPROCESS(half_t, "half_t", 64),
    ANDREA_PREPROCESS(half_t, "half_t", 128),
#elif defined(ANDREA_EMU_HALF_ONLY)
    ANDREA_TILED(half_t, "half_t", 32), ANDREA_TILED(half_t, "half_t", 64),
    ANDREA_TILED(half_t, "half_t", 128),
#else
    ANDREA_ENTRIES(float, "float", 32),   ANDREA_ENTRIES(float, "float", 64),
    ANDREA_ENTRIES(float, "float", 128),  ANDREA_ENTRIES(bf16_t, "bf16_t", 32),
    ANDREA_ENTRIES(bf16_t, "bf16_t", 64), ANDREA_ENTRIES(bf16_t, "bf16_t", 128),
    ANDREA_ENTRIES(half_t, "half_t", 32), ANDREA_ENTRIES(half_t, "half_t", 64),
    ANDREA_ENTRIES(half_t, "half_t", 128),
#endif
#if defined(ANDREA_EMU_PIPE)
// Written by andrea/cuda/emulator.py from the candidates asked for (andrea.cuda.launch).
#include "emu_pipe_entries.inc"
#endif
};

const Entry* find(const char* name) {
  for (const Entry& e : kEntries)
    if (std::strcmp(e.name, name) == 0) return &e;
  return nullptr;
}

}  // namespace

extern "C" {

// The kernel file's own float <-> fp16 conversions over n values, for the conversion tests.
void andrea_emu_to_half(const float* in, unsigned short* out, long n) {
  for (long i = 0; i < n; ++i) out[i] = half_bits(in[i]);
}
void andrea_emu_from_half(const unsigned short* in, float* out, long n) {
  for (long i = 0; i < n; ++i) out[i] = half_to_float(in[i]);
}
// The kernel file's float -> bf16 (bf16_bits: from_float<bf16_t>, and pack2 off sm_80+) over n
// values, for the conversion test.
void andrea_emu_to_bf16(const float* in, unsigned short* out, long n) {
  for (long i = 0; i < n; ++i) out[i] = bf16_bits(in[i]);
}

int andrea_emu_kernel_count() { return (int)(sizeof(kEntries) / sizeof(kEntries[0])); }

const char* andrea_emu_kernel_name(int i) { return kEntries[i].name; }

// Tile config, shared memory (static; a candidate's dynamic), launch-bounds promise and dK/dV
// passes of a kernel, as the kernel source has them.
int andrea_emu_kernel_info(const char* name, int* warps, int* tile_n, int* shared_bytes,
                           int* min_blocks, int* passes) {
  const Entry* e = find(name);
  if (!e) return -1;
  *warps = e->warps;
  *tile_n = e->tile_n;
  *shared_bytes = e->shared_bytes;
  *min_blocks = e->min_blocks;
  *passes = e->passes;
  return 0;
}

// mode 0: fibers, 1: OS threads. Returns -1 for an unknown kernel name.
// dynamic_bytes: the launch's dynamic shared memory (0 for the kernels with static only).
int andrea_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                      unsigned by, unsigned bz, int mode, long dynamic_bytes, void** args) {
  const Entry* e = find(name);
  if (!e) return -1;
  e->launch(dim3(gx, gy, gz), dim3(bx, by, bz), mode, (size_t)dynamic_bytes, args);
  return 0;
}
}
