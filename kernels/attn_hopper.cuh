// attn_hopper.cuh - the sm_90a candidates on wgmma, Hopper's warpgroup MMA (4 warps, 64 rows,
// operands read from shared memory by the tensor cores themselves, asynchronously):
//   attn_fwd_wgmma           the pipelined forward (attn_fwd_pipe) with its two products on it
//   attn_bwd_dkdv_ds_wgmma   dK/dV writing dS (attn_bwd_dkdv_ds), its four products on it
//   attn_bwd_dq_ds_wgmma     dQ = scale * dS K (attn_bwd_dq_ds) on it
//   attn_bwd_dkdv_wgmma      dK/dV (attn_bwd_dkdv_pipe): attn_bwd_dkdv_ds_wgmma without dS
//   attn_bwd_dq_wgmma        dQ recomputing S and dP (attn_bwd_dq_pipe), its three products
//   attn_bwd_dkdv_dq_wgmma   dK, dV and dQ in one pass, dQ's shares added in key-block order
//   attn_fwd_wgmma_overlap, attn_bwd_dkdv_ds_wgmma_overlap, attn_bwd_dkdv_wgmma_overlap,
//   attn_bwd_dq_wgmma_overlap, attn_bwd_dkdv_dq_wgmma_overlap
//                            four of them with a tile's last products in flight during the next
//                            tile's softmax or dS (FlashAttention-3's overlap in a warpgroup)
// A warpgroup owns 64 rows (queries; keys in dK/dV), W/4 of them a block. Products whose A
// operand was just computed (P, dS) take it from registers (the C -> A fragment repack of the
// mma.sync path); the others read both operands from shared memory, the streamed tiles
// transposed by the instruction where needed (MN-major). Tiles sit in shared memory in wgmma's
// no-swizzle core-matrix layout (cm_offset), loaded by the same cp.async pipeline (pipe_advance
// with WGMMA_READS). Per output element each sums the same products in the same order as its
// mma.sync twin, so on the emulator the two give the same bits. Built only for sm_90a
// (andrea.cuda.launch.module_arch); elsewhere the bodies are empty. The emulator runs them
// (cuda_emulator.h's async_mma_*: an operation happens at its wait_group). Part of
// microgpt_cuda.cu, after attn_pipe.cuh.

// Element offset of (r, c) in a tile of D columns of 16-bit elements in the core-matrix layout:
// 8 x 8 blocks of 128 contiguous bytes (8 rows of 16 bytes), a row of D/8 blocks per 8 rows.
// wgmma reads a block as one core matrix; its descriptor's strides say where the next one is.
template <int D> __device__ __forceinline__ int cm_offset(int r, int c) {
  return ((r >> 3) * (D / 8) + (c >> 3)) * 64 + (r & 7) * 8 + (c & 7);
}

// ROWS x COLS elements from (row0, col0) of a row-major matrix with row stride `stride` into the
// core-matrix layout (a tile of COLS columns) through cp.async; rows at or past `rows` land as
// zeros. Eight consecutive threads fill one 128-byte block, so the shared-memory writes do not
// conflict. THREADS, the block's, a multiple of COLS: a thread keeps its column of chunks and
// steps THREADS / (COLS / 8) rows, one core-matrix row of blocks per COLS threads.
template <typename T_, int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_block_cm_async(T_* dst, const T_* src, int stride, int row0,
                                                    int col0, int rows) {
  static_assert(sizeof(T_) == 2 && ROWS % 8 == 0 && COLS % 8 == 0, "whole core matrices");
  constexpr int CH = COLS / 8;  // 16-byte chunks of a row
  static_assert(THREADS % (8 * CH) == 0, "a thread keeps its column of chunks");
  constexpr int STEP = THREADS / CH;  // rows between a thread's chunks, a multiple of 8
  check_block_threads<THREADS>();
  const int r0 = (threadIdx.x / (8 * CH)) * 8 + (threadIdx.x & 7), c = (threadIdx.x / 8) % CH;
  T_* const d = dst + cm_offset<COLS>(r0, c * 8);  // STEP rows on: STEP * COLS elements on
  const T_* const s = src + (long long)(row0 + r0) * stride + col0 + c * 8;
#pragma unroll
  for (int i = 0; i < (ROWS + STEP - 1) / STEP; ++i) {
    const int r = r0 + i * STEP;
    if (ROWS % STEP != 0 && r >= ROWS) break;
    const bool in = row0 + r < rows;  // bounds: zeros land for rows past the matrix
    cp_async<16>(d + i * STEP * COLS, in ? s + (long long)i * STEP * stride : src, in);
  }
}

// ROWS rows from row0 of a [seq_len, D] slice (rows past seq_len land as zeros).
template <typename T_, int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_cm_async(T_* dst, const T_* src, int row0,
                                                   int seq_len) {
  load_block_cm_async<T_, ROWS, D, THREADS>(dst, src, D, row0, 0, seq_len);
}

// This thread's warpgroup, as the compiler can tell is the same in every lane of a warp (a
// shuffle from lane 0): what is computed from it (a warpgroup's tile, its wgmma descriptors)
// then lives in uniform registers, where the instruction reads descriptors, not in each lane's
// with a move across for every use.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0);
}

// The shared-memory address of p (sm_90: the shared window's; emulator: the offset into the
// block's dynamic shared memory, which is where wgmma_emulated reads).
__device__ __forceinline__ u32 shared_address(const void* p) {
#if defined(ANDREA_EMULATOR)
  return andrea_emu::shared_address(p);
#elif defined(__CUDA_ARCH__)
  u32 addr;  // not volatile: a pure function of p, which the compiler may share between uses
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(p));
  return addr;
#else
  return 0;
#endif
}

// A wgmma matrix descriptor, no swizzle: start address, LBO (bytes from a core matrix to the
// next along K) and SBO (to the next along M or N), each stored >> 4 in 14 bits.
__device__ __forceinline__ u64 wgmma_desc(const void* start, u32 lbo, u32 sbo) {
  return (u64)((shared_address(start) & 0x3ffffu) >> 4) | ((u64)(lbo >> 4) << 16) |
         ((u64)(sbo >> 4) << 32);
}

// The descriptor of the same layout `bytes` (a multiple of 16) further on: the start address is
// the low 14 bits, in 16-byte units, and a block's shared memory (at most 227 KiB) never carries
// it past them. One descriptor per operand and tile, then an add per k-step: built afresh at each
// step, a descriptor cost a dozen instructions of address arithmetic.
__device__ __forceinline__ u64 desc_advance(u64 desc, int bytes) {
  return desc + (u64)(bytes >> 4);
}

__device__ __forceinline__ void wgmma_fence() {  // registers written before are seen by wgmma
#if defined(ANDREA_WGMMA)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(ANDREA_WGMMA)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#elif defined(ANDREA_EMULATOR)
  andrea_emu::async_mma_commit();
#endif
}

// Waits until at most PENDING committed groups of this thread's wgmma are still in flight.
template <int PENDING> __device__ __forceinline__ void wgmma_wait() {
#if defined(ANDREA_WGMMA)
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
#elif defined(ANDREA_EMULATOR)
  andrea_emu::async_mma_wait(PENDING);
#endif
}

// Keeps the compiler from moving reads or writes of an accumulator across the asynchronous
// region (the registers belong to the tensor cores from issue to wait), or the writes of an
// operand past the wgmma_fence that must follow them (else ptxas adds a fence of its own where
// it sees them, and may wait there for every wgmma in flight).
template <int R> __device__ __forceinline__ void wgmma_fence_operands(float (&d)[R]) {
#if defined(ANDREA_WGMMA)
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
#else
  (void)d;
#endif
}

