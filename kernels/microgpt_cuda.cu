// microgpt_cuda.cu - causal attention kernels for ANDREA (FlashAttention-2 style).
//
// One source, three compilers: NVRTC at run time (andrea's CUDA backend), nvcc for the compile
// gates, and g++ against kernels/cpu/cuda_emulator.h to run the same kernels on the CPU. So: no
// headers, own bfloat16 and fp16 conversions and INFINITY, and every GPU-only instruction (ldmatrix,
// mma.sync) sits in one small device function whose #else body computes the same thing with
// the PTX-documented fragment layouts (lane registers <-> matrix elements).
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
// N = rows of the streamed tile; values in TileCfg below and andrea/cuda/launch.py):
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
//   TileCfg (W, N)     fwd      dq       dkdv
//   bf16  D=32         (4, 64)  (4, 64)  (4, 64)
//   bf16  D=64         (4, 64)  (4, 64)  (4, 64)
//   bf16  D=128        (4, 32)  (4, 16)  (4, 16)
//   fp16               as bf16 (same element size, same fragments)
//   fp32  D=32         (4, 32)  (4, 32)  (4, 32)
//   fp32  D=64         (4, 32)  (2, 32)  (2, 32)
//   fp32  D=128        (2, 16)  (1, 16)  (1, 16)
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

typedef unsigned int u32;
typedef unsigned short u16;

struct bf16_t {
  u16 bits;
};

__device__ __forceinline__ float inf_f() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float(((u32)x.bits) << 16); }

// float -> bf16, round to nearest even; NaN stays NaN (quiet bit set).
__device__ __forceinline__ u16 bf16_bits(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}

template <typename T_> __device__ __forceinline__ T_ from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  bf16_t r;
  r.bits = bf16_bits(x);
  return r;
}

// IEEE binary16 (fp16) as 16 bits. Both directions in integer arithmetic, so the emulator and
// every GPU give the same bits whatever their float modes (-ftz=true included).
struct half_t {
  u16 bits;
};

// float -> fp16, round to nearest even: past 65504 + half an ulp to inf, below 2^-14 to a
// subnormal (exactly half of 2^-24 rounds to 0, its even neighbour), NaN to a quiet NaN.
__device__ __forceinline__ u16 half_bits(float f) {
  const u32 u = __float_as_uint(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (u16)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);
  if (a >= 0x38800000u)  // normal: rebias the exponent by 127 - 15, round 23 -> 10 bits
    return (u16)(sign | ((a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13));
  if (a <= 0x33000000u) return (u16)sign;
  // Subnormal: the 24-bit significand in units of 2^-24 is m >> shift, shift in 14..24.
  const u32 m = (a & 0x7fffffu) | 0x800000u, shift = 126u - (a >> 23);
  const u32 r = m >> shift, rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
  return (u16)(sign | (r + ((rem > halfway || (rem == halfway && (r & 1u))) ? 1u : 0u)));
}

// fp16 -> float, exact, so the device's cvt.f32.f16 (one instruction where the integer version
// costs the naive kernels spills) and the integer version agree on every value. In the latter a
// subnormal is m * 2^-24: m converted and scaled by a power of two, both exact, and the result a
// normal float, so flush-to-zero cannot touch it.
__device__ __forceinline__ float half_to_float(u32 h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
  return f;
#else
  const u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  if (e != 0u) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
  const float x = (float)m * 5.9604644775390625e-8f;  // 2^-24
  return sign ? -x : x;
#endif
}

__device__ __forceinline__ float to_float(half_t x) { return half_to_float(x.bits); }
template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
  half_t r;
  r.bits = half_bits(x);
  return r;
}

// Two floats -> one .b32 register holding two 16-bit values (lower column in the low half).
__device__ __forceinline__ u32 pack2(float lo, float hi, bf16_t) {
  return (u32)bf16_bits(lo) | ((u32)bf16_bits(hi) << 16);
}
__device__ __forceinline__ u32 pack2(float lo, float hi, half_t) {
  return (u32)half_bits(lo) | ((u32)half_bits(hi) << 16);
}

// Which fp16 path is built: tensor cores m16n8k16 (sm_80+), two m16n8k8 per k16 step (sm_75),
// or the scalar float path (sm_70 and older: no fp16 MMA fragments worth the name there).
// __CUDA_ARCH__ on a device, sm_80's in the emulator; -DANDREA_HALF_ARCH=750 or 700 builds
// another arch's path (the emulator's tests of those paths, and nvcc 13, which has no sm_70
// target, compiling sm_70's path for sm_75).
#if defined(ANDREA_HALF_ARCH)
#define ANDREA_HALF_PATH ANDREA_HALF_ARCH
#elif defined(__CUDA_ARCH__)
#define ANDREA_HALF_PATH __CUDA_ARCH__
#else
#define ANDREA_HALF_PATH 800
#endif

template <typename T_> struct IsFloat { static constexpr bool value = false; };
template <> struct IsFloat<float> { static constexpr bool value = true; };
// Whether a 16-bit type's matmuls run as ldmatrix + mma.sync fragments (else the scalar path).
template <typename T_> struct UsesMma { static constexpr bool value = false; };
template <> struct UsesMma<bf16_t> { static constexpr bool value = true; };
template <> struct UsesMma<half_t> { static constexpr bool value = ANDREA_HALF_PATH >= 750; };

// ------------------------------------------------------------------------------- tile configs
// W warps per block (block owns M = 16*W rows), N rows per streamed tile. All shared memory is
// static and stays under the 48 KiB that needs no opt-in.
enum Kind { KIND_FWD = 0, KIND_DQ = 1, KIND_DKDV = 2 };

template <typename T_, int D, int K> struct TileCfg;
#define ANDREA_TILE(TYPE, D, FW, FN, QW, QN, KW, KN)                                            \
  template <> struct TileCfg<TYPE, D, KIND_FWD> { static constexpr int W = FW, N = FN; };      \
  template <> struct TileCfg<TYPE, D, KIND_DQ> { static constexpr int W = QW, N = QN; };       \
  template <> struct TileCfg<TYPE, D, KIND_DKDV> { static constexpr int W = KW, N = KN; };
ANDREA_TILE(bf16_t, 32, 4, 64, 4, 64, 4, 64)
ANDREA_TILE(bf16_t, 64, 4, 64, 4, 64, 4, 64)
ANDREA_TILE(bf16_t, 128, 4, 32, 4, 16, 4, 16)
ANDREA_TILE(half_t, 32, 4, 64, 4, 64, 4, 64)
ANDREA_TILE(half_t, 64, 4, 64, 4, 64, 4, 64)
ANDREA_TILE(half_t, 128, 4, 32, 4, 16, 4, 16)
ANDREA_TILE(float, 32, 4, 32, 4, 32, 4, 32)
ANDREA_TILE(float, 64, 4, 32, 2, 32, 2, 32)
ANDREA_TILE(float, 128, 2, 16, 1, 16, 1, 16)
#undef ANDREA_TILE

// Minimum resident blocks per SM promised to ptxas through __launch_bounds__; 0 makes no
// promise (an explicit 1 changes ptxas's register choices for the other instances). bf16 D=64
// dK/dV took 238 registers on sm_90, so only 2 blocks (8 warps) fitted in the register file
// although shared memory allows 6; with DkdvPasses below it needs 158-168, and 3 blocks cap it
// at 168 so it stays there (a spill instead fails tests/test_kernel_compile.py).
// Without a promise ptxas aims at the blocks that shared memory allows and may spill a word to
// get there. Under the options the runtime compiles with (CuPy adds -ftz=true) that happened
// twice, 4 bytes each: fp32 D=32 forward on sm_90 (64 registers for 8 blocks) and bf16 D=64 dQ
// on sm_80 (128 registers for 4 blocks). Promising 8 blocks gives the forward the same 64
// registers without the spill; promising 3 lets dQ keep 149-157 registers (3 blocks, as on
// sm_90 already) instead of spilling for a fourth on sm_80.
template <typename T_, int D, int K> struct MinBlocks { static constexpr int value = 0; };
template <> struct MinBlocks<bf16_t, 64, KIND_DKDV> { static constexpr int value = 3; };
template <> struct MinBlocks<bf16_t, 64, KIND_DQ> { static constexpr int value = 3; };
template <> struct MinBlocks<float, 32, KIND_FWD> { static constexpr int value = 8; };
// fp16 has bf16's tiles and fragments, so bf16's promises, for the same reasons, on sm_80+. On
// sm_75 (64 KiB of shared memory per SM) one block of 37 KiB fits anyway, and the promise of 3
// (168 registers) made dQ spill a word there.
template <> struct MinBlocks<half_t, 64, KIND_DKDV> {
  static constexpr int value = ANDREA_HALF_PATH >= 800 ? 3 : 0;
};
template <> struct MinBlocks<half_t, 64, KIND_DQ> {
  static constexpr int value = ANDREA_HALF_PATH >= 800 ? 3 : 0;
};
// fp16 D=32 dQ on sm_90 went to 96 registers for the 10 blocks shared memory allows and spilled
// 8 bytes (bf16's took 102); 4 blocks (128 registers) keep it whole. sm_75 needs 129 without
// a promise and fits 1024 / 128 = 8 blocks of threads anyway: none there.
template <> struct MinBlocks<half_t, 32, KIND_DQ> {
  static constexpr int value = ANDREA_HALF_PATH >= 800 ? 4 : 0;
};

