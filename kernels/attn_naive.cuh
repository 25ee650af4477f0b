// attn_naive.cuh - the naive baseline: attn_fwd_naive, attn_bwd_dq_naive, attn_bwd_dkdv_naive.
// Part of microgpt_cuda.cu, after attn_common.cuh (its backward takes delta from
// attn_backward.cuh's attn_bwd_preprocess).

// A speed reference for the tiled kernels (andrea bench's cuda_naive), not used for training:
// one block per (batch, head), its threads loop over rows,
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