template <int K> __device__ __forceinline__ void wgmma_fence_operands(u32 (&a)[K][4]) {
#if defined(ANDREA_WGMMA)
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[k][i])::"memory");
#else
  (void)a;
#endif
}

// C fragments [R][4] as the flat list of accumulator registers a wgmma takes (the same order).
template <int R> __device__ __forceinline__ float (&flat(float (&x)[R][4]))[4 * R] {
  return *reinterpret_cast<float(*)[4 * R]>(&x[0][0]);
}

#if defined(ANDREA_EMULATOR)
// Element (mn, k) of a wgmma operand in shared memory, no swizzle (PTX ISA, "Shared Memory
// Matrix Layout", canonical layouts): K-major, a core matrix's 8 rows are 8 mn, 16 bytes of k
// each; MN-major (trans), 8 rows of k, 16 bytes of mn each. LBO steps 8 k, SBO 8 mn.
template <typename T_> float wgmma_operand(u64 desc, int mn, int k, bool mn_major) {
  if (desc >> 62) andrea_emu::die("wgmma: only the no-swizzle layout is emulated");
  const u32 start = (u32)(desc & 0x3fffu) << 4, lbo = (u32)((desc >> 16) & 0x3fffu) << 4;
  const u32 sbo = (u32)((desc >> 32) & 0x3fffu) << 4;
  const u32 within = mn_major ? (k % 8) * 16 + (mn % 8) * 2 : (mn % 8) * 16 + (k % 8) * 2;
  const u32 at = start + (mn / 8) * sbo + (k / 8) * lbo + within;
  u16 bits;
  std::memcpy(&bits, andrea_emu::shared_at(at, 2), 2);
  return elem16(bits, 0, T_{});
}

// wgmma.mma_async.m64nNk16 .f32 on this lane's part of the accumulator (warp w of the
// warpgroup: rows 16w + g and 16w + g + 8, columns 8j + 2t, +1, as mma.sync's C fragments per
// n8 block j): acc += A (64 x 16) * B (16 x N), products exact in float, summed over k in
// order. A from shared memory (a_regs null; MN-major where trans_a) or the warp's A fragments
// of all 32 lanes.
template <typename T_, int N>
void wgmma_emulated(float* acc, int warp, int lane, u64 adesc, const u32 (*a_regs)[4], u64 bdesc,
                    bool trans_b, int scale_d, bool trans_a = false) {
  const int g = lane >> 2, t = lane & 3;
  for (int j = 0; j < N / 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int r = g + (i >= 2 ? 8 : 0), col = 8 * j + 2 * t + (i & 1);
      float s = scale_d ? acc[4 * j + i] : 0.0f;
      for (int k = 0; k < 16; ++k) {
        const float a = a_regs ? elem16(a_regs[(r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)],
                                        k & 1, T_{})
                               : wgmma_operand<T_>(adesc, 16 * warp + r, k, trans_a);
        s += a * wgmma_operand<T_>(bdesc, col, k, trans_b);
      }
      acc[4 * j + i] = s;
    }
}
#endif

// The wgmma instructions this file issues: m64nNk16, f32 accumulators (N/2 a thread), bf16 or
// f16 operands; SS: A and B from shared memory (K-major, or MN-major where TRANS_A); RS: A from
// registers, B from shared memory; B MN-major where TRANS_B. scale_d 0 overwrites the
// accumulator.
#define ANDREA_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define ANDREA_R32                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ANDREA_R64                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "  \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define ANDREA_ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define ANDREA_ACC16(d, i) \
  ANDREA_ACC4(d, i), ANDREA_ACC4(d, i + 4), ANDREA_ACC4(d, i + 8), ANDREA_ACC4(d, i + 12)
#define ANDREA_ACC32(d) ANDREA_ACC16(d, 0), ANDREA_ACC16(d, 16)
#define ANDREA_ACC64(d) ANDREA_ACC32(d), ANDREA_ACC16(d, 32), ANDREA_ACC16(d, 48)
// SS: operands after the accumulators: a-desc, b-desc, scale-d, imm-trans-b, imm-trans-a.
#define ANDREA_WGMMA_SS(NN, TY, REGS, IA, IB, IS, IT, ITA, ...)                                \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS ", 0;\n"                               \
               "wgmma.mma_async.sync.aligned.m64n" #NN "k16.f32." TY "." TY " " REGS           \
               ", %" #IA ", %" #IB ", p, 1, 1, %" #ITA ", %" #IT ";\n}\n"                      \
               : __VA_ARGS__                                                                   \
               : "l"(adesc), "l"(bdesc), "r"(scale_d), "n"(TRANS_B ? 1 : 0),                   \
                 "n"(TRANS_A ? 1 : 0))
// RS: a0..a3, b-desc, scale-d, imm-trans-b.
#define ANDREA_WGMMA_RS(NN, TY, REGS, A0, A1, A2, A3, IB, IS, IT, ...)                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS ", 0;\n"                               \
               "wgmma.mma_async.sync.aligned.m64n" #NN "k16.f32." TY "." TY " " REGS           \
               ", {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #IB ", p, 1, 1, %" #IT ";\n}\n" \
               : __VA_ARGS__                                                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "r"(scale_d),         \
                 "n"(TRANS_B ? 1 : 0))

template <typename T_> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<bf16_t> { static constexpr bool value = true; };

template <typename T_, int N, bool TRANS_B, bool TRANS_A = false>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], u64 adesc, u64 bdesc, int scale_d) {
  static_assert(N == 32 || N == 64 || N == 128, "the instances this file issues");
#if defined(ANDREA_WGMMA)
  constexpr bool BF16 = IsBf16<T_>::value;
  if constexpr (BF16 && N == 32) ANDREA_WGMMA_SS(32, "bf16", ANDREA_R16, 16, 17, 18, 19, 20, ANDREA_ACC16(d, 0));
  if constexpr (BF16 && N == 64) ANDREA_WGMMA_SS(64, "bf16", ANDREA_R32, 32, 33, 34, 35, 36, ANDREA_ACC32(d));
  if constexpr (BF16 && N == 128) ANDREA_WGMMA_SS(128, "bf16", ANDREA_R64, 64, 65, 66, 67, 68, ANDREA_ACC64(d));
  if constexpr (!BF16 && N == 32) ANDREA_WGMMA_SS(32, "f16", ANDREA_R16, 16, 17, 18, 19, 20, ANDREA_ACC16(d, 0));
  if constexpr (!BF16 && N == 64) ANDREA_WGMMA_SS(64, "f16", ANDREA_R32, 32, 33, 34, 35, 36, ANDREA_ACC32(d));
  if constexpr (!BF16 && N == 128) ANDREA_WGMMA_SS(128, "f16", ANDREA_R64, 64, 65, 66, 67, 68, ANDREA_ACC64(d));
#elif defined(ANDREA_EMULATOR)
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;
  andrea_emu::async_mma_issue(d, N / 2, [=](float* acc) {
    wgmma_emulated<T_, N>(acc, warp, lane, adesc, nullptr, bdesc, TRANS_B, scale_d, TRANS_A);
  });
#endif
}

