// attn_pipe.cuh - the pipelined candidates attn_fwd_pipe, attn_bwd_dq_pipe and
// attn_bwd_dkdv_pipe: the production kernels (attn_forward.cuh, attn_backward.cuh) with the tile
// shape as template parameters (W warps, N streamed rows), dynamic shared memory (PipeSmem), MINB
// for __launch_bounds__ and a STAGES-deep cp.async pipeline over the streamed tiles: with
// STAGES >= 2 tile it+STAGES-1 loads while tile it multiplies, one barrier per tile; STAGES 1
// is the production kernels' synchronous load between two barriers. Per output row the
// arithmetic is the production kernels' for the same N (W and STAGES change only who owns a row
// and when a tile arrives), so with N equal they give the same bits. Launch: as the production
// kernel, with M = 16*W, 32*W threads and PipeSmem::bytes of dynamic shared memory
// (andrea.cuda.launch.pipe_launch). The forward keeps its warp's Q fragments in registers on
// tensor cores (loaded once, not once per K tile). Candidates for
// scripts/gpu_tune_attention.py; the production path launches the kernels of TILES. Part of
// microgpt_cuda.cu, after attn_common.cuh; its backward takes delta from attn_backward.cuh's
// attn_bwd_preprocess.

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

// The pipeline over a kernel's n_tiles streamed tiles, shared by every pipelined kernel.
// load(stage, tile) issues tile `tile`'s cp.async copies into stage `stage`'s buffers.
// pipe_prologue issues tiles 0..STAGES-2, one commit group each (empty past the last tile, so
// group i always holds tile i); pipe_advance, before tile it is used, makes it visible to the
// whole block and issues tile it+STAGES-1 into the stage tile it-1 used. With STAGES 1 it is the
// production kernels' synchronous load between two barriers. WGMMA_READS: the tiles are read by
// wgmma (attn_hopper.cuh), which reads shared memory through the async proxy, so each thread
// fences its landed copies (generic proxy) to it before the barrier. LAG 1: a tile is still read
// during the next tile's iteration (the overlapped wgmma kernels' product of the tile before),
// so the stage refilled is tile it-2's and the pipeline runs STAGES-1 tiles ahead, not STAGES.
template <int STAGES, int LAG = 0, typename Load>
__device__ __forceinline__ void pipe_prologue(int n_tiles, const Load& load) {
  static_assert(LAG == 0 || STAGES >= LAG + 2, "a stage for each tile still read, one ahead");
#pragma unroll
  for (int s = 0; s < STAGES - 1 - LAG; ++s) {
    if (s < n_tiles) load(s, s);
    cp_async_commit();
  }
}

template <int STAGES, bool WGMMA_READS = false, int LAG = 0, typename Load>
__device__ __forceinline__ void pipe_advance(int it, int n_tiles, const Load& load) {
  if constexpr (STAGES == 1) {
    __syncthreads();  // barrier:pipe-reuse (every warp is done with tile it-1)
    load(0, it);
    cp_async_commit();
    cp_async_wait<0>();
    if constexpr (WGMMA_READS) fence_proxy_async();
    __syncthreads();  // barrier:pipe-loaded
  } else {
    cp_async_wait<STAGES - 2 - LAG>();  // this thread's copies of tile it have landed
    if constexpr (WGMMA_READS) fence_proxy_async();
    __syncthreads();  // barrier:pipe (everyone's have; everyone is done with tile it-1-LAG)
    const int nx = it + STAGES - 1 - LAG;
    if (nx < n_tiles) load(nx % STAGES, nx);
    cp_async_commit();
  }
}

