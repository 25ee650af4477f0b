// attn_tiles.cuh - the production kernels' tile table (attn_fwd, attn_bwd_dq, attn_bwd_dkdv):
// tile shape, launch-bounds promise, dK/dV passes and the static shared-memory layout. Part of
// microgpt_cuda.cu, after attn_common.cuh. The table's home is andrea/cuda/launch.py (TILES,
// PRODUCTION_MIN_BLOCKS, PRODUCTION_PASSES): change both, or
// tests/test_kernel_numerics.py::test_launch_config_matches_the_kernel_file fails.

// W warps per block (block owns M = 16*W rows), N rows per streamed tile. All shared memory is
// static and stays under the 48 KiB that needs no opt-in.
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
// bf16 and fp16 D=32 forward on sm_86 and sm_89 (100 KiB of shared memory: 6 blocks) went to
// 80 registers and spilled 8 bytes once P was packed by one cvt a pair (it needs 81; 77-80 on
// sm_80 and sm_90); 5 blocks (102 registers) keep it whole everywhere.
template <> struct MinBlocks<bf16_t, 32, KIND_FWD> { static constexpr int value = 5; };
template <> struct MinBlocks<half_t, 32, KIND_FWD> {
  static constexpr int value = ANDREA_HALF_PATH >= 800 ? 5 : 0;
};

// attn_bwd_dkdv takes a streamed tile's N query columns in this many passes: the score and dP
// fragments of a pass (2 x N/8 x 4 floats per lane when 1) are live beside both D-wide
// accumulators, and halving them is what lets bf16 D=64 fit 168 registers without spills.
template <typename T_, int D> struct DkdvPasses { static constexpr int value = 1; };
template <> struct DkdvPasses<bf16_t, 64> { static constexpr int value = 2; };
template <> struct DkdvPasses<half_t, 64> { static constexpr int value = 2; };

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
