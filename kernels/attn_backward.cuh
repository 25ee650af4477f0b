// attn_backward.cuh - the production backward: attn_bwd_preprocess, attn_bwd_dq,
// attn_bwd_dkdv. Part of microgpt_cuda.cu, after attn_common.cuh and attn_tiles.cuh.

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

  load_tile<T_, D, M, 32 * S::W>(sm.a[0], q + base, q0, seq_len);
  load_tile<T_, D, M, 32 * S::W>(sm.a[1], dout + base, q0, seq_len);
  load_stats<M, 32 * S::W>(sm.lse, sm.delta, lse + sbase, delta + sbase, q0, seq_len);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const int rl = warp * 16 + g;  // this lane's first row within the block tile
  const int last = imin(q0 + M, seq_len) - 1;

  for (int n0 = 0; n0 <= last; n0 += N) {
    __syncthreads();  // barrier:dq-reuse
    load_tile<T_, D, N, 32 * S::W>(sm.b[0], k + base, n0, seq_len);
    load_tile<T_, D, N, 32 * S::W>(sm.b[1], v + base, n0, seq_len);
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

  load_tile<T_, D, M, 32 * S::W>(sm.a[0], k + base, k0, seq_len);
  load_tile<T_, D, M, 32 * S::W>(sm.a[1], v + base, k0, seq_len);
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk_acc[j][i] = dv_acc[j][i] = 0.0f;
  const int key_base = k0 + warp * 16 + g;
  float* scratch = sm.scratch + warp * 16 * (N + 4);

  for (int n0 = (k0 / N) * N; n0 < seq_len; n0 += N) {
    __syncthreads();  // barrier:dkdv-reuse
    load_tile<T_, D, N, 32 * S::W>(sm.b[0], q + base, n0, seq_len);
    load_tile<T_, D, N, 32 * S::W>(sm.b[1], dout + base, n0, seq_len);
    load_stats<N, 32 * S::W>(sm.lse, sm.delta, lse + sbase, delta + sbase, n0, seq_len);
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