// One streamed tile of the forward's online softmax, for a warp's rows row_base (g) and
// row_base + 8 (the lanes of a C fragment): the tile's raw scores s (keys n0..n0+N-1), masked
// where `masked` (the causal diagonal or the sequence's end cross the tile), l_run rescaled to
// the new running max of the scores in base 2 (s * sl2) and the factor left in corr for the
// output rows (rescale_rows), and P = exp2(s * sl2 - max) left in s, its row sums added to
// l_run. The max is taken of the raw scores and scaled once (rounding is monotonic, so it is the
// max of the scaled ones), and P's exponent is one fused multiply-add on the GPU instead of a
// product kept for the max and a difference: 32 instructions a tile fewer. The emulator (no
// contraction) rounds the product and the difference apart, as before. The output rows are
// rescaled apart so that the overlapped wgmma forward can do it once the product of the tile
// before, in flight meanwhile, has landed in them; online_softmax_tile does both at once.
template <int N>
__device__ __forceinline__ void online_softmax_scores(float (&s)[N / 8][4], float (&m_run)[2],
                                                      float (&l_run)[2], float (&corr)[2],
                                                      int row_base, int n0, bool masked,
                                                      int seq_len, float sl2) {
  const int t = threadIdx.x & 3;
  float mx[2] = {-inf_f(), -inf_f()};
  if (masked) {
    // Column n0 + 2t + c is hidden from a row past min(row, seq_len - 1): per row one limit on
    // c, which is a constant of each score's place (j * 8 + (i & 1)), so a score's mask is one
    // compare with a constant.
    const int limit[2] = {imin(row_base, seq_len - 1) - n0 - 2 * t,
                          imin(row_base + 8, seq_len - 1) - n0 - 2 * t};
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (j * 8 + (i & 1) > limit[i >> 1]) s[j][i] = -inf_f();
  }
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) mx[i >> 1] = fmaxf(mx[i >> 1], s[j][i]);
  float shift[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_new = fmaxf(m_run[h], quad_max(mx[h]) * sl2);
    shift[h] = m_new == -inf_f() ? 0.0f : m_new;  // a row with nothing visible yet
    corr[h] = exp2f(m_run[h] - shift[h]);
    l_run[h] *= corr[h];
    m_run[h] = m_new;
  }
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float p = exp2f(s[j][i] * sl2 - shift[i >> 1]);
      s[j][i] = p;
      l_run[i >> 1] += p;
    }
}

// A warp's two rows of the output (C fragments) times their factors.
template <int D>
__device__ __forceinline__ void rescale_rows(float (&acc)[D / 8][4], const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    acc[j][0] *= corr[0];
    acc[j][1] *= corr[0];
    acc[j][2] *= corr[1];
    acc[j][3] *= corr[1];
  }
}

template <int N, int D>
__device__ __forceinline__ void online_softmax_tile(float (&s)[N / 8][4], float (&acc)[D / 8][4],
                                                    float (&m_run)[2], float (&l_run)[2],
                                                    int row_base, int n0, bool masked,
                                                    int seq_len, float sl2) {
  float corr[2];
  online_softmax_scores<N>(s, m_run, l_run, corr, row_base, n0, masked, seq_len, sl2);
  rescale_rows<D>(acc, corr);
}

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

  const auto load_kv = [&](int stage, int tile) {
    load_tile_async<T_, D, N, 32 * W>(kv + 2 * stage * L::TILE_N, k + base, tile * N, seq_len);
    load_tile_async<T_, D, N, 32 * W>(kv + (2 * stage + 1) * L::TILE_N, v + base,
                                      tile * N, seq_len);
  };
  load_tile_async<T_, D, M, 32 * W>(qs, q + base, q0, seq_len);  // joins the first group
  pipe_prologue<STAGES>(n_tiles, load_kv);
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
    pipe_advance<STAGES>(it, n_tiles, load_kv);

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

    online_softmax_tile<N, D>(s, acc, m_run, l_run, row_base, n0,
                              n0 + N - 1 > q0 || n0 + N > seq_len, seq_len, sl2);
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