template <typename T_, int N, bool TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const u32 (&a)[4], u64 bdesc,
                                         int scale_d) {
  static_assert(N == 32 || N == 64 || N == 128, "the instances this file issues");
#if defined(ANDREA_WGMMA)
  constexpr bool BF16 = IsBf16<T_>::value;
  if constexpr (BF16 && N == 32) ANDREA_WGMMA_RS(32, "bf16", ANDREA_R16, 16, 17, 18, 19, 20, 21, 22, ANDREA_ACC16(d, 0));
  if constexpr (BF16 && N == 64) ANDREA_WGMMA_RS(64, "bf16", ANDREA_R32, 32, 33, 34, 35, 36, 37, 38, ANDREA_ACC32(d));
  if constexpr (BF16 && N == 128) ANDREA_WGMMA_RS(128, "bf16", ANDREA_R64, 64, 65, 66, 67, 68, 69, 70, ANDREA_ACC64(d));
  if constexpr (!BF16 && N == 32) ANDREA_WGMMA_RS(32, "f16", ANDREA_R16, 16, 17, 18, 19, 20, 21, 22, ANDREA_ACC16(d, 0));
  if constexpr (!BF16 && N == 64) ANDREA_WGMMA_RS(64, "f16", ANDREA_R32, 32, 33, 34, 35, 36, 37, 38, ANDREA_ACC32(d));
  if constexpr (!BF16 && N == 128) ANDREA_WGMMA_RS(128, "f16", ANDREA_R64, 64, 65, 66, 67, 68, 69, 70, ANDREA_ACC64(d));
#elif defined(ANDREA_EMULATOR)
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;
  u32 mine[4] = {a[0], a[1], a[2], a[3]}, all[32][4];
  warp_allgather(mine, all);  // the warp's A fragments, as the instruction takes them at issue
  struct Frags {
    u32 r[32][4];
  } frags;
  std::memcpy(frags.r, all, sizeof(all));
  const u32* const regs = a;  // the registers: the GPU reads them until the wait_group
  andrea_emu::async_mma_issue(d, N / 2, [=](float* acc) {
    for (int i = 0; i < 4; ++i)
      if (regs[i] != mine[i])
        andrea_emu::die("wgmma: A fragment registers written before the wait_group that "
                        "completes their instruction");
    wgmma_emulated<T_, N>(acc, warp, lane, 0, frags.r, bdesc, TRANS_B, scale_d);
  });
#endif
}
#undef ANDREA_R16
#undef ANDREA_R32
#undef ANDREA_R64
#undef ANDREA_ACC4
#undef ANDREA_ACC16
#undef ANDREA_ACC32
#undef ANDREA_ACC64
#undef ANDREA_WGMMA_SS
#undef ANDREA_WGMMA_RS

// P (or dS) of a warp's rows as wgmma's A fragments for k16 steps over the tile's columns: the C
// fragments of n8 blocks 2kk and 2kk+1 rounded to the element type (warp_gemm_rs's repack).
template <typename T_, int N>
__device__ __forceinline__ void repack_a(u32 (&a)[N / 16][4], const float (&c)[N / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    a[kk][0] = pack2(c[2 * kk][0], c[2 * kk][1], T_{});
    a[kk][1] = pack2(c[2 * kk][2], c[2 * kk][3], T_{});
    a[kk][2] = pack2(c[2 * kk + 1][0], c[2 * kk + 1][1], T_{});
    a[kk][3] = pack2(c[2 * kk + 1][2], c[2 * kk + 1][3], T_{});
  }
}

// The descriptor of a tile of D columns in the core-matrix layout, read K-major (its rows are
// M or N: Q, K, V, dO as the first products' operands) or MN-major (its rows are K: V, K, dO, Q
// as the right operand of a product from registers). Built once for what does not move (a
// warpgroup's own tile) or once a tile for a stage (desc_advance from stage 0's).
template <int D> __device__ __forceinline__ u64 kmajor_desc(const void* tile) {
  return wgmma_desc(tile, 128, D / 8 * 64 * 2);
}

template <int D> __device__ __forceinline__ u64 mn_major_desc(const void* tile) {
  return wgmma_desc(tile, D / 8 * 64 * 2, 128);
}

// x = A Bᵀ over D/16 k16 steps, A (this warpgroup's 64 rows) and B (N rows) tiles of D columns
// given by their K-major descriptors: the instructions alone, onto x as it is.
template <typename T_, int D, int N>
__device__ __forceinline__ void issue_ss_steps(float (&x)[N / 8][4], u64 a_desc, u64 b_desc) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)  // a k16 step: two core matrices, 256 bytes, on
    wgmma_ss<T_, N, false>(flat(x), desc_advance(a_desc, kk * 256),
                           desc_advance(b_desc, kk * 256), 1);
}

template <int N> __device__ __forceinline__ void zero_fragments(float (&x)[N / 8][4]) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) x[j][0] = x[j][1] = x[j][2] = x[j][3] = 0.0f;
  wgmma_fence_operands(flat(x));  // written before the fence
}

// x = A Bᵀ (S), or with y = A_y B_yᵀ beside it (S and dP, or Sᵀ and dPᵀ): issued, not
// committed. Every accumulator is zeroed before the fence, and before any is issued: the
// compiler may keep a zero in a register the first product then owns (scale-d 0 on the first
// step instead of zeros: ptxas waits for every wgmma in flight before the product; with zeros
// it issues the first step with scale-d 0 itself).
template <typename T_, int D, int N>
__device__ __forceinline__ void issue_product(float (&x)[N / 8][4], u64 a_desc, u64 b_desc) {
  zero_fragments<N>(x);
  wgmma_fence();
  issue_ss_steps<T_, D, N>(x, a_desc, b_desc);
}

template <typename T_, int D, int N>
__device__ __forceinline__ void issue_two_products(float (&x)[N / 8][4], u64 ax_desc,
                                                   u64 bx_desc, float (&y)[N / 8][4],
                                                   u64 ay_desc, u64 by_desc) {
  zero_fragments<N>(x);
  zero_fragments<N>(y);
  wgmma_fence();
  issue_ss_steps<T_, D, N>(x, ax_desc, bx_desc);
  issue_ss_steps<T_, D, N>(y, ay_desc, by_desc);
}

// acc += A B: A's fragments (P or dS of a warp's rows, repack_a) from registers, all written
// before the wgmma_fence (which orders register writes before wgmma reads them); B an
// N x D tile in shared memory read MN-major (V in the forward, K in dQ, dO and Q in dK/dV;
// b_desc: mn_major_desc); N/16 k16 steps, issued, not committed. A's registers and acc belong
// to the tensor cores until the group is waited for.
template <typename T_, int D, int N>
__device__ __forceinline__ void issue_add_rs(float (&acc)[D / 8][4], u32 (&a)[N / 16][4],
                                             u64 b_desc) {
  constexpr int ROW8_BYTES = D / 8 * 64 * 2;
  wgmma_fence_operands(flat(acc));  // written before the fence: acc's rescale, A's repack
  wgmma_fence_operands(a);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk)  // a k16 step: 16 rows of B, two rows of core matrices
    wgmma_rs<T_, D, true>(flat(acc), a[kk], desc_advance(b_desc, kk * 2 * ROW8_BYTES), 1);
}

// issue_add_rs as a group of its own, waited for.
template <typename T_, int D, int N>
__device__ __forceinline__ void wgmma_add_rs(float (&acc)[D / 8][4], u32 (&a)[N / 16][4],
                                             u64 b_desc) {
  issue_add_rs<T_, D, N>(acc, a, b_desc);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(flat(acc));
}