// attn_bwd_dkdv takes a streamed tile's N query columns in this many passes: the score and dP
// fragments of a pass (2 x N/8 x 4 floats per lane when 1) are live beside both D-wide
// accumulators, and halving them is what lets bf16 D=64 fit 168 registers without spills.
template <typename T_, int D> struct DkdvPasses { static constexpr int value = 1; };
template <> struct DkdvPasses<bf16_t, 64> { static constexpr int value = 2; };
template <> struct DkdvPasses<half_t, 64> { static constexpr int value = 2; };

// Row stride in shared memory: D plus 16 bytes, so the 8 rows an ldmatrix reads fall in
// different banks, and every row start stays 16-byte aligned.
template <typename T_, int D> struct Ld { static constexpr int value = D + 16 / (int)sizeof(T_); };

// Warp-private scratch for the fp32 path's register -> shared A operand (a 16 x N tile per warp).
// The 16-bit types need none (fp16's scalar path takes P from the quad by shuffles), so their
// shared memory is the same on every arch.
template <typename T_, int W, int N> struct Scratch {
  static constexpr int LD = N + 4;
  static constexpr int size = IsFloat<T_>::value ? W * 16 * LD : 4;
};

// Shared memory of one block: the owned tile (rows a, optional second operand a2), the streamed
// tile (b, b2), per-row statistics of the streamed (dkdv) or owned (dq) rows, fp32 scratch.
template <typename T_, int D, int K> struct Smem {
  static constexpr int W = TileCfg<T_, D, K>::W, N = TileCfg<T_, D, K>::N, M = 16 * W;
  static constexpr int LD = Ld<T_, D>::value;
  static constexpr int A_TILES = K == KIND_FWD ? 1 : 2;
  static constexpr int STAT_ROWS = K == KIND_FWD ? 4 : (K == KIND_DQ ? M : N);
  alignas(16) T_ a[A_TILES][M * LD];
  alignas(16) T_ b[2][N * LD];
  alignas(16) float lse[STAT_ROWS];
  alignas(16) float delta[STAT_ROWS];
  alignas(16) float scratch[Scratch<T_, W, N>::size];
};

// ------------------------------------------------------------------------- warp collectives
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
// Portable exchange used by the non-PTX bodies: every lane gets every lane's value. The CPU
// emulator does it through its per-warp slots (one warp barrier); elsewhere word-wise shuffles.
template <typename V> __device__ __forceinline__ void warp_allgather(const V& mine, V (&all)[32]) {
#if defined(ANDREA_EMULATOR)
  andrea_emu::warp_allgather(&mine, all, sizeof(V));
#else
  const u32* w = (const u32*)&mine;
  for (int src = 0; src < 32; ++src)
    for (int i = 0; i < (int)(sizeof(V) / 4); ++i)
      ((u32*)&all[src])[i] = __shfl_sync(0xffffffffu, w[i], src);
#endif
}
#endif

#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750)
// ldmatrix_x4 below by the PTX layout, through the lanes' exchange. Not inlined, as mma_emulated.
template <bool TRANS> __device__ __noinline__ void ldmatrix_emulated(u32 (&r)[4], const void* row) {
  const unsigned char* rows[32];
  const unsigned char* mine = (const unsigned char*)row;
  warp_allgather(mine, rows);
  const int lane = threadIdx.x & 31;
  for (int i = 0; i < 4; ++i) {
    if (!TRANS) {
      const u16* p = (const u16*)rows[8 * i + lane / 4] + 2 * (lane % 4);
      r[i] = (u32)p[0] | ((u32)p[1] << 16);
    } else {
      const u16* lo = (const u16*)rows[8 * i + 2 * (lane % 4)] + lane / 4;
      const u16* hi = (const u16*)rows[8 * i + 2 * (lane % 4) + 1] + lane / 4;
      r[i] = (u32)lo[0] | ((u32)hi[0] << 16);
    }
  }
}
#endif

// ldmatrix.m8n8.x4.b16 (sm_75+): lanes 8i..8i+7 give the row addresses of 8x8 matrix i; lane l
// gets in r[i] row l/4, columns 2(l%4), 2(l%4)+1 of matrix i (TRANS: rows 2(l%4), 2(l%4)+1 of
// column l/4).
template <bool TRANS> __device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  u32 addr;
  asm volatile("{ .reg .u64 p; cvta.to.shared.u64 p, %1; cvt.u32.u64 %0, p; }"
               : "=r"(addr)
               : "l"(row));
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#else
  ldmatrix_emulated<TRANS>(r, row);
#endif
}

// The 16-bit element in the low (0) or high (1) half of a fragment register, as a float.
__device__ __forceinline__ float elem16(u32 r, int hi, bf16_t) {
  return __uint_as_float((hi ? r >> 16 : r & 0xffffu) << 16);
}
__device__ __forceinline__ float elem16(u32 r, int hi, half_t) {
  return half_to_float(hi ? r >> 16 : r & 0xffffu);
}

#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
// mma.sync.m16n8kK row.col with float accumulation, K = 8 or 16, by the PTX fragment layouts
// (g = lane/4, t = lane%4): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], and for K = 16 also
// a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]; b[0] = B[2t..2t+1][g] (K = 16: b[1] =
// B[2t+8..2t+9][g]); c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..]. Products in float are exact
// for 16-bit inputs; the sum runs over k in order. Not inlined: at every call site of the
// unrolled GEMMs it would triple the emulator's build time.
template <int K, typename T_>
__device__ __noinline__ void mma_emulated(float (&c)[4], const u32* a, const u32* b) {
  struct Frag {
    u32 a[K / 4];
    u32 b[K / 8];
  };
  Frag mine;
  for (int i = 0; i < K / 4; ++i) mine.a[i] = a[i];
  for (int i = 0; i < K / 8; ++i) mine.b[i] = b[i];
  Frag all[32];
  warp_allgather(mine, all);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float s = c[i];
    for (int k = 0; k < K; ++k) {
      const int kl = (k % 8) / 2, hi = k & 1;
      const u32 ar = all[(row % 8) * 4 + kl].a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
      const u32 br = all[col * 4 + kl].b[k >= 8 ? 1 : 0];
      s += elem16(ar, hi, T_{}) * elem16(br, hi, T_{});
    }
    c[i] = s;
  }
}
#endif

// mma.sync.m16n8k16 row.col bf16 -> f32: c += A (16x16) * B (16x8), fragments as above.
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1,
                                             bf16_t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  const u32 b[2] = {b0, b1};
  mma_emulated<16, bf16_t>(c, a, b);
#endif
}

// mma.sync.m16n8k8 row.col f16 -> f32 (sm_75+): c += A (16x8) * B (8x8).
__device__ __forceinline__ void mma_m16n8k8_f16(float (&c)[4], u32 a0, u32 a1, u32 b0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
#else
  const u32 a[2] = {a0, a1}, b[1] = {b0};
  mma_emulated<8, half_t>(c, a, b);
#endif
}