// dS = P o (dP - delta) in place of S, for a warp's rows rl (g) and rl + 8 of the block's from
// q0, against the N keys of the tile from n0 (lse_s, delta_s: the block's statistics by row).
// Zero where the key comes after the query or past the sequence. The pipelined dQ kernels and
// attn_bwd_dq_wgmma share it (attn_bwd_dq has the same steps inline, its machine code kept as
// measured); transposed_p_ds is its twin for dK/dV. A thread's two rows' statistics are read
// once, and a tile its rows see whole (below the diagonal, inside the sequence) skips the mask:
// the same arithmetic either way, so the same bits.
template <int N>
__device__ __forceinline__ void p_ds(float (&s)[N / 8][4], const float (&dp)[N / 8][4], int rl,
                                     int q0, int n0, int seq_len, const float* lse_s,
                                     const float* delta_s, float sl2) {
  const int t = threadIdx.x & 3;
  const float lse2[2] = {lse_s[rl] * ANDREA_LOG2E, lse_s[rl + 8] * ANDREA_LOG2E};
  const float dl[2] = {delta_s[rl], delta_s[rl + 8]};
  if (n0 + N - 1 <= q0 + rl && n0 + N <= seq_len) {  // every key visible to both rows
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = exp2f(s[j][i] * sl2 - lse2[i >> 1]);
        s[j][i] = p * (dp[j][i] - dl[i >> 1]);
      }
    return;
  }
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = q0 + rl + (i >= 2 ? 8 : 0), col = n0 + j * 8 + 2 * t + (i & 1);
      const bool visible = col <= row && col < seq_len;
      const float p = visible ? exp2f(s[j][i] * sl2 - lse2[i >> 1]) : 0.0f;
      s[j][i] = p * (dp[j][i] - dl[i >> 1]);
    }
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
  const int warp = threadIdx.x / 32, g = (threadIdx.x & 31) >> 2;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * M;
  const long long base = (long long)blockIdx.y * seq_len * D;
  const long long sbase = (long long)blockIdx.y * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  const int rl = warp * 16 + g;
  const int last = imin(q0 + M, seq_len) - 1;
  const int n_tiles = last / N + 1;

  load_tile_async<T_, D, M, 32 * W>(qs, q + base, q0, seq_len);
  load_tile_async<T_, D, M, 32 * W>(dos, dout + base, q0, seq_len);
  // seen past a barrier
  load_stats<M, 32 * W>(lse_s, delta_s, lse + sbase, delta + sbase, q0, seq_len);
  const auto load_kv = [&](int stage, int tile) {
    load_tile_async<T_, D, N, 32 * W>(kv + 2 * stage * L::TILE_N, k + base, tile * N, seq_len);
    load_tile_async<T_, D, N, 32 * W>(kv + (2 * stage + 1) * L::TILE_N, v + base,
                                      tile * N, seq_len);
  };
  pipe_prologue<STAGES>(n_tiles, load_kv);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = it * N;
    const T_* ks = kv + 2 * (it % STAGES) * L::TILE_N;
    const T_* vs = ks + L::TILE_N;
    pipe_advance<STAGES>(it, n_tiles, load_kv);

    float s[N / 8][4], dp[N / 8][4];
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = dp[j][i] = 0.0f;
    warp_gemm_ss<T_, D, N / 8, true>(s, qs + warp * 16 * LD, LD, ks, LD);
    warp_gemm_ss<T_, D, N / 8, true>(dp, dos + warp * 16 * LD, LD, vs, LD);
    p_ds<N>(s, dp, rl, q0, n0, seq_len, lse_s, delta_s, sl2);
    warp_gemm_rs<T_, N / 8, D / 8>(acc, s, scratch, ks, LD);
  }
  cp_async_wait<0>();
  store_rows<T_, D>(dq + base, acc, q0 + warp * 16, seq_len, scale, scale);
}