// Dynamic shared memory of the wgmma kernels (byte offsets; andrea.cuda.launch's
// pipe_shared_bytes mirrors `bytes`), all tiles in the core-matrix layout, no padding (a core
// matrix is 128 contiguous bytes: no bank conflicts to pad away). The owned tiles (M x D each:
// Q; K and V for dK/dV; Q and dO for dQ; none for dQ from dS), then STAGES stages of streamed
// tiles: forward and dQ K and V, dK/dV Q and dO (N x D each), dQ from dS a dS tile (M x N) and
// a K tile (N x D); then the statistics: dK/dV's per stage (lse and delta of the stage's N
// queries), dQ's of its owned rows; last, dK/dV with dQ's dS tile (M keys x N queries, DS).
template <typename T_, int D, int K, int W, int N, int STAGES> struct HopperSmem {
  static constexpr int M = 16 * W;
  static constexpr int A_TILES = K == KIND_FWD ? 1 : (K == KIND_DQ_DS ? 0 : 2);
  static constexpr int STAGE = K == KIND_DQ_DS ? M * N + N * D : 2 * N * D;  // elements
  static constexpr int B = A_TILES * M * D * (int)sizeof(T_);
  static constexpr int STATS = B + STAGES * STAGE * (int)sizeof(T_);
  static constexpr bool DKDV = K == KIND_DKDV || K == KIND_DKDV_DQ;
  static constexpr int DS = STATS + (DKDV ? STAGES * 2 * N * 4 : (K == KIND_DQ ? 2 * M * 4 : 0));
  static constexpr int bytes = DS + (K == KIND_DKDV_DQ ? M * N * (int)sizeof(T_) : 0);
  static_assert(W % 4 == 0 && STAGES >= 1, "whole warpgroups, a stage");
  // The descriptor of a streamed tile in its stage, from stage 0's (a stage is STAGE elements on).
  static __device__ __forceinline__ u64 at_stage(u64 stage0_desc, int tile) {
    return desc_advance(stage0_desc, (tile % STAGES) * STAGE * (int)sizeof(T_));
  }
};

// The forward on wgmma: W warps (W/4 warpgroups of 64 query rows), N keys a tile, STAGES-deep
// cp.async pipeline; launched as attn_fwd_pipe with the same (W, N, STAGES). OVERLAP
// (attn_fwd_wgmma_overlap; FlashAttention-3's overlap within a warpgroup): tile it's S = Q Kᵀ is
// issued with tile it-1's O += P V behind it, and tile it's softmax runs while that product is
// in flight; O's rescale waits for it. O sees the same operations in the same order (rescale,
// add, rescale, ...), so the same bits as without. Tile it-1's V is read a tile longer: the
// pipeline's LAG 1, at least 3 stages.
template <typename T_, int D, int W, int N, int STAGES, bool OVERLAP>
__device__ __forceinline__ void fwd_wgmma_body(const T_* __restrict__ q,
                                               const T_* __restrict__ k,
                                               const T_* __restrict__ v, T_* __restrict__ o,
                                               float* __restrict__ lse, int seq_len,
                                               float scale) {
#if defined(ANDREA_WGMMA) || defined(ANDREA_EMULATOR)
  static_assert(UsesMma<T_>::value, "wgmma takes bf16 or fp16");
  using L = HopperSmem<T_, D, KIND_FWD, W, N, STAGES>;
  constexpr int M = L::M, ROW8 = D / 8 * 64;  // elements in 8 rows of a tile
  constexpr int LAG = OVERLAP ? 1 : 0;  // V of tile it-1 is read during tile it
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const qs = (T_*)smem;
  T_* const kv = (T_*)(smem + L::B);  // stage s: K at kv + s*STAGE, V after it
  const int group = warpgroup_index(), warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * M;  // heaviest causal tiles first
  const long long base = (long long)blockIdx.y * seq_len * D;
  const float sl2 = scale * ANDREA_LOG2E;
  const int row0 = q0 + group * 64 + warp * 16;  // this warp's first row
  const int last = imin(q0 + M, seq_len) - 1;
  const int n_tiles = last / N + 1;
  const T_* const qg = qs + group * 8 * ROW8;  // this warpgroup's 64 rows

  const auto load_kv = [&](int stage, int tile) {
    load_tile_cm_async<T_, D, N, 32 * W>(kv + stage * L::STAGE, k + base, tile * N, seq_len);
    load_tile_cm_async<T_, D, N, 32 * W>(kv + stage * L::STAGE + N * D, v + base,
                                         tile * N, seq_len);
  };
  // Descriptors: Q's, and stage 0's K and V, once; a tile's stage is an add on (L::at_stage).
  const u64 q_desc = kmajor_desc<D>(qg), k_desc = kmajor_desc<D>(kv);
  const u64 v_desc = mn_major_desc<D>(kv + N * D);
  load_tile_cm_async<T_, D, M, 32 * W>(qs, q + base, q0, seq_len);  // joins the first group
  pipe_prologue<STAGES, LAG>(n_tiles, load_kv);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m_run[2] = {-inf_f(), -inf_f()}, l_run[2] = {0.0f, 0.0f};
  float s[N / 8][4], corr[2];  // a tile's S, then its P; O's factor for it
  u32 pf[N / 16][4];            // P as A fragments
  const auto issue_s = [&](int it) {  // S = Q K^T of tile it, once its stage has landed
    pipe_advance<STAGES, true, LAG>(it, n_tiles, load_kv);
    issue_product<T_, D, N>(s, q_desc, L::at_stage(k_desc, it));
    wgmma_commit();
  };
  const auto softmax = [&](int it) {  // tile it's S has landed: P, the running max and sums
    wgmma_fence_operands(flat(s));
    const int n0 = it * N;
    online_softmax_scores<N>(s, m_run, l_run, corr, row0 + g, n0,
                             n0 + N - 1 > q0 || n0 + N > seq_len, seq_len, sl2);
  };

  if constexpr (!OVERLAP) {
    for (int it = 0; it < n_tiles; ++it) {
      issue_s(it);
      wgmma_wait<0>();
      softmax(it);
      rescale_rows<D>(acc, corr);
      repack_a<T_, N>(pf, s);
      wgmma_add_rs<T_, D, N>(acc, pf, L::at_stage(v_desc, it));  // O += P V
    }
  } else {  // tile 0 alone (a wgmma issued on one path only costs a fence ptxas adds), then
            // each tile's S with tile it-1's O += P V behind it
    issue_s(0);
    wgmma_wait<0>();
    softmax(0);
    rescale_rows<D>(acc, corr);
    repack_a<T_, N>(pf, s);
    for (int it = 1; it < n_tiles; ++it) {
      issue_s(it);
      issue_add_rs<T_, D, N>(acc, pf, L::at_stage(v_desc, it - 1));
      wgmma_commit();
      wgmma_wait<1>();  // S's group, the older one
      softmax(it);
      wgmma_wait<0>();  // O += P V of tile it-1 has landed; its P fragments are free again
      wgmma_fence_operands(flat(acc));
      rescale_rows<D>(acc, corr);
      repack_a<T_, N>(pf, s);
    }
    wgmma_add_rs<T_, D, N>(acc, pf, L::at_stage(v_desc, n_tiles - 1));  // the last tile's
  }
  cp_async_wait<0>();  // nothing left in flight when the block ends (only empty groups)

  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(l_run[h]);
    inv[h] = 1.0f / l;
    const int row = row0 + g + 8 * h;
    if (t == 0 && row < seq_len)  // bounds: no rows past the sequence
      lse[(long long)blockIdx.y * seq_len + row] = (m_run[h] + log2f(l)) * ANDREA_LN2;
  }
  store_rows<T_, D>(o + base, acc, row0, seq_len, inv[0], inv[1]);
#endif
}