// c += A (16x16) * B (16x8) in fp16: one m16n8k16 on sm_80+; on sm_75 (ANDREA_HALF_PATH 750),
// which has only m16n8k8 for fp16, the k16 fragments split into two k8 steps: columns 0..7 of
// A are a[0], a[1] with b0, columns 8..15 are a[2], a[3] with b1.
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1,
                                             half_t) {
#if ANDREA_HALF_PATH >= 800 && defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif ANDREA_HALF_PATH >= 800
  const u32 b[2] = {b0, b1};
  mma_emulated<16, half_t>(c, a, b);
#else
  mma_m16n8k8_f16(c, a[0], a[1], b0);
  mma_m16n8k8_f16(c, a[2], a[3], b1);
#endif
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// -------------------------------------------------------------------------- warp-level GEMMs
// acc (16 x 8NT, C fragments) += A (16 x K, row-major in shared memory at a, stride lda) * B,
// B (K x 8NT) in shared memory: B_NMAJOR: element (k, n) at b[n*ldb + k] (a K or V tile used
// transposed); else at b[k*ldb + n]. NT even, K multiple of 16.
template <typename T_, int K, int NT, bool B_NMAJOR>
__device__ __forceinline__ void warp_gemm_ss(float (&acc)[NT][4], const T_* a, int lda, const T_* b,
                                             int ldb) {
  const int lane = threadIdx.x & 31;
  if constexpr (UsesMma<T_>::value) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      u32 af[4];
      ldmatrix_x4<false>(af, a + (lane % 16) * lda + kk * 16 + (lane / 16) * 8);
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        u32 bf[4];
        if (B_NMAJOR)
          ldmatrix_x4<false>(bf, b + (j * 16 + lane % 8 + (lane / 16) * 8) * ldb + kk * 16 +
                                     ((lane / 8) % 2) * 8);
        else
          ldmatrix_x4<true>(bf, b + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * ldb + j * 16 +
                                    (lane / 16) * 8);
        mma_m16n8k16(acc[2 * j], af, bf[0], bf[1], T_{});
        mma_m16n8k16(acc[2 * j + 1], af, bf[2], bf[3], T_{});
      }
    }
  } else {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll 2
    for (int k = 0; k < K; ++k) {
      const float a0 = to_float(a[g * lda + k]), a1 = to_float(a[(g + 8) * lda + k]);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int n = j * 8 + 2 * t;
        const float b0 = to_float(B_NMAJOR ? b[n * ldb + k] : b[k * ldb + n]);
        const float b1 = to_float(B_NMAJOR ? b[(n + 1) * ldb + k] : b[k * ldb + n + 1]);
        acc[j][0] += a0 * b0;
        acc[j][1] += a0 * b1;
        acc[j][2] += a1 * b0;
        acc[j][3] += a1 * b1;
      }
    }
  }
}

// acc (16 x 8NT) += P (16 x 8KT, C fragments in registers) * B (8KT x 8NT, element (k, n) at
// b[k*ldb + n]). bf16 and fp16 on tensor cores: P's C fragments are repacked into A fragments in
// registers (rounded to the element type). fp16 without them: the lanes of a quad hold a row of
// P between them, so each k's two values come by shuffles from the quad, kept in float. fp32: P
// goes through this warp's scratch tile (16 x (8KT+4) floats).
template <typename T_, int KT, int NT>
__device__ __forceinline__ void warp_gemm_rs(float (&acc)[NT][4], const float (&p)[KT][4],
                                             float* scratch, const T_* b, int ldb) {
  const int lane = threadIdx.x & 31;
  if constexpr (UsesMma<T_>::value) {
#pragma unroll
    for (int kk = 0; kk < KT / 2; ++kk) {
      u32 af[4];
      af[0] = pack2(p[2 * kk][0], p[2 * kk][1], T_{});
      af[1] = pack2(p[2 * kk][2], p[2 * kk][3], T_{});
      af[2] = pack2(p[2 * kk + 1][0], p[2 * kk + 1][1], T_{});
      af[3] = pack2(p[2 * kk + 1][2], p[2 * kk + 1][3], T_{});
#pragma unroll
      for (int j = 0; j < NT / 2; ++j) {
        u32 bf[4];
        ldmatrix_x4<true>(bf, b + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * ldb + j * 16 +
                                  (lane / 16) * 8);
        mma_m16n8k16(acc[2 * j], af, bf[0], bf[1], T_{});
        mma_m16n8k16(acc[2 * j + 1], af, bf[2], bf[3], T_{});
      }
    }
  } else if constexpr (!IsFloat<T_>::value) {
    const int t = lane & 3, quad = lane & ~3;
#pragma unroll
    for (int k = 0; k < 8 * KT; ++k) {
      // Lane 4g + (k%8)/2 holds P[g][k] in p[k/8][k%2] and P[g+8][k] in p[k/8][2 + k%2].
      const int src = quad | ((k % 8) / 2);
      const float a0 = __shfl_sync(0xffffffffu, p[k / 8][k & 1], src);
      const float a1 = __shfl_sync(0xffffffffu, p[k / 8][2 + (k & 1)], src);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int n = j * 8 + 2 * t;
        const float b0 = to_float(b[k * ldb + n]), b1 = to_float(b[k * ldb + n + 1]);
        acc[j][0] += a0 * b0;
        acc[j][1] += a0 * b1;
        acc[j][2] += a1 * b0;
        acc[j][3] += a1 * b1;
      }
    }
  } else {
    constexpr int LDS = 8 * KT + 4;
    const int g = lane >> 2, t = lane & 3;
    __syncwarp();  // the previous product has finished reading the scratch tile
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      scratch[g * LDS + j * 8 + 2 * t] = p[j][0];
      scratch[g * LDS + j * 8 + 2 * t + 1] = p[j][1];
      scratch[(g + 8) * LDS + j * 8 + 2 * t] = p[j][2];
      scratch[(g + 8) * LDS + j * 8 + 2 * t + 1] = p[j][3];
    }
    __syncwarp();  // scratch visible to the whole warp
    warp_gemm_ss<float, 8 * KT, NT, false>(acc, scratch, LDS, (const float*)b, ldb);
  }
}

// warp_gemm_ss's tensor-core path with B_NMAJOR and the A fragments already in registers
// (af[kk] = ldmatrix_x4 of A's columns 16kk..16kk+15): the same MMAs in the same order, so the
// same bits; the pipelined forward loads its Q fragments once instead of once per K tile.
template <typename T_, int K, int NT>
__device__ __forceinline__ void warp_gemm_as(float (&acc)[NT][4], const u32 (&af)[K / 16][4],
                                             const T_* b, int ldb) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
      u32 bf[4];
      ldmatrix_x4<false>(bf, b + (j * 16 + lane % 8 + (lane / 16) * 8) * ldb + kk * 16 +
                                 ((lane / 8) % 2) * 8);
      mma_m16n8k16(acc[2 * j], af[kk], bf[0], bf[1], T_{});
      mma_m16n8k16(acc[2 * j + 1], af[kk], bf[2], bf[3], T_{});
    }
}

// ---------------------------------------------------------------------------- tile movement
// Cooperative copy of ROWS rows (from row0) of a [seq_len, D] slice into shared memory with row
// stride LD, 16 bytes per step; rows at or past seq_len are zero-filled.
struct alignas(16) Chunk16 {
  u32 x, y, z, w;
};

template <typename T_, int D, int ROWS>
__device__ __forceinline__ void load_tile(T_* dst, const T_* src, int row0, int seq_len) {
  constexpr int LD = Ld<T_, D>::value;
  constexpr int PER_ROW = D * (int)sizeof(T_) / 16;
  for (int i = threadIdx.x; i < ROWS * PER_ROW; i += blockDim.x) {
    const int r = i / PER_ROW, c = i % PER_ROW;
    Chunk16 v = {0u, 0u, 0u, 0u};
    if (row0 + r < seq_len)  // bounds: rows past the sequence read as zeros
      v = ((const Chunk16*)(src + (long long)(row0 + r) * D))[c];
    ((Chunk16*)(dst + r * LD))[c] = v;
  }
}

// Per-row statistics of ROWS rows from row0; rows past seq_len get lse = +inf (so P = 0 there).
template <int ROWS>
__device__ __forceinline__ void load_stats(float* lse_s, float* delta_s, const float* lse,
                                           const float* delta, int row0, int seq_len) {
  for (int i = threadIdx.x; i < ROWS; i += blockDim.x) {
    const bool in = row0 + i < seq_len;  // bounds: rows past the sequence
    lse_s[i] = in ? lse[row0 + i] : inf_f();
    delta_s[i] = in ? delta[row0 + i] : 0.0f;
  }
}