// P^T and dS^T = P^T o (dP^T - delta) in place of S^T and dP^T, for a warp's keys key_base (its
// row g) and key_base + 8 against NP streamed query columns c0.. of the tile of queries from n0
// (lse_s, delta_s: the tile's statistics by column). Zero where the key comes after the query
// or the query is past the sequence (whose statistics may be zero-filled). The pipelined dK/dV
// kernels and attn_bwd_dkdv_ds_wgmma share it (attn_bwd_dkdv has the same steps inline, its
// machine code kept as measured). The statistics of a thread's NP/4 columns are read once (not
// per key row, behind the mask), and columns its keys see whole skip the mask, as p_ds.
template <int NP>
__device__ __forceinline__ void transposed_p_ds(float (&st)[NP / 8][4], float (&dpt)[NP / 8][4],
                                                int key_base, int n0, int c0, int seq_len,
                                                const float* lse_s, const float* delta_s,
                                                float sl2) {
  const int t = threadIdx.x & 3;
  float lse2[NP / 8][2], dl[NP / 8][2];  // by column: j, and i & 1
#pragma unroll
  for (int j = 0; j < NP / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = c0 + j * 8 + 2 * t + e;
      lse2[j][e] = lse_s[c] * ANDREA_LOG2E;
      dl[j][e] = delta_s[c];
    }
  if (key_base + 8 <= n0 + c0 && n0 + c0 + NP <= seq_len) {  // every query sees both keys
#pragma unroll
    for (int j = 0; j < NP / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = exp2f(st[j][i] * sl2 - lse2[j][i & 1]);
        st[j][i] = p;
        dpt[j][i] = p * (dpt[j][i] - dl[j][i & 1]);
      }
    return;
  }
#pragma unroll
  for (int j = 0; j < NP / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = key_base + (i >= 2 ? 8 : 0);
      const int col = n0 + c0 + j * 8 + 2 * t + (i & 1);
      const bool visible = key <= col && col < seq_len;
      const float p = visible ? exp2f(st[j][i] * sl2 - lse2[j][i & 1]) : 0.0f;
      st[j][i] = p;
      dpt[j][i] = p * (dpt[j][i] - dl[j][i & 1]);
    }
}

// dS^T's fragment (dpt: a warp's keys key_base (g) and key_base + 8 against NP queries from
// col0) stored as dS into one (batch, head)'s [T, ds_stride] buffer: lanes of one t write 8
// consecutive keys of a query row. Keys up to the block's last (< ds_stride, a multiple of the
// block's keys); zeros where masked. The pipelined and the wgmma dK/dV through dS share it.
template <typename T_, int NP>
__device__ __forceinline__ void store_ds(T_* ds_bh, const float (&dpt)[NP / 8][4], int key_base,
                                         int col0, int ds_stride, int seq_len) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < NP / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = key_base + (i >= 2 ? 8 : 0), col = col0 + j * 8 + 2 * t + (i & 1);
      if (col < seq_len)  // bounds: dS has a row per query of the sequence
        ds_bh[(long long)col * ds_stride + key] = from_float<T_>(dpt[j][i]);
    }
}