template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_fwd_wgmma(const T_* __restrict__ q, const T_* __restrict__ k, const T_* __restrict__ v,
                   T_* __restrict__ o, float* __restrict__ lse, int seq_len, float scale) {
  fwd_wgmma_body<T_, D, W, N, STAGES, false>(q, k, v, o, lse, seq_len, scale);
}

template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_fwd_wgmma_overlap(const T_* __restrict__ q, const T_* __restrict__ k,
                           const T_* __restrict__ v, T_* __restrict__ o,
                           float* __restrict__ lse, int seq_len, float scale) {
  fwd_wgmma_body<T_, D, W, N, STAGES, true>(q, k, v, o, lse, seq_len, scale);
}

// dS^T's A fragments of a warp (repack_a of its keys row0 + g and + 8, the tile's N queries as
// k) into an M x N tile of the core-matrix layout, keys as rows: each register is two adjacent
// queries of one key, a 4-byte store. Read back MN-major as dQ's A operand (queries as M).
template <typename T_, int N>
__device__ __forceinline__ void store_ds_fragments(T_* tile, const u32 (&a)[N / 16][4],
                                                   int row0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *(u32*)(tile + cm_offset<N>(row0 + g + 8 * (i & 1), 16 * kk + 8 * (i >> 1) + 2 * t)) =
          a[kk][i];
}

// dQ's shares in a fixed order: key block j adds its share of a query tile once key block j-1
// has added its own, so every run sums them alike (no atomics; exact resume needs the same
// bits). A counter per (batch*head, query tile) says whose turn it is, zeroed before the
// launch. A block waits only on blocks of its head with a lower blockIdx.x, which a GPU starts
// first: one launched after its waiter might never start on a full GPU (a deadlock). So a wait
// that lasts 2^32 cycles (about 2 s; a turn comes in microseconds) traps: the launch fails
// with an error instead of hanging. The emulator runs blocks one at a time in launch order, so
// there a wait stops the program at once.
__device__ __forceinline__ void wait_turn(const int* count, int turn) {
#if defined(ANDREA_EMULATOR)
  if (*count != turn) andrea_emu::die("dQ in order: a block waits for a block not yet run");
#elif defined(__CUDA_ARCH__)
  const long long start = clock64();
  int now;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(now) : "l"(count) : "memory");
  } while (now != turn && clock64() - start < (1ll << 32));
  if (now != turn) __trap();
#endif
}

__device__ __forceinline__ void pass_turn(int* count, int next) {
#if defined(ANDREA_EMULATOR)
  *count = next;
#elif defined(__CUDA_ARCH__)
  __threadfence();
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(count), "r"(next) : "memory");
#endif
}

// float32 pairs of dq_acc through L2 only (ld/st .cg): another block on this SM may have left
// an older copy of the line in L1, which is not kept coherent.
__device__ __forceinline__ void load_pair_l2(const float* p, float& lo, float& hi) {
#if defined(ANDREA_EMULATOR) || !defined(__CUDA_ARCH__)
  lo = p[0];
  hi = p[1];
#else
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(lo), "=f"(hi) : "l"(p) : "memory");
#endif
}

__device__ __forceinline__ void store_pair_l2(float* p, float lo, float hi) {
#if defined(ANDREA_EMULATOR) || !defined(__CUDA_ARCH__)
  p[0] = lo;
  p[1] = hi;
#else
  asm volatile("st.global.cg.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(lo), "f"(hi) : "memory");
#endif
}

// Key block blockIdx.x's dQ share `part` (a warp's rows of the N queries of tile qt, D columns):
// the first block (0) writes it to dq_acc, the next ones add it to what is there, and the last
// (the tile's diagonal block) writes the sum times scale to dq in the element type.
template <typename T_, int D, int N, int M>
__device__ __forceinline__ void dq_in_order(const float (&part)[D / 8][4], T_* __restrict__ dq,
                                            float* __restrict__ dq_acc,
                                            int* __restrict__ dq_count, int qt, int seq_len,
                                            float scale) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x / 32;
  const int j = blockIdx.x, last = imin(qt * N + N - 1, seq_len - 1) / M;
  int* const count = dq_count + (long long)blockIdx.y * ((seq_len + N - 1) / N) + qt;
  const long long base = (long long)blockIdx.y * seq_len * D;
  if (threadIdx.x == 0) wait_turn(count, j);
  __syncthreads();  // thread 0's acquire, for every thread's reads below
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = qt * N + warp * 16 + g + 8 * h;
    if (row >= seq_len) continue;  // bounds: no dQ rows past the sequence
#pragma unroll
    for (int jj = 0; jj < D / 8; ++jj) {
      const long long at = base + (long long)row * D + jj * 8 + 2 * t;
      float lo = part[jj][2 * h], hi = part[jj][2 * h + 1];
      if (j > 0) {
        float lo0, hi0;
        load_pair_l2(dq_acc + at, lo0, hi0);
        lo = lo0 + lo;
        hi = hi0 + hi;
      }
      if (j == last)
        store_pair(dq + at, lo * scale, hi * scale);
      else
        store_pair_l2(dq_acc + at, lo, hi);
    }
  }
  __syncthreads();  // every thread's writes, before thread 0 passes the turn
  if (threadIdx.x == 0) pass_turn(count, j + 1);
}

// dK/dV on wgmma (attn_bwd_dkdv_pipe's arithmetic, one pass over a query tile; with WRITE_DS
// attn_bwd_dkdv_ds's, dS stored too): a warpgroup owns 64 keys, W/4 of them a block, and
// streams N queries a tile (Q, dO, their lse and delta). Per tile S^T = K Q^T and dP^T = V dO^T
// (K, V and the tiles from shared memory), P^T and dS^T in registers, then dV += P^T dO and
// dK += dS^T Q (P^T and dS^T from registers, dO and Q transposed from shared memory). OVERLAP
// (as the forward's): tile it's two products are issued with tile it-1's dV and dK products
// behind them, and P^T and dS^T are computed while those are in flight; the same bits.
// DQ (attn_bwd_dkdv_dq_wgmma): dQ too, each query tile's share dS K of these keys added in
// key-block order (dq_in_order), the query tiles taken from the last down; with OVERLAP
// (attn_bwd_dkdv_dq_wgmma_overlap) a tile's share is added while the next tile's S^T and dP^T
// are in flight, its wait for the turn and its trip to L2 behind them; the same bits.
template <typename T_, int D, int W, int N, int STAGES, bool WRITE_DS, bool OVERLAP,
          bool DQ = false>