// ------------------------------------------------------------------- asynchronous copies
// For the pipelined candidate kernels (attn_*_pipe below). Dynamic shared memory: the launch
// says how many bytes (cudaFuncAttributeMaxDynamicSharedMemorySize beyond 48 KiB); the
// emulator gives each block a buffer of exactly that size.
#if defined(ANDREA_EMULATOR)
#define ANDREA_DYNAMIC_SHARED(name) unsigned char* name = andrea_emu::dynamic_shared()
#else
#define ANDREA_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// cp.async (sm_80+): a BYTES (4 or 16) global -> shared copy that does not stall the thread;
// it is in shared memory only after the cp_async_wait<N> that completes its commit group (and,
// for other threads, after a barrier past that). Out of bounds (in false) lands zeros and
// reads nothing (src-size 0). Before sm_80 it is an ordinary copy, commit and wait no-ops. The
// emulator lands each copy only at its wait, so a missing wait shows there too.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool in) {
  static_assert(BYTES == 4 || BYTES == 16, "cp_async copies 4 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  u32 addr;
  asm volatile("{ .reg .u64 p; cvta.to.shared.u64 p, %1; cvt.u32.u64 %0, p; }"
               : "=r"(addr)
               : "l"(dst));
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(addr), "l"(src),
                 "r"(in ? 16 : 0)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(addr), "l"(src),
                 "r"(in ? 4 : 0)
                 : "memory");
#elif defined(ANDREA_EMULATOR)
  andrea_emu::cp_async(dst, src, BYTES, in ? BYTES : 0);
#else
  if constexpr (BYTES == 16)
    *(Chunk16*)dst = in ? *(const Chunk16*)src : Chunk16{0u, 0u, 0u, 0u};
  else
    *(u32*)dst = in ? *(const u32*)src : 0u;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#elif defined(ANDREA_EMULATOR)
  andrea_emu::cp_async_commit();
#endif
}

// Waits until at most PENDING of this thread's committed groups are still in flight.
template <int PENDING> __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#elif defined(ANDREA_EMULATOR)
  andrea_emu::cp_async_wait(PENDING);
#endif
}

// load_tile through cp.async: rows at or past seq_len land as zeros.
template <typename T_, int D, int ROWS>
__device__ __forceinline__ void load_tile_async(T_* dst, const T_* src, int row0, int seq_len) {
  constexpr int LD = Ld<T_, D>::value, PER_ROW = D * (int)sizeof(T_) / 16;
  constexpr int ELEMS = 16 / (int)sizeof(T_);
  for (int i = threadIdx.x; i < ROWS * PER_ROW; i += blockDim.x) {
    const int r = i / PER_ROW, c = i % PER_ROW;
    const bool in = row0 + r < seq_len;  // bounds: rows past the sequence land as zeros
    cp_async<16>(dst + r * LD + c * ELEMS, in ? src + (long long)(row0 + r) * D + c * ELEMS : src,
                 in);
  }
}

// load_stats through cp.async; rows past seq_len land as 0 (the callers mask those columns).
template <int ROWS>
__device__ __forceinline__ void load_stats_async(float* lse_s, float* delta_s, const float* lse,
                                                 const float* delta, int row0, int seq_len) {
  for (int i = threadIdx.x; i < ROWS; i += blockDim.x) {
    const bool in = row0 + i < seq_len;  // bounds: rows past the sequence
    cp_async<4>(lse_s + i, in ? lse + row0 + i : lse, in);
    cp_async<4>(delta_s + i, in ? delta + row0 + i : delta, in);
  }
}

// Dynamic shared memory of a pipelined kernel (byte offsets; andrea.cuda.launch's
// pipe_shared_bytes mirrors `bytes`): the owned tile(s) (M x LD each: Q, or Q and dO, or K and
// V), STAGES pairs of streamed tiles (N x LD each), statistics (dq: the owned rows' lse and
// delta; dkdv: each stage's streamed rows'), fp32's scratch tiles.
template <typename T_, int D, int K, int W, int N, int STAGES> struct PipeSmem {
  static constexpr int M = 16 * W, LD = Ld<T_, D>::value, TILE_N = N * LD;
  static constexpr int A_TILES = K == KIND_FWD ? 1 : 2;
  static constexpr int B = A_TILES * M * LD * (int)sizeof(T_);
  static constexpr int STATS = B + STAGES * 2 * N * LD * (int)sizeof(T_);
  static constexpr int STAT_FLOATS = K == KIND_FWD ? 0 : (K == KIND_DQ ? 2 * M : STAGES * 2 * N);
  static constexpr int SCRATCH = STATS + 4 * STAT_FLOATS;
  static constexpr int bytes = SCRATCH + (IsFloat<T_>::value ? 4 * W * 16 * (N + 4) : 0);
  static_assert(STAGES >= 1 && N % 16 == 0 && W >= 1, "a pipeline needs a stage, N of 16s");
};

// Two adjacent output elements as one aligned store: lane (g, t) of a C fragment holds columns
// 2t and 2t+1 of a row, so a pair is one 4-byte word (bf16) or one 8-byte float2, instead of
// two 2- or 4-byte stores. Plain C++: the emulator runs the same stores.
struct alignas(8) FloatPair {  // own float2: no CUDA vector-type headers in the emulator
  float lo, hi;
};
__device__ __forceinline__ void store_pair(float* dst, float lo, float hi) {
  *(FloatPair*)dst = FloatPair{lo, hi};
}
__device__ __forceinline__ void store_pair(bf16_t* dst, float lo, float hi) {
  *(u32*)dst = pack2(lo, hi, bf16_t{});
}
__device__ __forceinline__ void store_pair(half_t* dst, float lo, float hi) {
  *(u32*)dst = pack2(lo, hi, half_t{});
}

// Writes a warp's 16 x D accumulator (times mul) to rows row0.. of a [seq_len, D] slice. Every
// pair starts at an even column of a 16-byte aligned row, so each store is naturally aligned.
template <typename T_, int D>
__device__ __forceinline__ void store_rows(T_* dst, const float (&acc)[D / 8][4], int row0,
                                           int seq_len, float mul0, float mul1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row >= seq_len) continue;  // bounds: no rows past the sequence
    const float mul = h ? mul1 : mul0;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      store_pair(dst + (long long)row * D + j * 8 + 2 * t, acc[j][2 * h] * mul,
                 acc[j][2 * h + 1] * mul);
  }
}

#define ANDREA_LOG2E 1.4426950408889634f
#define ANDREA_LN2 0.6931471805599453f