// The body of attn_bwd_dkdv_pipe and attn_bwd_dkdv_ds: with WRITE_DS it also stores each dS
// element it computes (unscaled, rounded to T_ as the dK product rounds it) at
// ds[bh][query][key], row stride ds_stride.
template <typename T_, int D, int W, int N, int STAGES, int PASSES, bool WRITE_DS>
__device__ __forceinline__ void dkdv_pipe_body(
    const T_* __restrict__ q, const T_* __restrict__ k, const T_* __restrict__ v,
    const T_* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
    T_* __restrict__ dk, T_* __restrict__ dv, T_* __restrict__ ds, int ds_stride, int seq_len,
    float scale) {
  using L = PipeSmem<T_, D, KIND_DKDV, W, N, STAGES>;
  constexpr int M = L::M, LD = L::LD, NP = N / PASSES;
  static_assert(!WRITE_DS || 128 % M == 0, "the dS row stride must hold the last block's keys");
  static_assert(N % PASSES == 0 && NP % 16 == 0, "each pass takes a multiple of 16 columns");
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const ks = (T_*)smem;
  T_* const vs = ks + M * LD;
  T_* const qd = (T_*)(smem + L::B);  // stage s: Q at qd + 2s*TILE_N, dO after it
  float* const stats = (float*)(smem + L::STATS);  // stage s: lse at stats + 2sN, delta after
  float* const scratch = (float*)(smem + L::SCRATCH) + (threadIdx.x / 32) * 16 * (N + 4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2;
  const int k0 = blockIdx.x * M;
  const long long base = (long long)blockIdx.y * seq_len * D;
  const long long sbase = (long long)blockIdx.y * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  const int first = k0 / N;  // query tiles before it see none of these keys
  const int n_tiles = (seq_len + N - 1) / N - first;

  load_tile_async<T_, D, M, 32 * W>(ks, k + base, k0, seq_len);
  load_tile_async<T_, D, M, 32 * W>(vs, v + base, k0, seq_len);
  const auto load_qdo = [&](int stage, int tile) {
    const int n0 = (first + tile) * N;
    load_tile_async<T_, D, N, 32 * W>(qd + 2 * stage * L::TILE_N, q + base, n0, seq_len);
    load_tile_async<T_, D, N, 32 * W>(qd + (2 * stage + 1) * L::TILE_N, dout + base, n0, seq_len);
    load_stats_async<N, 32 * W>(stats + 2 * stage * N, stats + (2 * stage + 1) * N, lse + sbase,
                        delta + sbase, n0, seq_len);
  };
  pipe_prologue<STAGES>(n_tiles, load_qdo);
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
    pipe_advance<STAGES>(it, n_tiles, load_qdo);

    for (int c0 = 0; c0 < N; c0 += NP) {
      float st[NP / 8][4], dpt[NP / 8][4];
#pragma unroll
      for (int j = 0; j < NP / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) st[j][i] = dpt[j][i] = 0.0f;
      warp_gemm_ss<T_, D, NP / 8, true>(st, ks + warp * 16 * LD, LD, qs + c0 * LD, LD);
      warp_gemm_ss<T_, D, NP / 8, true>(dpt, vs + warp * 16 * LD, LD, dos + c0 * LD, LD);
      transposed_p_ds<NP>(st, dpt, key_base, n0, c0, seq_len, lse_s, delta_s, sl2);
      if constexpr (WRITE_DS)
        store_ds<T_, NP>(ds + (long long)blockIdx.y * seq_len * ds_stride, dpt, key_base,
                         n0 + c0, ds_stride, seq_len);
      warp_gemm_rs<T_, NP / 8, D / 8>(dv_acc, st, scratch, dos + c0 * LD, LD);
      warp_gemm_rs<T_, NP / 8, D / 8>(dk_acc, dpt, scratch, qs + c0 * LD, LD);
    }
  }
  cp_async_wait<0>();
  store_rows<T_, D>(dk + base, dk_acc, k0 + warp * 16, seq_len, scale, scale);
  store_rows<T_, D>(dv + base, dv_acc, k0 + warp * 16, seq_len, 1.0f, 1.0f);
}

template <typename T_, int D, int W, int N, int STAGES, int MINB, int PASSES>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dkdv_pipe(const T_* __restrict__ q, const T_* __restrict__ k,
                       const T_* __restrict__ v, const T_* __restrict__ dout,
                       const float* __restrict__ lse, const float* __restrict__ delta,
                       T_* __restrict__ dk, T_* __restrict__ dv, int seq_len, float scale) {
  dkdv_pipe_body<T_, D, W, N, STAGES, PASSES, false>(q, k, v, dout, lse, delta, dk, dv, nullptr,
                                                     0, seq_len, scale);
}

