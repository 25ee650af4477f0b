// attn_forward.cuh - the production forward, attn_fwd. Part of microgpt_cuda.cu, after
// attn_common.cuh and attn_tiles.cuh.

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

  load_tile<T_, D, M, 32 * S::W>(sm.a[0], q + base, q0, seq_len);
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m_run[2] = {-inf_f(), -inf_f()}, l_run[2] = {0.0f, 0.0f};
  const int row_base = q0 + warp * 16 + g;
  const int last = imin(q0 + M, seq_len) - 1;  // causal: no key past the block's last query

  for (int n0 = 0; n0 <= last; n0 += N) {
    __syncthreads();  // barrier:fwd-reuse (every warp is done with the previous K/V tile)
    load_tile<T_, D, N, 32 * S::W>(sm.b[0], k + base, n0, seq_len);
    load_tile<T_, D, N, 32 * S::W>(sm.b[1], v + base, n0, seq_len);
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