// --------------------------------------------------------------------------------- forward
template <typename T_, int D>
__global__ void __launch_bounds__(32 * TileCfg<T_, D, KIND_FWD>::W,
                                  MinBlocks<T_, D, KIND_FWD>::value)
    attn_fwd(const T_* __restrict__ q, const T_* __restrict__ k, const T_* __restrict__ v,
             T_* __restrict__ o, float* __restrict__ lse, int seq_len, float scale) {
  using S = Smem<T_, D, KIND_FWD>;
  constexpr int M = S::M, N = S::N, LD = S::LD;
  __shared__ S sm;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Heaviest causal tiles (last queries) first: better tail balance across the grid.
  const int q0 = (gridDim.x - 1 - blockIdx.x) * M;
  const long long base = (long long)blockIdx.y * seq_len * D;
  const float sl2 = scale * ANDREA_LOG2E;  // scores in base-2 units: exp(x) = exp2(x*log2e)

  load_tile<T_, D, M>(sm.a[0], q + base, q0, seq_len);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m_run[2] = {-inf_f(), -inf_f()}, l_run[2] = {0.0f, 0.0f};
  const int row_base = q0 + warp * 16 + g;
  const int last = imin(q0 + M, seq_len) - 1;  // causal: no key past the block's last query

  for (int n0 = 0; n0 <= last; n0 += N) {
    __syncthreads();  // barrier:fwd-reuse (every warp is done with the previous K/V tile)
    load_tile<T_, D, N>(sm.b[0], k + base, n0, seq_len);
    load_tile<T_, D, N>(sm.b[1], v + base, n0, seq_len);
    __syncthreads();  // barrier:fwd-loaded (K/V tile visible to every warp)

    float s[N / 8][4];
#pragma unroll
    for (int j = 0; j < N / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    warp_gemm_ss<T_, D, N / 8, true>(s, sm.a[0] + warp * 16 * LD, LD, sm.b[0], LD);

    const bool masked = n0 + N - 1 > q0 || n0 + N > seq_len;
    float mx[2] = {-inf_f(), -inf_f()};
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row_base + (i >= 2 ? 8 : 0), col = n0 + j * 8 + 2 * t + (i & 1);
        float x = s[j][i] * sl2;
        if (masked && (col > row || col >= seq_len)) x = -inf_f();
        s[j][i] = x;
        mx[i >> 1] = fmaxf(mx[i >> 1], x);
      }
    float shift[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m_run[h], quad_max(mx[h]));
      shift[h] = m_new == -inf_f() ? 0.0f : m_new;  // a row with nothing visible yet
      const float corr = exp2f(m_run[h] - shift[h]);
      l_run[h] *= corr;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        acc[j][2 * h] *= corr;
        acc[j][2 * h + 1] *= corr;
      }
      m_run[h] = m_new;
    }
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = exp2f(s[j][i] - shift[i >> 1]);
        s[j][i] = p;
        l_run[i >> 1] += p;
      }
    warp_gemm_rs<T_, N / 8, D / 8>(acc, s, sm.scratch + warp * 16 * (N + 4), sm.b[1], LD);
  }

  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(l_run[h]);
    inv[h] = 1.0f / l;
    const int row = row_base + 8 * h;
    if (t == 0 && row < seq_len)  // bounds: no rows past the sequence
      lse[(long long)blockIdx.y * seq_len + row] = (m_run[h] + log2f(l)) * ANDREA_LN2;
  }
  store_rows<T_, D>(o + base, acc, q0 + warp * 16, seq_len, inv[0], inv[1]);
}

// ------------------------------------------------------------------------------- backward
// Dot product of two 16-byte chunks of a row (8 bf16 or fp16, or 4 floats), in float32.
__device__ __forceinline__ float dot_chunk(const Chunk16& a, const Chunk16& b, float) {
  return __uint_as_float(a.x) * __uint_as_float(b.x) + __uint_as_float(a.y) * __uint_as_float(b.y) +
         __uint_as_float(a.z) * __uint_as_float(b.z) + __uint_as_float(a.w) * __uint_as_float(b.w);
}
__device__ __forceinline__ float dot_bf16x2(u32 a, u32 b) {
  return __uint_as_float(a << 16) * __uint_as_float(b << 16) +
         __uint_as_float(a & 0xffff0000u) * __uint_as_float(b & 0xffff0000u);
}
__device__ __forceinline__ float dot_chunk(const Chunk16& a, const Chunk16& b, bf16_t) {
  return dot_bf16x2(a.x, b.x) + dot_bf16x2(a.y, b.y) + dot_bf16x2(a.z, b.z) +
         dot_bf16x2(a.w, b.w);
}
__device__ __forceinline__ float dot_half2(u32 a, u32 b) {
  return half_to_float(a & 0xffffu) * half_to_float(b & 0xffffu) +
         half_to_float(a >> 16) * half_to_float(b >> 16);
}
__device__ __forceinline__ float dot_chunk(const Chunk16& a, const Chunk16& b, half_t) {
  return dot_half2(a.x, b.x) + dot_half2(a.y, b.y) + dot_half2(a.z, b.z) + dot_half2(a.w, b.w);
}

// delta[r] = sum_d dout[r, d] * o[r, d]  (rowsum(dO o O)); a block covers 128 consecutive rows.
// Coalesced both ways: the C threads of a group read the C 16-byte chunks of one row side by
// side (a warp reads 32/C whole rows per load), the group's k-th load being row C*group + k of
// the block. Each thread so holds C partial sums, one per row, and a transpose-reduce across the
// group (C-1 shuffles) leaves thread c of the group with the sum of row C*group + c: consecutive
// threads write consecutive rows.
template <typename T_, int D>
__global__ void __launch_bounds__(128)
    attn_bwd_preprocess(const T_* __restrict__ o, const T_* __restrict__ dout,
                        float* __restrict__ delta, int rows) {
  constexpr int C = D * (int)sizeof(T_) / 16;  // 4..32 chunks per row, a power of two
  static_assert(C >= 1 && C <= 32 && (C & (C - 1)) == 0, "a row's chunks must fit a warp");
  const int c = threadIdx.x % C;
  const long long row0 = (long long)blockIdx.x * blockDim.x + threadIdx.x / C * C;
  float part[C];
#pragma unroll
  for (int k = 0; k < C; ++k) {
    part[k] = 0.0f;
    const long long r = row0 + k;
    if (r < rows)  // bounds: the last block's tail (no return: every lane joins the shuffles)
      part[k] = dot_chunk(((const Chunk16*)(o + r * D))[c], ((const Chunk16*)(dout + r * D))[c],
                          T_{});
  }
  // Halving steps: the lane whose bit `half` is set keeps the upper half of its partials and
  // sends the lower half to its partner, which keeps the lower half: after log2(C) steps one
  // partial is left, the whole group's sum for row offset c.
#pragma unroll
  for (int half = C / 2; half >= 1; half /= 2) {
    const bool upper = (c & half) != 0;
#pragma unroll
    for (int k = 0; k < half; ++k) {
      const float send = upper ? part[k] : part[k + half];
      const float keep = upper ? part[k + half] : part[k];
      part[k] = keep + __shfl_xor_sync(0xffffffffu, send, half);
    }
  }
  if (row0 + c < rows) delta[row0 + c] = part[0];  // bounds: the last block's tail
}

// dQ = scale * sum_j dS_ij K_j with dS = P o (dP - delta), P = exp(S*scale - lse), dP = dO V^T.
template <typename T_, int D>
__global__ void __launch_bounds__(32 * TileCfg<T_, D, KIND_DQ>::W,
                                  MinBlocks<T_, D, KIND_DQ>::value)
    attn_bwd_dq(const T_* __restrict__ q, const T_* __restrict__ k, const T_* __restrict__ v,
                const T_* __restrict__ dout, const float* __restrict__ lse,
                const float* __restrict__ delta, T_* __restrict__ dq, int seq_len, float scale) {
  using S = Smem<T_, D, KIND_DQ>;
  constexpr int M = S::M, N = S::N, LD = S::LD;
  __shared__ S sm;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * M;
  const long long base = (long long)blockIdx.y * seq_len * D;
  const long long sbase = (long long)blockIdx.y * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;

  load_tile<T_, D, M>(sm.a[0], q + base, q0, seq_len);
  load_tile<T_, D, M>(sm.a[1], dout + base, q0, seq_len);
  load_stats<M>(sm.lse, sm.delta, lse + sbase, delta + sbase, q0, seq_len);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const int rl = warp * 16 + g;  // this lane's first row within the block tile
  const int last = imin(q0 + M, seq_len) - 1;

  for (int n0 = 0; n0 <= last; n0 += N) {
    __syncthreads();  // barrier:dq-reuse
    load_tile<T_, D, N>(sm.b[0], k + base, n0, seq_len);
    load_tile<T_, D, N>(sm.b[1], v + base, n0, seq_len);
    __syncthreads();  // barrier:dq-loaded

    float s[N / 8][4], dp[N / 8][4];
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = dp[j][i] = 0.0f;
    warp_gemm_ss<T_, D, N / 8, true>(s, sm.a[0] + warp * 16 * LD, LD, sm.b[0], LD);
    warp_gemm_ss<T_, D, N / 8, true>(dp, sm.a[1] + warp * 16 * LD, LD, sm.b[1], LD);
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = rl + (i >= 2 ? 8 : 0);
        const int row = q0 + r, col = n0 + j * 8 + 2 * t + (i & 1);
        const bool visible = col <= row && col < seq_len;
        const float p = visible ? exp2f(s[j][i] * sl2 - sm.lse[r] * ANDREA_LOG2E) : 0.0f;
        s[j][i] = p * (dp[j][i] - sm.delta[r]);
      }
    warp_gemm_rs<T_, N / 8, D / 8>(acc, s, sm.scratch + warp * 16 * (N + 4), sm.b[0], LD);
  }
  store_rows<T_, D>(dq + base, acc, q0 + warp * 16, seq_len, scale, scale);
}