// ------------------------------------------------------------- the backward through dS
// Five tile products instead of seven, deterministic: attn_bwd_dkdv_ds is attn_bwd_dkdv_pipe
// that also writes dS = P o (dP - delta) to a [B*H, T, ds_stride] buffer (ds_stride: T rounded
// up to 128, andrea.cuda.launch.ds_row_stride), and attn_bwd_dq_ds takes dQ = scale * dS K from
// it, so S and dP are computed once per tile pair instead of once in each kernel. Each element
// of dS is written by one thread and read after the kernel boundary: no atomics. The price is
// the buffer (2 bytes a score in bf16, most of the half above the diagonal never touched) and its
// traffic. dq_ds zeroes the dS entries above the diagonal in shared memory (the buffer there
// holds whatever was in it), so it needs no cleared buffer.
template <typename T_, int D, int W, int N, int STAGES, int MINB, int PASSES>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dkdv_ds(const T_* __restrict__ q, const T_* __restrict__ k,
                     const T_* __restrict__ v, const T_* __restrict__ dout,
                     const float* __restrict__ lse, const float* __restrict__ delta,
                     T_* __restrict__ dk, T_* __restrict__ dv, T_* __restrict__ ds, int seq_len,
                     int ds_stride, float scale) {
  dkdv_pipe_body<T_, D, W, N, STAGES, PASSES, true>(q, k, v, dout, lse, delta, dk, dv, ds,
                                                    ds_stride, seq_len, scale);
}

// Dynamic shared memory of attn_bwd_dq_ds (andrea.cuda.launch's pipe_shared_bytes mirrors
// `bytes`): per stage a dS tile (M query rows x N keys, row stride LDS) and a K tile (N x LD).
template <typename T_, int D, int W, int N, int STAGES> struct DsSmem {
  static constexpr int M = 16 * W, LD = Ld<T_, D>::value, LDS = N + 16 / (int)sizeof(T_);
  static constexpr int STAGE = M * LDS + N * LD;  // elements
  static constexpr int bytes = STAGES * STAGE * (int)sizeof(T_);
  static_assert(STAGES >= 1 && N % 16 == 0 && 128 % N == 0 && W >= 1,
                "N of 16s dividing 128, the dS row stride's multiple: a key tile ends in a row");
};

template <typename T_, int D, int W, int N, int STAGES, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_dq_ds(const T_* __restrict__ k, const T_* __restrict__ ds, T_* __restrict__ dq,
                   int seq_len, int ds_stride, float scale) {
  using L = DsSmem<T_, D, W, N, STAGES>;
  constexpr int M = L::M, LD = L::LD, LDS = L::LDS;
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const tiles = (T_*)smem;  // stage s: dS at tiles + s*STAGE, K after it
  const int warp = threadIdx.x / 32;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * M;  // heaviest causal tiles first
  const long long base = (long long)blockIdx.y * seq_len * D;
  const T_* const ds_bh = ds + (long long)blockIdx.y * seq_len * ds_stride;
  const int last = imin(q0 + M, seq_len) - 1;
  const int n_tiles = last / N + 1;

  const auto load_ds_k = [&](int stage, int tile) {
    T_* const dst = tiles + stage * L::STAGE;
    load_block_async<T_, M, N, LDS, 32 * W>(dst, ds_bh, ds_stride, q0, tile * N, seq_len);
    load_tile_async<T_, D, N, 32 * W>(dst + M * LDS, k + base, tile * N, seq_len);
  };
  pipe_prologue<STAGES>(n_tiles, load_ds_k);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = it * N;
    T_* const dss = tiles + (it % STAGES) * L::STAGE;
    const T_* const ks = dss + M * LDS;
    pipe_advance<STAGES>(it, n_tiles, load_ds_k);
    if (n0 + N - 1 > q0) {  // the tile crosses the diagonal: keys after a row's query are no dS
      for (int i = threadIdx.x; i < M * N; i += blockDim.x)
        if (n0 + i % N > q0 + i / N) dss[i / N * LDS + i % N] = T_{};
      __syncthreads();  // barrier:dq-ds-masked
    }
    warp_gemm_ss<T_, N, D / 8, false>(acc, dss + warp * 16 * LDS, LDS, ks, LD);
  }
  cp_async_wait<0>();
  store_rows<T_, D>(dq + base, acc, q0 + warp * 16, seq_len, scale, scale);
}