__device__ __forceinline__ void dkdv_wgmma_body(
    const T_* __restrict__ q, const T_* __restrict__ k, const T_* __restrict__ v,
    const T_* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
    T_* __restrict__ dk, T_* __restrict__ dv, T_* __restrict__ ds, int seq_len, int ds_stride,
    float scale, T_* __restrict__ dq = nullptr, float* __restrict__ dq_acc = nullptr,
    int* __restrict__ dq_count = nullptr) {
#if defined(ANDREA_WGMMA) || defined(ANDREA_EMULATOR)
  static_assert(UsesMma<T_>::value, "bf16 or fp16");
  using L = HopperSmem<T_, D, DQ ? KIND_DKDV_DQ : KIND_DKDV, W, N, STAGES>;
  constexpr int M = L::M, ROW8 = D / 8 * 64;
  static_assert(!WRITE_DS || 128 % M == 0, "the dS row stride must hold the last block's keys");
  static_assert(!DQ || (W == 4 && N == 64 && !WRITE_DS),
                "dQ in order: one warpgroup, its 64 keys a block and 64 queries a tile");
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const ks = (T_*)smem;
  T_* const vs = ks + M * D;
  T_* const qd = (T_*)(smem + L::B);  // stage s: Q at qd + s*STAGE, dO after it
  float* const stats = (float*)(smem + L::STATS);  // stage s: lse at stats + 2sN, delta after
  const int group = warpgroup_index(), warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x & 31, g = lane >> 2;
  const int k0 = blockIdx.x * M;
  const long long base = (long long)blockIdx.y * seq_len * D;
  const long long sbase = (long long)blockIdx.y * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  const int first = k0 / N;  // query tiles before it see none of these keys
  const int n_tiles = (seq_len + N - 1) / N - first;
  // the query tile of iteration it: upward, or with DQ from the last down
  const auto query_tile = [&](int it) { return DQ ? first + n_tiles - 1 - it : first + it; };
  const int key_base = k0 + group * 64 + warp * 16 + g;
  const T_* const kg = ks + group * 8 * ROW8;  // this warpgroup's 64 keys
  const T_* const vg = vs + group * 8 * ROW8;

  load_tile_cm_async<T_, D, M, 32 * W>(ks, k + base, k0, seq_len);
  load_tile_cm_async<T_, D, M, 32 * W>(vs, v + base, k0, seq_len);
  const auto load_qdo = [&](int stage, int tile) {
    const int n0 = query_tile(tile) * N;
    load_tile_cm_async<T_, D, N, 32 * W>(qd + stage * L::STAGE, q + base, n0, seq_len);
    load_tile_cm_async<T_, D, N, 32 * W>(qd + stage * L::STAGE + N * D, dout + base, n0, seq_len);
    load_stats_async<N, 32 * W>(stats + 2 * stage * N, stats + (2 * stage + 1) * N, lse + sbase,
                        delta + sbase, n0, seq_len);
  };
  // Descriptors: this warpgroup's K and V, and stage 0's Q and dO, each way they are read,
  // once; a tile's stage is an add on (L::at_stage).
  const u64 k_desc = kmajor_desc<D>(kg), v_desc = kmajor_desc<D>(vg);
  const u64 q_desc = kmajor_desc<D>(qd), do_desc = kmajor_desc<D>(qd + N * D);
  const u64 q_mn_desc = mn_major_desc<D>(qd), do_mn_desc = mn_major_desc<D>(qd + N * D);
  constexpr int LAG = OVERLAP ? 1 : 0;
  pipe_prologue<STAGES, LAG>(n_tiles, load_qdo);
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk_acc[j][i] = dv_acc[j][i] = 0.0f;
  float st[N / 8][4], dpt[N / 8][4];  // a tile's S^T and dP^T, then P^T and dS^T
  u32 pf[N / 16][4], dsf[N / 16][4];  // P^T and dS^T as A fragments
  const auto issue_st_dpt = [&](int it) {  // S^T = K Q^T, dP^T = V dO^T of tile it, landed
    pipe_advance<STAGES, true, LAG>(it, n_tiles, load_qdo);
    issue_two_products<T_, D, N>(st, k_desc, L::at_stage(q_desc, it), dpt, v_desc,
                                 L::at_stage(do_desc, it));
    wgmma_commit();
  };
  const auto p_ds_of = [&](int it) {  // tile it's S^T and dP^T have landed: P^T and dS^T
    wgmma_fence_operands(flat(st));
    wgmma_fence_operands(flat(dpt));
    const int n0 = query_tile(it) * N;
    const float* lse_s = stats + 2 * (it % STAGES) * N;
    transposed_p_ds<N>(st, dpt, key_base, n0, 0, seq_len, lse_s, lse_s + N, sl2);
    if constexpr (WRITE_DS)
      store_ds<T_, N>(ds + (long long)blockIdx.y * seq_len * ds_stride, dpt, key_base, n0,
                      ds_stride, seq_len);
  };
  const auto repack = [&] {
    repack_a<T_, N>(pf, st);
    repack_a<T_, N>(dsf, dpt);
  };
  // dV += P^T dO and dK += dS^T Q for tile `tile`: N/16 steps each, dO and Q MN-major.
  const auto issue_dv_dk = [&](int tile) {
    issue_add_rs<T_, D, N>(dv_acc, pf, L::at_stage(do_mn_desc, tile));
    issue_add_rs<T_, D, N>(dk_acc, dsf, L::at_stage(q_mn_desc, tile));
    wgmma_commit();
  };
  const auto land_dv_dk = [&] {
    wgmma_wait<0>();
    wgmma_fence_operands(flat(dv_acc));
    wgmma_fence_operands(flat(dk_acc));
  };

  if constexpr (DQ) {
    T_* const ds_tile = (T_*)(smem + L::DS);  // dS^T: keys as rows, the tile's queries as columns
    const u64 ds_desc = mn_major_desc<N>(ds_tile), k_mn_desc = mn_major_desc<D>(kg);
    float dq_part[D / 8][4];  // this tile's dQ share, dS K over these keys
    const auto add_share = [&](int it) {
      dq_in_order<T_, D, N, M>(dq_part, dq, dq_acc, dq_count, query_tile(it), seq_len, scale);
    };
    const auto finish_tile = [&](int it) {  // tile it's S^T and dP^T issued: the rest of it
      wgmma_wait<0>();
      p_ds_of(it);
      repack();
      store_ds_fragments<T_, N>(ds_tile, dsf, warp * 16);
      fence_proxy_async();  // the stores, to the tensor cores' reads
      __syncthreads();      // every warp's dS^T rows are in
      issue_dv_dk(it);
      zero_fragments<D>(dq_part);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < M / 16; ++kk)  // dQ share = dS K: 16 keys a step, both MN-major
        wgmma_ss<T_, D, true, true>(flat(dq_part), desc_advance(ds_desc, kk * 2 * (N / 8) * 128),
                                    desc_advance(k_mn_desc, kk * 2 * ROW8 * 2), 1);
      wgmma_commit();
      land_dv_dk();
      wgmma_fence_operands(flat(dq_part));
    };
    if constexpr (!OVERLAP) {
      for (int it = 0; it < n_tiles; ++it) {
        issue_st_dpt(it);
        finish_tile(it);
        add_share(it);
      }
    } else {  // tile 0 alone (the share added under a branch, ptxas serializes every wgmma:
              // C7518), then the tile before's share while this tile's products run
      issue_st_dpt(0);
      finish_tile(0);
      for (int it = 1; it < n_tiles; ++it) {
        issue_st_dpt(it);
        add_share(it - 1);
        finish_tile(it);
      }
      add_share(n_tiles - 1);
    }
  } else if constexpr (!OVERLAP) {
    for (int it = 0; it < n_tiles; ++it) {
      issue_st_dpt(it);
      wgmma_wait<0>();
      p_ds_of(it);
      repack();
      issue_dv_dk(it);
      land_dv_dk();
    }
  } else {  // as the forward's: tile 0 alone, then tile it-1's dV and dK behind tile it's
    issue_st_dpt(0);
    wgmma_wait<0>();
    p_ds_of(0);
    repack();
    for (int it = 1; it < n_tiles; ++it) {
      issue_st_dpt(it);
      issue_dv_dk(it - 1);
      wgmma_wait<1>();
      p_ds_of(it);
      land_dv_dk();  // before their fragments are written again
      repack();
    }
    issue_dv_dk(n_tiles - 1);  // the last tile's
    land_dv_dk();
  }
  cp_async_wait<0>();
  store_rows<T_, D>(dk + base, dk_acc, k0 + group * 64 + warp * 16, seq_len, scale, scale);
  store_rows<T_, D>(dv + base, dv_acc, k0 + group * 64 + warp * 16, seq_len, 1.0f, 1.0f);