// dK = scale * sum_i dS_ij Q_i, dV = sum_i P_ij dO_i: a block owns key rows and streams the
// query tiles at or after its first key (earlier queries see none of its keys).
template <typename T_, int D>
__global__ void __launch_bounds__(32 * TileCfg<T_, D, KIND_DKDV>::W,
                                  MinBlocks<T_, D, KIND_DKDV>::value)
    attn_bwd_dkdv(const T_* __restrict__ q, const T_* __restrict__ k, const T_* __restrict__ v,
                  const T_* __restrict__ dout, const float* __restrict__ lse,
                  const float* __restrict__ delta, T_* __restrict__ dk, T_* __restrict__ dv,
                  int seq_len, float scale) {
  using S = Smem<T_, D, KIND_DKDV>;
  constexpr int M = S::M, N = S::N, LD = S::LD, NP = N / DkdvPasses<T_, D>::value;
  __shared__ S sm;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k0 = blockIdx.x * M;  // low key tiles see the most queries: they start first
  const long long base = (long long)blockIdx.y * seq_len * D;
  const long long sbase = (long long)blockIdx.y * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;

  load_tile<T_, D, M>(sm.a[0], k + base, k0, seq_len);
  load_tile<T_, D, M>(sm.a[1], v + base, k0, seq_len);
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk_acc[j][i] = dv_acc[j][i] = 0.0f;
  const int key_base = k0 + warp * 16 + g;
  float* scratch = sm.scratch + warp * 16 * (N + 4);

  for (int n0 = (k0 / N) * N; n0 < seq_len; n0 += N) {
    __syncthreads();  // barrier:dkdv-reuse
    load_tile<T_, D, N>(sm.b[0], q + base, n0, seq_len);
    load_tile<T_, D, N>(sm.b[1], dout + base, n0, seq_len);
    load_stats<N>(sm.lse, sm.delta, lse + sbase, delta + sbase, n0, seq_len);
    __syncthreads();  // barrier:dkdv-loaded

    // Transposed scores: rows are this warp's keys, columns the tile's queries, NP query
    // columns per pass (see DkdvPasses).
    for (int c0 = 0; c0 < N; c0 += NP) {
      float st[NP / 8][4], dpt[NP / 8][4];
#pragma unroll
      for (int j = 0; j < NP / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) st[j][i] = dpt[j][i] = 0.0f;
      warp_gemm_ss<T_, D, NP / 8, true>(st, sm.a[0] + warp * 16 * LD, LD, sm.b[0] + c0 * LD, LD);
      warp_gemm_ss<T_, D, NP / 8, true>(dpt, sm.a[1] + warp * 16 * LD, LD, sm.b[1] + c0 * LD,
                                         LD);
#pragma unroll
      for (int j = 0; j < NP / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = key_base + (i >= 2 ? 8 : 0);
          const int c = c0 + j * 8 + 2 * t + (i & 1), col = n0 + c;
          const bool visible = key <= col && col < seq_len;
          const float p = visible ? exp2f(st[j][i] * sl2 - sm.lse[c] * ANDREA_LOG2E) : 0.0f;
          st[j][i] = p;
          dpt[j][i] = p * (dpt[j][i] - sm.delta[c]);
        }
      warp_gemm_rs<T_, NP / 8, D / 8>(dv_acc, st, scratch, sm.b[1] + c0 * LD, LD);
      warp_gemm_rs<T_, NP / 8, D / 8>(dk_acc, dpt, scratch, sm.b[0] + c0 * LD, LD);
    }
  }
  store_rows<T_, D>(dk + base, dk_acc, k0 + warp * 16, seq_len, scale, scale);
  store_rows<T_, D>(dv + base, dv_acc, k0 + warp * 16, seq_len, 1.0f, 1.0f);
}

// ------------------------------------------------------------------- pipelined candidates
// attn_fwd_pipe, attn_bwd_dq_pipe, attn_bwd_dkdv_pipe: the kernels above with the tile shape as
// template parameters (W warps, N streamed rows), dynamic shared memory (PipeSmem), MINB for
// __launch_bounds__ and a STAGES-deep cp.async pipeline over the streamed tiles: with
// STAGES >= 2 tile it+STAGES-1 loads while tile it multiplies, one barrier per tile; STAGES 1
// is the synchronous load between two barriers of the kernels above. Per output row the
// arithmetic is the kernels above's for the same N (W and STAGES change only who owns a row and
// when a tile arrives), so with N equal they give the same bits. Launch: as the kernel above,
// with M = 16*W, 32*W threads and PipeSmem::bytes of dynamic shared memory
// (andrea.cuda.launch.pipe_launch). The forward keeps its warp's Q fragments in registers on
// tensor cores (loaded once, not once per K tile). Candidates for
// scripts/gpu_tune_attention.py; the production path launches the kernels above.
template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_fwd_pipe(const T_* __restrict__ q, const T_* __restrict__ k, const T_* __restrict__ v,
                  T_* __restrict__ o, float* __restrict__ lse, int seq_len, float scale) {
  using L = PipeSmem<T_, D, KIND_FWD, W, N, STAGES>;
  constexpr int M = L::M, LD = L::LD;
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const qs = (T_*)smem;
  T_* const kv = (T_*)(smem + L::B);  // stage s: K at kv + 2s*TILE_N, V after it
  float* const scratch = (float*)(smem + L::SCRATCH) + (threadIdx.x / 32) * 16 * (N + 4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * M;  // heaviest causal tiles first
  const long long base = (long long)blockIdx.y * seq_len * D;
  const float sl2 = scale * ANDREA_LOG2E;
  const int row_base = q0 + warp * 16 + g;
  const int last = imin(q0 + M, seq_len) - 1;
  const int n_tiles = last / N + 1;

  load_tile_async<T_, D, M>(qs, q + base, q0, seq_len);  // joins the first group
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_tiles) {
      load_tile_async<T_, D, N>(kv + 2 * s * L::TILE_N, k + base, s * N, seq_len);
      load_tile_async<T_, D, N>(kv + (2 * s + 1) * L::TILE_N, v + base, s * N, seq_len);
    }
    cp_async_commit();  // even when empty: group i always holds tile i
  }
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m_run[2] = {-inf_f(), -inf_f()}, l_run[2] = {0.0f, 0.0f};
  constexpr bool MMA = UsesMma<T_>::value;
  u32 qf[MMA ? D / 16 : 1][4];  // this warp's Q rows as A fragments, once Q has landed

  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = it * N;
    const T_* ks = kv + 2 * (it % STAGES) * L::TILE_N;
    const T_* vs = ks + L::TILE_N;
    if constexpr (STAGES == 1) {
      __syncthreads();  // barrier:fwd-pipe-reuse
      load_tile_async<T_, D, N>(kv, k + base, n0, seq_len);
      load_tile_async<T_, D, N>(kv + L::TILE_N, v + base, n0, seq_len);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();  // barrier:fwd-pipe-loaded
    } else {
      cp_async_wait<STAGES - 2>();  // this thread's copies of tile it have landed
      __syncthreads();  // barrier:fwd-pipe (everyone's have; everyone is done with tile it-1)
      const int nx = it + STAGES - 1;
      if (nx < n_tiles) {  // into the stage tile it-1 used
        T_* dst = kv + 2 * (nx % STAGES) * L::TILE_N;
        load_tile_async<T_, D, N>(dst, k + base, nx * N, seq_len);
        load_tile_async<T_, D, N>(dst + L::TILE_N, v + base, nx * N, seq_len);
      }
      cp_async_commit();
    }

    float s[N / 8][4];
