// microgpt_cuda.cu - causal attention kernels for ANDREA (FlashAttention-2 style).
//
// One source, three compilers: NVRTC at run time (andrea's CUDA backend), nvcc for the compile
// gates, and g++ against kernels/cpu/cuda_emulator.h to run the same kernels on the CPU. So: no
// system or CUDA headers, own bfloat16 and fp16 conversions and INFINITY, and every GPU-only
// instruction (ldmatrix, mma.sync, cp.async) sits in one small device function whose #else body
// computes the same thing with the PTX-documented fragment layouts (lane registers <-> matrix
// elements).
//
// This file is the one the compilers are given; the kernels live in the parts it includes below,
// in that order (each part relies on the ones before it and includes nothing itself):
//   attn_common.cuh    element types and conversions, warp MMA steps and GEMMs, tile loads
//                      (synchronous and cp.async), output stores
//   attn_tiles.cuh     the production kernels' tile table and static shared-memory layout
//   attn_forward.cuh   attn_fwd
//   attn_backward.cuh  attn_bwd_preprocess, attn_bwd_dq, attn_bwd_dkdv
//   attn_pipe.cuh      the pipelined candidates attn_*_pipe and their dynamic shared memory,
//                      the backward through dS, a whole head's backward in one block
//   attn_hopper.cuh    the sm_90a candidates on wgmma (Hopper's warpgroup MMA): the forward and
//                      both backward routes
//   attn_naive.cuh     the naive baseline attn_*_naive
// nvcc and g++ resolve the #includes themselves; NVRTC gets the text with the parts written in
// place (andrea.cuda.launch.kernel_source), so a module's cache key, the hash of that text,
// covers every part.
//
// ---------------------------------------------------------------------------------------------
// Tensors (all contiguous, 16-byte aligned base pointers):
//   q, k, v, o, dout, dq, dk, dv : [B, H, T, D] of T_ (float, bf16_t or half_t)
//   lse, delta                   : [B, H, T] float32  (lse = natural log-sum-exp of scaled scores)
//   scale: score multiplier, 1/sqrt(D) by default. Causal mask: key j visible to query i iff j <= i.
//
// Kernels (templates; NVRTC name expressions, e.g. "attn_fwd<bf16_t, 64>"):
//   attn_fwd<T_, D>(q, k, v, o, lse, int seq_len, float scale)
//   attn_bwd_preprocess<T_, D>(o, dout, delta, int rows)          rows = B*H*T
//   attn_bwd_dq<T_, D>(q, k, v, dout, lse, delta, dq, int seq_len, float scale)
//   attn_bwd_dkdv<T_, D>(q, k, v, dout, lse, delta, dk, dv, int seq_len, float scale)
//   T_ in {float, bf16_t, half_t}, D in {32, 64, 128}. Other head dims are refused by the caller.
//   Naive baseline (speed reference only; same arguments as the kernel without the suffix):
//   attn_fwd_naive<T_, D>, attn_bwd_dq_naive<T_, D>, attn_bwd_dkdv_naive<T_, D>
//
// Launch recipe (W = warps of the kernel's tile config, M = 16*W rows owned by a block,
// N = rows of the streamed tile; the values per (type, D, kernel) are TILES in
// andrea/cuda/launch.py, repeated for the compilers in attn_tiles.cuh):
//   kernel               grid                          block      dynamic smem
//   attn_fwd             (ceil(T/M_fwd),  B*H, 1)      32*W_fwd   0  (static, <= 48 KiB)
//   attn_bwd_preprocess  (ceil(B*H*T/128), 1, 1)       128        0
//   attn_bwd_dq          (ceil(T/M_dq),   B*H, 1)      32*W_dq    0
//   attn_bwd_dkdv        (ceil(T/M_dkdv), B*H, 1)      32*W_dkdv  0
//   backward order: preprocess, then dq and dkdv (independent of each other). No atomics:
//   every output element is written by exactly one thread, so results are deterministic.
//   attn_*_naive         (B*H, 1, 1)                   128        0  (one block per (b, h);
//                        backward: the same attn_bwd_preprocess first, then dq_naive, dkdv_naive)
//
// Design. The grid covers (query tile, batch*head). A block keeps its own tile (queries; keys
// in dkdv) in shared memory, each warp owning 16 of its rows, and streams the other operand
// through shared memory N rows at a time, skipping tiles the causal mask removes entirely.
// Forward keeps the softmax online in float32 (running max and sum per row, base-2 exponents),
// then writes O and the log-sum-exp. Backward recomputes P = exp(S*scale - lse) tile by tile
// (no T x T matrix): dq owns query tiles and streams K/V; dkdv owns key tiles and streams Q/dO.
// bf16 matmuls use tensor cores (mma.sync m16n8k16, fp32 accumulate) with ldmatrix fragment
// loads; P and dS stay in registers (C fragment -> A fragment repack). fp16 does the same on
// sm_80+ (m16n8k16 .f16), as two m16n8k8 per step on sm_75, and with float FMAs from shared
// memory on sm_70 and older (ANDREA_HALF_PATH). fp32 matmuls use the same
// fragment ownership with float FMAs from shared memory (the A operand of the second matmul goes
// through a warp-private scratch tile) so fp32 keeps full precision.
// ---------------------------------------------------------------------------------------------