// ------------------------------------------------------ a whole head's backward in one block
// For short sequences, where every backend is far from the chip's rate (the 12M preset's 256
// positions at head_dim 32): one block per (batch, head) holds Q, dO, K, V, lse and delta of the
// whole sequence and the T x T dS in shared memory, so the five tile products run in one kernel,
// with no dS in global memory, no second pass over the inputs and no atomics. Phase 1: each
// warp takes 16-key blocks (a snake order pairs the heavy first blocks with the light last
// ones) and streams their query chunks of N columns as dK/dV does (P^T, dS^T, dV += P^T dO,
// dK += dS^T Q), storing dS. Phase 2, after one barrier: each warp takes 16-query blocks and
// adds dQ = scale * dS K over the keys up to its diagonal. dS is rounded to the element type as
// the production dQ product rounds it, and each sum runs in the production kernels' order, so
// with N the production dK/dV's column pass it gives their bits. Shared memory grows with T
// (FusedSmem::bytes): in bf16 on sm_90 (227 KiB) up to 256 positions at head_dim 32 and 192 at
// 64 (andrea.cuda.launch.pipe_shared_bytes; the launch refuses longer ones).

// Dynamic shared memory of attn_bwd_fused for a sequence of seq_len (byte offsets): Q, dO, K, V
// (rows x LD each), dS (rows x lds), then lse and delta (rows floats each) and fp32's scratch.
template <typename T_, int D, int W, int N> struct FusedSmem {
  static constexpr int LD = Ld<T_, D>::value, PAD = 16 / (int)sizeof(T_);
  static constexpr int SCRATCH_FLOATS = IsFloat<T_>::value ? W * 16 * (N + 4) : 0;
  static_assert(N % 16 == 0 && W >= 1, "query chunks of 16s");
  // the sequence padded to whole query chunks, so that every chunk phase 1 reads lies inside
  __host__ __device__ static constexpr int rows(int seq_len) { return (seq_len + N - 1) / N * N; }
  __host__ __device__ static constexpr int lds(int seq_len) { return rows(seq_len) + PAD; }
  __host__ __device__ static constexpr int stats(int seq_len) {
    return (4 * rows(seq_len) * LD + rows(seq_len) * lds(seq_len)) * (int)sizeof(T_);
  }
  __host__ __device__ static constexpr int bytes(int seq_len) {
    return stats(seq_len) + 4 * (2 * rows(seq_len) + SCRATCH_FLOATS);
  }
};

// The i-th 16-row block of a warp when W warps take ceil(T/16) blocks in a snake order: warp w
// takes w, 2W-1-w, 2W+w, 4W-1-w, ...; increasing in i, so a warp stops at its first one past T.
template <int W> __device__ __forceinline__ int snake_block(int i, int warp) {
  return i * W + (i % 2 ? W - 1 - warp : warp);
}

