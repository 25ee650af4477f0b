// attn_common.cuh - what every attention kernel of microgpt_cuda.cu builds on: element types
// and their conversions, the warp-level tensor-core steps (ldmatrix, mma.sync) and GEMMs, tile
// loads (synchronous and cp.async), output stores. Part of microgpt_cuda.cu, which includes it
// first; includes nothing itself.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

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
// Every probability and dS tile is packed here before its product, so on sm_80+ it is one cvt
// for the pair: the integer forms above cost 5 (bf16) and 12 or more (fp16) instructions a value,
// as many as the tile products' own issue slots. The bits are the integer forms' for every
// value but NaN (the cvt's NaN is canonical, still a NaN): both round to nearest even, overflow
// to inf, and keep fp32 subnormals (no .ftz in the asm, whatever -ftz the module is built with).
__device__ __forceinline__ u32 pack2(float lo, float hi, bf16_t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (u32)bf16_bits(lo) | ((u32)bf16_bits(hi) << 16);
#endif
}
__device__ __forceinline__ u32 pack2(float lo, float hi, half_t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (u32)half_bits(lo) | ((u32)half_bits(hi) << 16);
#endif
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

// The three tiled kernels of a family (forward, dQ, dK/dV): what a tile table or a shared-memory
// layout is for.
enum Kind { KIND_FWD = 0, KIND_DQ = 1, KIND_DKDV = 2, KIND_DQ_DS = 3, KIND_DKDV_DQ = 4 };

// Row stride in shared memory: D plus 16 bytes, so the 8 rows an ldmatrix reads fall in
// different banks, and every row start stays 16-byte aligned.
template <typename T_, int D> struct Ld { static constexpr int value = D + 16 / (int)sizeof(T_); };

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
// The block's THREADS threads (32 W: every kernel knows its warps when it is compiled) share a
// copy of CHUNKS 16-byte chunks, chunk i to thread i % THREADS, as a loop of a known count that
// unrolls: a thread's place is computed once, each copy after it is an offset. With the count
// known only at run time (blockDim.x) every copy repeated the index arithmetic, about 30
// instructions, a sixth of a tile's in the pipelined forward. The emulator says so where a
// kernel runs with another block size.
template <int THREADS> __device__ __forceinline__ void check_block_threads() {
#if defined(ANDREA_EMULATOR)
  if ((int)blockDim.x != THREADS) andrea_emu::die("a tile copy for another block size");
#endif
}

// Cooperative copy of ROWS rows (from row0) of a [seq_len, D] slice into shared memory with row
// stride LD, 16 bytes per step; rows at or past seq_len are zero-filled.
struct alignas(16) Chunk16 {
  u32 x, y, z, w;
};

template <typename T_, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(T_* dst, const T_* src, int row0, int seq_len) {
  constexpr int LD = Ld<T_, D>::value;
  constexpr int PER_ROW = D * (int)sizeof(T_) / 16;
  static_assert(THREADS % PER_ROW == 0, "a thread keeps its column of chunks");
  constexpr int STEP = THREADS / PER_ROW;  // rows between a thread's chunks
  check_block_threads<THREADS>();
  const int r0 = threadIdx.x / PER_ROW, c = threadIdx.x % PER_ROW;
#pragma unroll
  for (int i = 0; i < (ROWS + STEP - 1) / STEP; ++i) {
    const int r = r0 + i * STEP;
    if (ROWS % STEP != 0 && r >= ROWS) break;
    Chunk16 v = {0u, 0u, 0u, 0u};
    if (row0 + r < seq_len)  // bounds: rows past the sequence read as zeros
      v = ((const Chunk16*)(src + (long long)(row0 + r) * D))[c];
    ((Chunk16*)(dst + r * LD))[c] = v;
  }
}

// Per-row statistics of ROWS rows from row0; rows past seq_len get lse = +inf (so P = 0 there).
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_stats(float* lse_s, float* delta_s, const float* lse,
                                           const float* delta, int row0, int seq_len) {
  check_block_threads<THREADS>();
#pragma unroll
  for (int k = 0; k < (ROWS + THREADS - 1) / THREADS; ++k) {
    const int i = threadIdx.x + k * THREADS;
    if (ROWS % THREADS != 0 && i >= ROWS) break;
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
  const u32 addr = (u32)__cvta_generic_to_shared(dst);
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

// The sm_90a path (attn_hopper.cuh) compiles its PTX only where the target has it; elsewhere
// its kernels are empty and never launched (andrea.cuda.launch builds them for sm_90a alone).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ANDREA_WGMMA 1
#endif

// fence.proxy.async.shared::cta (sm_90): this thread's earlier shared-memory writes (generic
// proxy: stores, landed cp.async) become visible to the async proxy wgmma reads through. The
// emulator has one proxy: nothing to do there.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(ANDREA_WGMMA)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// ROWS x COLS elements from (row0, col0) of a row-major matrix with row stride `stride` into
// shared memory with row stride LDD, through cp.async; rows at or past `rows` land as zeros.
template <typename T_, int ROWS, int COLS, int LDD, int THREADS>
__device__ __forceinline__ void load_block_async(T_* dst, const T_* src, int stride, int row0,
                                                 int col0, int rows) {
  constexpr int ELEMS = 16 / (int)sizeof(T_), PER_ROW = COLS / ELEMS;
  static_assert(THREADS % PER_ROW == 0, "a thread keeps its column of chunks");
  constexpr int STEP = THREADS / PER_ROW;  // rows between a thread's chunks
  check_block_threads<THREADS>();
  const int r0 = threadIdx.x / PER_ROW, c = (threadIdx.x % PER_ROW) * ELEMS;
  T_* const d = dst + r0 * LDD + c;
  const T_* const s = src + (long long)(row0 + r0) * stride + col0 + c;
#pragma unroll
  for (int i = 0; i < (ROWS + STEP - 1) / STEP; ++i) {
    const int r = r0 + i * STEP;
    if (ROWS % STEP != 0 && r >= ROWS) break;
    const bool in = row0 + r < rows;  // bounds: rows past the matrix land as zeros
    cp_async<16>(d + i * STEP * LDD, in ? s + (long long)i * STEP * stride : src, in);
  }
}

// load_tile through cp.async: rows at or past seq_len land as zeros.
template <typename T_, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(T_* dst, const T_* src, int row0, int seq_len) {
  load_block_async<T_, ROWS, D, Ld<T_, D>::value, THREADS>(dst, src, D, row0, 0, seq_len);
}

// load_stats through cp.async; rows past seq_len land as 0 (the callers mask those columns).
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_stats_async(float* lse_s, float* delta_s, const float* lse,
                                                 const float* delta, int row0, int seq_len) {
  check_block_threads<THREADS>();
#pragma unroll
  for (int k = 0; k < (ROWS + THREADS - 1) / THREADS; ++k) {
    const int i = threadIdx.x + k * THREADS;
    if (ROWS % THREADS != 0 && i >= ROWS) break;
    const bool in = row0 + i < seq_len;  // bounds: rows past the sequence
    cp_async<4>(lse_s + i, in ? lse + row0 + i : lse, in);
    cp_async<4>(delta_s + i, in ? delta + row0 + i : delta, in);
  }
}


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