#pragma unroll
    for (int j = 0; j < N / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    if constexpr (MMA) {
      if (it == 0)  // Q came with tile 0's group; the barrier above made it visible
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          ldmatrix_x4<false>(qf[kk], qs + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
      warp_gemm_as<T_, D, N / 8>(s, qf, ks, LD);
    } else {
      warp_gemm_ss<T_, D, N / 8, true>(s, qs + warp * 16 * LD, LD, ks, LD);
    }

    const bool masked = n0 + N - 1 > q0 || n0 + N > seq_len;
    float mx[2] = {-inf_f(), -inf_f()};
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row_base + (i >= 2 ? 8 : 0), col = n0 + j * 8 + 2 * t + (i & 1);
        float x = s[j][i] * sl2;
        if (masked && (col > row || col >= seq_len)) x = -inf_f();
        s[j][i] = x;
        mx[i >> 1] = fmaxf(mx[i >> 1], x);
      }
    float shift[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m_run[h], quad_max(mx[h]));
      shift[h] = m_new == -inf_f() ? 0.0f : m_new;
      const float corr = exp2f(m_run[h] - shift[h]);
      l_run[h] *= corr;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        acc[j][2 * h] *= corr;
        acc[j][2 * h + 1] *= corr;
      }
      m_run[h] = m_new;
    }
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = exp2f(s[j][i] - shift[i >> 1]);
        s[j][i] = p;
        l_run[i >> 1] += p;
      }
    warp_gemm_rs<T_, N / 8, D / 8>(acc, s, scratch, vs, LD);
  }
  cp_async_wait<0>();  // nothing left in flight when the block ends (only empty groups)

  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(l_run[h]);
    inv[h] = 1.0f / l;
    const int row = row_base + 8 * h;
    if (t == 0 && row < seq_len)  // bounds: no rows past the sequence
      lse[(long long)blockIdx.y * seq_len + row] = (m_run[h] + log2f(l)) * ANDREA_LN2;
  }
  store_rows<T_, D>(o + base, acc, q0 + warp * 16, seq_len, inv[0], inv[1]);
}

template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dq_pipe(const T_* __restrict__ q, const T_* __restrict__ k,
                     const T_* __restrict__ v, const T_* __restrict__ dout,
                     const float* __restrict__ lse, const float* __restrict__ delta,
                     T_* __restrict__ dq, int seq_len, float scale) {
  using L = PipeSmem<T_, D, KIND_DQ, W, N, STAGES>;
  constexpr int M = L::M, LD = L::LD;
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const qs = (T_*)smem;
  T_* const dos = qs + M * LD;
  T_* const kv = (T_*)(smem + L::B);
  float* const lse_s = (float*)(smem + L::STATS);
  float* const delta_s = lse_s + M;
  float* const scratch = (float*)(smem + L::SCRATCH) + (threadIdx.x / 32) * 16 * (N + 4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * M;
  const long long base = (long long)blockIdx.y * seq_len * D;
  const long long sbase = (long long)blockIdx.y * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  const int rl = warp * 16 + g;
  const int last = imin(q0 + M, seq_len) - 1;
  const int n_tiles = last / N + 1;

  load_tile_async<T_, D, M>(qs, q + base, q0, seq_len);
  load_tile_async<T_, D, M>(dos, dout + base, q0, seq_len);
  load_stats<M>(lse_s, delta_s, lse + sbase, delta + sbase, q0, seq_len);  // seen past a barrier
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_tiles) {
      load_tile_async<T_, D, N>(kv + 2 * s * L::TILE_N, k + base, s * N, seq_len);
      load_tile_async<T_, D, N>(kv + (2 * s + 1) * L::TILE_N, v + base, s * N, seq_len);
    }
    cp_async_commit();
  }
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = it * N;
    const T_* ks = kv + 2 * (it % STAGES) * L::TILE_N;
    const T_* vs = ks + L::TILE_N;
    if constexpr (STAGES == 1) {
      __syncthreads();  // barrier:dq-pipe-reuse
      load_tile_async<T_, D, N>(kv, k + base, n0, seq_len);
      load_tile_async<T_, D, N>(kv + L::TILE_N, v + base, n0, seq_len);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();  // barrier:dq-pipe-loaded
    } else {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // barrier:dq-pipe
      const int nx = it + STAGES - 1;
      if (nx < n_tiles) {
        T_* dst = kv + 2 * (nx % STAGES) * L::TILE_N;
        load_tile_async<T_, D, N>(dst, k + base, nx * N, seq_len);
        load_tile_async<T_, D, N>(dst + L::TILE_N, v + base, nx * N, seq_len);
      }
      cp_async_commit();
    }

    float s[N / 8][4], dp[N / 8][4];
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = dp[j][i] = 0.0f;
    warp_gemm_ss<T_, D, N / 8, true>(s, qs + warp * 16 * LD, LD, ks, LD);
    warp_gemm_ss<T_, D, N / 8, true>(dp, dos + warp * 16 * LD, LD, vs, LD);
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = rl + (i >= 2 ? 8 : 0);
        const int row = q0 + r, col = n0 + j * 8 + 2 * t + (i & 1);
        const bool visible = col <= row && col < seq_len;
        const float p = visible ? exp2f(s[j][i] * sl2 - lse_s[r] * ANDREA_LOG2E) : 0.0f;
        s[j][i] = p * (dp[j][i] - delta_s[r]);
      }
    warp_gemm_rs<T_, N / 8, D / 8>(acc, s, scratch, ks, LD);
  }
  cp_async_wait<0>();
  store_rows<T_, D>(dq + base, acc, q0 + warp * 16, seq_len, scale, scale);
}

template <typename T_, int D, int W, int N, int STAGES, int MINB, int PASSES>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dkdv_pipe(const T_* __restrict__ q, const T_* __restrict__ k,
                       const T_* __restrict__ v, const T_* __restrict__ dout,
                       const float* __restrict__ lse, const float* __restrict__ delta,
                       T_* __restrict__ dk, T_* __restrict__ dv, int seq_len, float scale) {
  using L = PipeSmem<T_, D, KIND_DKDV, W, N, STAGES>;
  constexpr int M = L::M, LD = L::LD, NP = N / PASSES;
  static_assert(N % PASSES == 0 && NP % 16 == 0, "each pass takes a multiple of 16 columns");
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const ks = (T_*)smem;
  T_* const vs = ks + M * LD;
  T_* const qd = (T_*)(smem + L::B);  // stage s: Q at qd + 2s*TILE_N, dO after it
  float* const stats = (float*)(smem + L::STATS);  // stage s: lse at stats + 2sN, delta after
  float* const scratch = (float*)(smem + L::SCRATCH) + (threadIdx.x / 32) * 16 * (N + 4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k0 = blockIdx.x * M;
  const long long base = (long long)blockIdx.y * seq_len * D;
  const long long sbase = (long long)blockIdx.y * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  const int first = k0 / N;  // query tiles before it see none of these keys
  const int n_tiles = (seq_len + N - 1) / N - first;

  load_tile_async<T_, D, M>(ks, k + base, k0, seq_len);
  load_tile_async<T_, D, M>(vs, v + base, k0, seq_len);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_tiles) {
      const int n0 = (first + s) * N;
      load_tile_async<T_, D, N>(qd + 2 * s * L::TILE_N, q + base, n0, seq_len);
      load_tile_async<T_, D, N>(qd + (2 * s + 1) * L::TILE_N, dout + base, n0, seq_len);
      load_stats_async<N>(stats + 2 * s * N, stats + (2 * s + 1) * N, lse + sbase,
                          delta + sbase, n0, seq_len);
    }
    cp_async_commit();
  }
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk_acc[j][i] = dv_acc[j][i] = 0.0f;
  const int key_base = k0 + warp * 16 + g;

  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = (first + it) * N;
    const int stage = it % STAGES;
    const T_* qs = qd + 2 * stage * L::TILE_N;
    const T_* dos = qs + L::TILE_N;
    const float* lse_s = stats + 2 * stage * N;
    const float* delta_s = lse_s + N;
    if constexpr (STAGES == 1) {
      __syncthreads();  // barrier:dkdv-pipe-reuse
      load_tile_async<T_, D, N>(qd, q + base, n0, seq_len);
      load_tile_async<T_, D, N>(qd + L::TILE_N, dout + base, n0, seq_len);
      load_stats_async<N>(stats, stats + N, lse + sbase, delta + sbase, n0, seq_len);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();  // barrier:dkdv-pipe-loaded
    } else {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // barrier:dkdv-pipe
      const int nx = it + STAGES - 1;
      if (nx < n_tiles) {
        const int s = nx % STAGES, nn = (first + nx) * N;
        load_tile_async<T_, D, N>(qd + 2 * s * L::TILE_N, q + base, nn, seq_len);
        load_tile_async<T_, D, N>(qd + (2 * s + 1) * L::TILE_N, dout + base, nn, seq_len);
        load_stats_async<N>(stats + 2 * s * N, stats + (2 * s + 1) * N, lse + sbase,
                            delta + sbase, nn, seq_len);
      }
      cp_async_commit();
    }

    for (int c0 = 0; c0 < N; c0 += NP) {
      float st[NP / 8][4], dpt[NP / 8][4];
#pragma unroll
      for (int j = 0; j < NP / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) st[j][i] = dpt[j][i] = 0.0f;
      warp_gemm_ss<T_, D, NP / 8, true>(st, ks + warp * 16 * LD, LD, qs + c0 * LD, LD);
      warp_gemm_ss<T_, D, NP / 8, true>(dpt, vs + warp * 16 * LD, LD, dos + c0 * LD, LD);
#pragma unroll
      for (int j = 0; j < NP / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = key_base + (i >= 2 ? 8 : 0);
          const int c = c0 + j * 8 + 2 * t + (i & 1), col = n0 + c;
          const bool visible = key <= col && col < seq_len;  // masks the zero-filled stats
          const float p = visible ? exp2f(st[j][i] * sl2 - lse_s[c] * ANDREA_LOG2E) : 0.0f;
          st[j][i] = p;
          dpt[j][i] = p * (dpt[j][i] - delta_s[c]);
        }
      warp_gemm_rs<T_, NP / 8, D / 8>(dv_acc, st, scratch, dos + c0 * LD, LD);
      warp_gemm_rs<T_, NP / 8, D / 8>(dk_acc, dpt, scratch, qs + c0 * LD, LD);
    }
  }
  cp_async_wait<0>();
  store_rows<T_, D>(dk + base, dk_acc, k0 + warp * 16, seq_len, scale, scale);
  store_rows<T_, D>(dv + base, dv_acc, k0 + warp * 16, seq_len, 1.0f, 1.0f);
}