#endif
}

// dK/dV through dS: launched as attn_bwd_dkdv_ds with the same (W, N, STAGES); PASSES must be
// 1 (a template argument only so that its name expression reads as the other dK/dV
// candidates'), and so below.
template <typename T_, int D, int W, int N, int STAGES, int MINB, int PASSES>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dkdv_ds_wgmma(const T_* __restrict__ q, const T_* __restrict__ k,
                           const T_* __restrict__ v, const T_* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ delta,
                           T_* __restrict__ dk, T_* __restrict__ dv, T_* __restrict__ ds,
                           int seq_len, int ds_stride, float scale) {
  static_assert(PASSES == 1, "one pass");
  dkdv_wgmma_body<T_, D, W, N, STAGES, true, false>(q, k, v, dout, lse, delta, dk, dv, ds,
                                                    seq_len, ds_stride, scale);
}

template <typename T_, int D, int W, int N, int STAGES, int MINB, int PASSES>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dkdv_ds_wgmma_overlap(const T_* __restrict__ q, const T_* __restrict__ k,
                                   const T_* __restrict__ v, const T_* __restrict__ dout,
                                   const float* __restrict__ lse,
                                   const float* __restrict__ delta, T_* __restrict__ dk,
                                   T_* __restrict__ dv, T_* __restrict__ ds, int seq_len,
                                   int ds_stride, float scale) {
  static_assert(PASSES == 1, "one pass");
  dkdv_wgmma_body<T_, D, W, N, STAGES, true, true>(q, k, v, dout, lse, delta, dk, dv, ds,
                                                   seq_len, ds_stride, scale);
}

// dK/dV alone (the backward that recomputes S and dP in dQ): launched as attn_bwd_dkdv_pipe.
template <typename T_, int D, int W, int N, int STAGES, int MINB, int PASSES>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dkdv_wgmma(const T_* __restrict__ q, const T_* __restrict__ k,
                        const T_* __restrict__ v, const T_* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        T_* __restrict__ dk, T_* __restrict__ dv, int seq_len, float scale) {
  static_assert(PASSES == 1, "one pass");
  dkdv_wgmma_body<T_, D, W, N, STAGES, false, false>(q, k, v, dout, lse, delta, dk, dv,
                                                     nullptr, seq_len, 0, scale);
}

template <typename T_, int D, int W, int N, int STAGES, int MINB, int PASSES>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dkdv_wgmma_overlap(const T_* __restrict__ q, const T_* __restrict__ k,
                                const T_* __restrict__ v, const T_* __restrict__ dout,
                                const float* __restrict__ lse, const float* __restrict__ delta,
                                T_* __restrict__ dk, T_* __restrict__ dv, int seq_len,
                                float scale) {
  static_assert(PASSES == 1, "one pass");
  dkdv_wgmma_body<T_, D, W, N, STAGES, false, true>(q, k, v, dout, lse, delta, dk, dv,
                                                    nullptr, seq_len, 0, scale);
}

// dK, dV and dQ in one pass (FlashAttention-3's deterministic backward, five tile products, one
// exponent a score): attn_bwd_dkdv_wgmma, and for each query tile also dQ's share dS K of this
// block's 64 keys (dS^T through shared memory, read back transposed), added into the float32
// dq_acc [B*H, T, D] in key-block order (dq_in_order; dq_count [B*H, query tiles] zeroed before
// the launch), the last share writing dq. Taken from the last query tile down, a head's blocks
// all start at its last tile and add there one after the other, rather than block j starting
// once block j-1 has done j tiles. W 4, N 64; grid (key blocks, B*H), PASSES 1.
template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dkdv_dq_wgmma(const T_* __restrict__ q, const T_* __restrict__ k,
                           const T_* __restrict__ v, const T_* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ delta,
                           T_* __restrict__ dq, T_* __restrict__ dk, T_* __restrict__ dv,
                           float* __restrict__ dq_acc, int* __restrict__ dq_count, int seq_len,
                           float scale) {
  dkdv_wgmma_body<T_, D, W, N, STAGES, false, false, true>(
      q, k, v, dout, lse, delta, dk, dv, nullptr, seq_len, 0, scale, dq, dq_acc, dq_count);
}

template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dkdv_dq_wgmma_overlap(const T_* __restrict__ q, const T_* __restrict__ k,
                                   const T_* __restrict__ v, const T_* __restrict__ dout,
                                   const float* __restrict__ lse,
                                   const float* __restrict__ delta, T_* __restrict__ dq,
                                   T_* __restrict__ dk, T_* __restrict__ dv,
                                   float* __restrict__ dq_acc, int* __restrict__ dq_count,
                                   int seq_len, float scale) {
  dkdv_wgmma_body<T_, D, W, N, STAGES, false, true, true>(
      q, k, v, dout, lse, delta, dk, dv, nullptr, seq_len, 0, scale, dq, dq_acc, dq_count);
}