#include "attn_common.cuh"
#include "attn_tiles.cuh"
#include "attn_forward.cuh"
#include "attn_backward.cuh"
#include "attn_pipe.cuh"
#include "attn_hopper.cuh"
#include "attn_naive.cuh"

// Explicit instantiations for offline builds (the nvcc compile gates): every instance, or with
// ANDREA_INSTANTIATE_HALF the fp16 ones only (sm_75, whose bf16 would be emulated by shuffles).
// NVRTC instantiates through name expressions instead, so the runtime compiles only what it
// launches.
#if defined(ANDREA_INSTANTIATE_ALL) || defined(ANDREA_INSTANTIATE_HALF)
#define ANDREA_INSTANTIATE(TYPE, D)                                                              \
  template __global__ void attn_fwd<TYPE, D>(const TYPE*, const TYPE*, const TYPE*, TYPE*,       \
                                             float*, int, float);                                \
  template __global__ void attn_bwd_preprocess<TYPE, D>(const TYPE*, const TYPE*, float*, int);  \
  template __global__ void attn_bwd_dq<TYPE, D>(const TYPE*, const TYPE*, const TYPE*,           \
                                                const TYPE*, const float*, const float*, TYPE*,  \
                                                int, float);                                     \
  template __global__ void attn_bwd_dkdv<TYPE, D>(const TYPE*, const TYPE*, const TYPE*,         \
                                                  const TYPE*, const float*, const float*,       \
                                                  TYPE*, TYPE*, int, float);                     \
  template __global__ void attn_fwd_naive<TYPE, D>(const TYPE*, const TYPE*, const TYPE*, TYPE*, \
                                                   float*, int, float);                          \
  template __global__ void attn_bwd_dq_naive<TYPE, D>(const TYPE*, const TYPE*, const TYPE*,     \
                                                      const TYPE*, const float*, const float*,   \
                                                      TYPE*, int, float);                        \
  template __global__ void attn_bwd_dkdv_naive<TYPE, D>(const TYPE*, const TYPE*, const TYPE*,   \
                                                        const TYPE*, const float*, const float*, \
                                                        TYPE*, TYPE*, int, float);
#endif
#if defined(ANDREA_INSTANTIATE_ALL)
ANDREA_INSTANTIATE(float, 32)
ANDREA_INSTANTIATE(float, 64)
ANDREA_INSTANTIATE(float, 128)
ANDREA_INSTANTIATE(bf16_t, 32)
ANDREA_INSTANTIATE(bf16_t, 64)
ANDREA_INSTANTIATE(bf16_t, 128)
#endif
#if defined(ANDREA_INSTANTIATE_ALL) || defined(ANDREA_INSTANTIATE_HALF)
ANDREA_INSTANTIATE(half_t, 32)
ANDREA_INSTANTIATE(half_t, 64)
ANDREA_INSTANTIATE(half_t, 128)
#endif
#undef ANDREA_INSTANTIATE