// ------------------------------------------------------------------------- naive baseline
// The reference point of the speed goal ("at least 10x a naive one-block-per-(batch, head)
// kernel"), not used for training: one block per (batch, head), its threads loop over rows,
// operands read straight from global memory, float FMAs, no tensor cores, no shared memory.
// Numerically the same algorithm (float32 online softmax; backward recomputes P from the lse,
// delta from attn_bwd_preprocess); one thread writes each output row, so no atomics.
// Only the accumulator row lives in registers (fully unrolled); the dot products run as
// partially unrolled loops over global memory so no D-wide operand row is kept in registers
// (D=128 would spill otherwise).
#define ANDREA_NAIVE_THREADS 128

template <typename T_>
__device__ __forceinline__ float dot_row(const T_* __restrict__ a, const T_* __restrict__ b,
                                         int d_len) {
  float s = 0.0f;
#pragma unroll 8
  for (int d = 0; d < d_len; ++d) s += to_float(a[d]) * to_float(b[d]);
  return s;
}

template <typename T_, int D>
__global__ void __launch_bounds__(ANDREA_NAIVE_THREADS)
    attn_fwd_naive(const T_* __restrict__ q, const T_* __restrict__ k, const T_* __restrict__ v,
                   T_* __restrict__ o, float* __restrict__ lse, int seq_len, float scale) {
  const long long base = (long long)blockIdx.x * seq_len * D;
  const long long sbase = (long long)blockIdx.x * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  for (int i = threadIdx.x; i < seq_len; i += blockDim.x) {  // bounds: rows of the sequence
    const T_* qi = q + base + (long long)i * D;
    float acc[D];
#pragma unroll
    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
    float m = -inf_f(), l = 0.0f;
    for (int j = 0; j <= i; ++j) {  // causal: keys 0..i
      const float s = dot_row<T_>(qi, k + base + (long long)j * D, D) * sl2;
      const float m_new = fmaxf(m, s);  // finite: key i is always visible
      const float corr = exp2f(m - m_new), p = exp2f(s - m_new);
      l = l * corr + p;
      const T_* vj = v + base + (long long)j * D;
#pragma unroll
      for (int d = 0; d < D; ++d) acc[d] = acc[d] * corr + p * to_float(vj[d]);
      m = m_new;
    }
    const float inv = 1.0f / l;
    T_* oi = o + base + (long long)i * D;
#pragma unroll
    for (int d = 0; d < D; ++d) oi[d] = from_float<T_>(acc[d] * inv);
    lse[sbase + i] = (m + log2f(l)) * ANDREA_LN2;
  }
}

// dQ_i = scale * sum_{j<=i} P_ij (dO_i . V_j - delta_i) K_j, one thread per query row.
template <typename T_, int D>
__global__ void __launch_bounds__(ANDREA_NAIVE_THREADS)
    attn_bwd_dq_naive(const T_* __restrict__ q, const T_* __restrict__ k,
                      const T_* __restrict__ v, const T_* __restrict__ dout,
                      const float* __restrict__ lse, const float* __restrict__ delta,
                      T_* __restrict__ dq, int seq_len, float scale) {
  const long long base = (long long)blockIdx.x * seq_len * D;
  const long long sbase = (long long)blockIdx.x * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  for (int i = threadIdx.x; i < seq_len; i += blockDim.x) {  // bounds: rows of the sequence
    const T_* qi = q + base + (long long)i * D;
    const T_* doi = dout + base + (long long)i * D;
    const float lse2 = lse[sbase + i] * ANDREA_LOG2E, di = delta[sbase + i];
    float acc[D];
#pragma unroll
    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int j = 0; j <= i; ++j) {
      const T_* kj = k + base + (long long)j * D;
      const float p = exp2f(dot_row<T_>(qi, kj, D) * sl2 - lse2);
      const float ds = p * (dot_row<T_>(doi, v + base + (long long)j * D, D) - di);
#pragma unroll
      for (int d = 0; d < D; ++d) acc[d] += ds * to_float(kj[d]);
    }
    T_* dqi = dq + base + (long long)i * D;
#pragma unroll
    for (int d = 0; d < D; ++d) dqi[d] = from_float<T_>(acc[d] * scale);
  }
}

// dV_j = sum_{i>=j} P_ij dO_i, then dK_j = scale * sum_{i>=j} P_ij (dO_i . V_j - delta_i) Q_i;
// one thread per key row, two passes so one D-wide accumulator suffices.
template <typename T_, int D>
__global__ void __launch_bounds__(ANDREA_NAIVE_THREADS)
    attn_bwd_dkdv_naive(const T_* __restrict__ q, const T_* __restrict__ k,
                        const T_* __restrict__ v, const T_* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        T_* __restrict__ dk, T_* __restrict__ dv, int seq_len, float scale) {
  const long long base = (long long)blockIdx.x * seq_len * D;
  const long long sbase = (long long)blockIdx.x * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {  // bounds: rows of the sequence
    const T_* kj = k + base + (long long)j * D;
    const T_* vj = v + base + (long long)j * D;
    float acc[D];
#pragma unroll
    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int i = j; i < seq_len; ++i) {  // causal: queries j..T-1 see key j
      const float p =
          exp2f(dot_row<T_>(q + base + (long long)i * D, kj, D) * sl2 - lse[sbase + i] *
                ANDREA_LOG2E);
      const T_* doi = dout + base + (long long)i * D;
#pragma unroll
      for (int d = 0; d < D; ++d) acc[d] += p * to_float(doi[d]);
    }
    T_* dvj = dv + base + (long long)j * D;
#pragma unroll
    for (int d = 0; d < D; ++d) {
      dvj[d] = from_float<T_>(acc[d]);
      acc[d] = 0.0f;
    }
    for (int i = j; i < seq_len; ++i) {
      const T_* qi = q + base + (long long)i * D;
      const float p = exp2f(dot_row<T_>(qi, kj, D) * sl2 - lse[sbase + i] * ANDREA_LOG2E);
      const float ds = p * (dot_row<T_>(dout + base + (long long)i * D, vj, D) - delta[sbase + i]);
#pragma unroll
      for (int d = 0; d < D; ++d) acc[d] += ds * to_float(qi[d]);
    }
    T_* dkj = dk + base + (long long)j * D;
#pragma unroll
    for (int d = 0; d < D; ++d) dkj[d] = from_float<T_>(acc[d] * scale);
  }
}

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