// dQ recomputing S and dP on wgmma (attn_bwd_dq_pipe's arithmetic): a warpgroup owns 64
// queries (Q, dO, their lse and delta), W/4 of them a block, and streams N keys a tile (K, V).
// Per tile S = Q K^T and dP = dO V^T (shared memory), dS = P o (dP - delta) in registers, then
// dQ += dS K (dS from registers, K transposed from shared memory, as V in the forward).
// Launched as attn_bwd_dq_pipe with the same (W, N, STAGES). OVERLAP (as the forward's): tile
// it's S and dP are issued with tile it-1's dQ += dS K behind them, and dS is computed while it
// is in flight; the same bits.
template <typename T_, int D, int W, int N, int STAGES, bool OVERLAP>
__device__ __forceinline__ void dq_wgmma_body(const T_* __restrict__ q, const T_* __restrict__ k,
                                              const T_* __restrict__ v,
                                              const T_* __restrict__ dout,
                                              const float* __restrict__ lse,
                                              const float* __restrict__ delta,
                                              T_* __restrict__ dq, int seq_len, float scale) {
#if defined(ANDREA_WGMMA) || defined(ANDREA_EMULATOR)
  static_assert(UsesMma<T_>::value, "wgmma takes bf16 or fp16");
  using L = HopperSmem<T_, D, KIND_DQ, W, N, STAGES>;
  constexpr int M = L::M, ROW8 = D / 8 * 64;
  constexpr int LAG = OVERLAP ? 1 : 0;
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const qs = (T_*)smem;
  T_* const dos = qs + M * D;
  T_* const kv = (T_*)(smem + L::B);  // stage s: K at kv + s*STAGE, V after it
  float* const lse_s = (float*)(smem + L::STATS);
  float* const delta_s = lse_s + M;
  const int group = warpgroup_index(), warp = (threadIdx.x / 32) % 4;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * M;  // heaviest causal tiles first
  const long long base = (long long)blockIdx.y * seq_len * D;
  const long long sbase = (long long)blockIdx.y * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  const int rl = group * 64 + warp * 16 + ((threadIdx.x & 31) >> 2);  // this lane's first row
  const int last = imin(q0 + M, seq_len) - 1;
  const int n_tiles = last / N + 1;
  const T_* const qg = qs + group * 8 * ROW8;  // this warpgroup's 64 rows
  const T_* const dog = dos + group * 8 * ROW8;

  load_tile_cm_async<T_, D, M, 32 * W>(qs, q + base, q0, seq_len);  // joins the first group
  load_tile_cm_async<T_, D, M, 32 * W>(dos, dout + base, q0, seq_len);
  // seen past a barrier
  load_stats<M, 32 * W>(lse_s, delta_s, lse + sbase, delta + sbase, q0, seq_len);
  const auto load_kv = [&](int stage, int tile) {
    load_tile_cm_async<T_, D, N, 32 * W>(kv + stage * L::STAGE, k + base, tile * N, seq_len);
    load_tile_cm_async<T_, D, N, 32 * W>(kv + stage * L::STAGE + N * D, v + base,
                                         tile * N, seq_len);
  };
  // Descriptors: this warpgroup's Q and dO, and stage 0's K (each way it is read) and V, once;
  // a tile's stage is an add on (L::at_stage).
  const u64 q_desc = kmajor_desc<D>(qg), do_desc = kmajor_desc<D>(dog);
  const u64 k_desc = kmajor_desc<D>(kv), v_desc = kmajor_desc<D>(kv + N * D);
  const u64 k_mn_desc = mn_major_desc<D>(kv);
  pipe_prologue<STAGES, LAG>(n_tiles, load_kv);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float s[N / 8][4], dp[N / 8][4];  // a tile's S and dP, then its dS in s
  u32 dsf[N / 16][4];                // dS as A fragments
  const auto issue_s_dp = [&](int it) {  // S = Q K^T, dP = dO V^T of tile it, once landed
    pipe_advance<STAGES, true, LAG>(it, n_tiles, load_kv);
    issue_two_products<T_, D, N>(s, q_desc, L::at_stage(k_desc, it), dp, do_desc,
                                 L::at_stage(v_desc, it));
    wgmma_commit();
  };
  const auto ds = [&](int it) {  // tile it's S and dP have landed: dS, as A fragments
    wgmma_fence_operands(flat(s));
    wgmma_fence_operands(flat(dp));
    p_ds<N>(s, dp, rl, q0, it * N, seq_len, lse_s, delta_s, sl2);
  };

  if constexpr (!OVERLAP) {
    for (int it = 0; it < n_tiles; ++it) {
      issue_s_dp(it);
      wgmma_wait<0>();
      ds(it);
      repack_a<T_, N>(dsf, s);
      wgmma_add_rs<T_, D, N>(acc, dsf, L::at_stage(k_mn_desc, it));  // dQ += dS K
    }
  } else {  // as the forward's: tile 0 alone, then tile it-1's dQ += dS K behind tile it's
    issue_s_dp(0);
    wgmma_wait<0>();
    ds(0);
    repack_a<T_, N>(dsf, s);
    for (int it = 1; it < n_tiles; ++it) {
      issue_s_dp(it);
      issue_add_rs<T_, D, N>(acc, dsf, L::at_stage(k_mn_desc, it - 1));
      wgmma_commit();
      wgmma_wait<1>();
      ds(it);
      wgmma_wait<0>();  // before dS's fragments are written again
      wgmma_fence_operands(flat(acc));
      repack_a<T_, N>(dsf, s);
    }
    wgmma_add_rs<T_, D, N>(acc, dsf, L::at_stage(k_mn_desc, n_tiles - 1));  // the last tile's
  }
  cp_async_wait<0>();
  store_rows<T_, D>(dq + base, acc, q0 + group * 64 + warp * 16, seq_len, scale, scale);
#endif
}

template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dq_wgmma(const T_* __restrict__ q, const T_* __restrict__ k,
                      const T_* __restrict__ v, const T_* __restrict__ dout,
                      const float* __restrict__ lse, const float* __restrict__ delta,
                      T_* __restrict__ dq, int seq_len, float scale) {
  dq_wgmma_body<T_, D, W, N, STAGES, false>(q, k, v, dout, lse, delta, dq, seq_len, scale);
}

template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dq_wgmma_overlap(const T_* __restrict__ q, const T_* __restrict__ k,
                              const T_* __restrict__ v, const T_* __restrict__ dout,
                              const float* __restrict__ lse, const float* __restrict__ delta,
                              T_* __restrict__ dq, int seq_len, float scale) {
  dq_wgmma_body<T_, D, W, N, STAGES, true>(q, k, v, dout, lse, delta, dq, seq_len, scale);
}

// dQ = scale * dS K on wgmma (attn_bwd_dq_ds's arithmetic): a warpgroup owns 64 queries, W/4
// of them a block, and streams N keys a tile (a dS tile of the block's rows and a K tile). Where
// a tile crosses the diagonal the entries above it are zeroed in shared memory first (the
// buffer there holds whatever was in it), then fenced to the async proxy. Launched as
// attn_bwd_dq_ds with the same (W, N, STAGES).
template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dq_ds_wgmma(const T_* __restrict__ k, const T_* __restrict__ ds,
                         T_* __restrict__ dq, int seq_len, int ds_stride, float scale) {
#if defined(ANDREA_WGMMA) || defined(ANDREA_EMULATOR)
  static_assert(UsesMma<T_>::value && 128 % N == 0, "bf16 or fp16; N divides 128");
  using L = HopperSmem<T_, D, KIND_DQ_DS, W, N, STAGES>;
  constexpr int M = L::M, ROW8_DS = N / 8 * 64, ROW8_K = D / 8 * 64;
  constexpr u32 CM_BYTES = 128;
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const tiles = (T_*)smem;  // stage s: dS at tiles + s*STAGE, K after it
  const int group = warpgroup_index(), warp = (threadIdx.x / 32) % 4;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * M;  // heaviest causal tiles first
  const long long base = (long long)blockIdx.y * seq_len * D;
  const T_* const ds_bh = ds + (long long)blockIdx.y * seq_len * ds_stride;
  const int last = imin(q0 + M, seq_len) - 1;
  const int n_tiles = last / N + 1;

  const auto load_ds_k = [&](int stage, int tile) {
    T_* const dst = tiles + stage * L::STAGE;
    load_block_cm_async<T_, M, N, 32 * W>(dst, ds_bh, ds_stride, q0, tile * N, seq_len);
    load_tile_cm_async<T_, D, N, 32 * W>(dst + M * N, k + base, tile * N, seq_len);
  };
  pipe_prologue<STAGES>(n_tiles, load_ds_k);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = it * N;
    T_* const dss = tiles + (it % STAGES) * L::STAGE;
    const T_* const kt = dss + M * N;
    pipe_advance<STAGES, true>(it, n_tiles, load_ds_k);
    if (n0 + N - 1 > q0) {  // the tile crosses the diagonal: keys after a row's query are no dS
      for (int i = threadIdx.x; i < M * N; i += blockDim.x)
        if (n0 + i % N > q0 + i / N) dss[cm_offset<N>(i / N, i % N)] = T_{};
      fence_proxy_async();  // the zeros (generic proxy) before wgmma reads them
      __syncthreads();      // barrier:dq-ds-wgmma-masked
    }
    wgmma_fence();
    wgmma_fence_operands(flat(acc));
    const u64 ds_desc = wgmma_desc(dss + group * 8 * ROW8_DS, CM_BYTES, ROW8_DS * 2);
    const u64 k_desc = wgmma_desc(kt, ROW8_K * 2, CM_BYTES);
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
      wgmma_ss<T_, D, true>(flat(acc), desc_advance(ds_desc, kk * 256),
                            desc_advance(k_desc, kk * 2 * ROW8_K * 2), 1);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(flat(acc));
  }
  cp_async_wait<0>();
  store_rows<T_, D>(dq + base, acc, q0 + group * 64 + warp * 16, seq_len, scale, scale);
#endif
}