template <typename T_, int D, int W, int N, int MINB>
__global__ void __launch_bounds__(32 * W, MINB)
    attn_bwd_fused(const T_* __restrict__ q, const T_* __restrict__ k, const T_* __restrict__ v,
                   const T_* __restrict__ dout, const float* __restrict__ lse,
                   const float* __restrict__ delta, T_* __restrict__ dq, T_* __restrict__ dk,
                   T_* __restrict__ dv, int seq_len, float scale) {
  using L = FusedSmem<T_, D, W, N>;
  constexpr int LD = L::LD;
  const int rows = L::rows(seq_len), lds = L::lds(seq_len);
  ANDREA_DYNAMIC_SHARED(smem);
  T_* const qs = (T_*)smem;
  T_* const dos = qs + rows * LD;
  T_* const ks = dos + rows * LD;
  T_* const vs = ks + rows * LD;
  T_* const dss = vs + rows * LD;  // dS[query][key], row stride lds
  float* const lse_s = (float*)(smem + L::stats(seq_len));
  float* const delta_s = lse_s + rows;
  float* const scratch = delta_s + rows + (threadIdx.x / 32) * 16 * (N + 4);
  const int warp = threadIdx.x / 32, g = (threadIdx.x & 31) >> 2;
  const long long base = (long long)blockIdx.y * seq_len * D;
  const long long sbase = (long long)blockIdx.y * seq_len;
  const float sl2 = scale * ANDREA_LOG2E;
  const int blocks = (seq_len + 15) / 16;

  for (int r0 = 0; r0 < rows; r0 += N) {  // rows past the sequence land as zeros
    load_tile_async<T_, D, N, 32 * W>(qs + r0 * LD, q + base, r0, seq_len);
    load_tile_async<T_, D, N, 32 * W>(dos + r0 * LD, dout + base, r0, seq_len);
    load_tile_async<T_, D, N, 32 * W>(ks + r0 * LD, k + base, r0, seq_len);
    load_tile_async<T_, D, N, 32 * W>(vs + r0 * LD, v + base, r0, seq_len);
    load_stats_async<N, 32 * W>(lse_s + r0, delta_s + r0, lse + sbase, delta + sbase, r0, seq_len);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();  // barrier:fused-loaded

  // Phase 1: dK and dV of a warp's key blocks; dS of every (query, key) at or below the diagonal
  for (int i = 0;; ++i) {
    const int kb = snake_block<W>(i, warp);
    if (kb >= blocks) break;
    const int k0 = kb * 16;
    float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk_acc[j][e] = dv_acc[j][e] = 0.0f;
    for (int c0 = k0 / N * N; c0 < seq_len; c0 += N) {  // chunks before k0 / N see none
      float st[N / 8][4], dpt[N / 8][4];
#pragma unroll
      for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.0f;
      warp_gemm_ss<T_, D, N / 8, true>(st, ks + k0 * LD, LD, qs + c0 * LD, LD);
      warp_gemm_ss<T_, D, N / 8, true>(dpt, vs + k0 * LD, LD, dos + c0 * LD, LD);
      transposed_p_ds<N>(st, dpt, k0 + g, c0, 0, seq_len, lse_s + c0, delta_s + c0, sl2);
      store_ds<T_, N>(dss, dpt, k0 + g, c0, lds, rows);  // zeros past the sequence too
      warp_gemm_rs<T_, N / 8, D / 8>(dv_acc, st, scratch, dos + c0 * LD, LD);
      warp_gemm_rs<T_, N / 8, D / 8>(dk_acc, dpt, scratch, qs + c0 * LD, LD);
    }
    store_rows<T_, D>(dk + base, dk_acc, k0, seq_len, scale, scale);
    store_rows<T_, D>(dv + base, dv_acc, k0, seq_len, 1.0f, 1.0f);
  }
  __syncthreads();  // barrier:fused-ds (every warp's dS is written)

  // Phase 2: dQ of a warp's query blocks, over the keys up to the block's diagonal (dS there
  // holds zeros above it)
  for (int i = 0;; ++i) {
    const int qb = snake_block<W>(i, warp);
    if (qb >= blocks) break;
    const int q0 = qb * 16;
    float acc[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int j0 = 0; j0 <= q0; j0 += 16)
      warp_gemm_ss<T_, 16, D / 8, false>(acc, dss + q0 * lds + j0, lds, ks + j0 * LD, LD);
    store_rows<T_, D>(dq + base, acc, q0, seq_len, scale, scale);
  }
}
