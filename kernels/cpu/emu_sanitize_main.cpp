// emu_sanitize_main.cpp - a standalone program for the sanitizer builds of the emulated kernels
// (-fsanitize=thread / address): every buffer is its own exactly sized heap allocation, so an
// out-of-bounds access lands in a redzone, and the block's threads are OS threads, which
// ThreadSanitizer tracks. Runs forward + backward once for ANDREA_SAN_TYPE / ANDREA_SAN_D.
// With ANDREA_SAN_PIPE_W (and _N, _S, _P) it runs the pipelined candidates attn_*_pipe of that
// W, N, STAGES (dK/dV PASSES) instead, then the backward through dS (attn_bwd_dkdv_ds,
// attn_bwd_dq_ds) at the same tiles, each block's dynamic shared memory its exact size. With
// ANDREA_SAN_WGMMA too, the sm_90a kernels (attn_fwd_wgmma, the backward through dS on wgmma,
// then the one recomputing S and dP) at the same tiles (W a multiple of 4), then their
// overlapped twins (*_overlap) with at least 3 stages, and dQ added in order inside dK/dV
// (attn_bwd_dkdv_dq_wgmma and its twin, W 4, N 64); last the whole-head backward
// (attn_bwd_fused) with W warps and query chunks of N / P.
// Each variant must give the pipelined kernels' bits, or the program exits 1.
// Usage: emu_sanitize <batch*heads> <seq_len> [threads|fibers]
#include "cuda_emulator.h"
#include "microgpt_cuda.cu"  // as in emu_entry.cpp: the kernel source, parts written in place

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifndef ANDREA_SAN_TYPE
#define ANDREA_SAN_TYPE bf16_t
#endif
#ifndef ANDREA_SAN_D
#define ANDREA_SAN_D 32
#endif

template <typename T_> T_* random_buffer(size_t n, unsigned& state) {
  T_* p = new T_[n];
  for (size_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    p[i] = from_float<T_>(((state >> 8) & 0xffff) / 32768.0f - 1.0f);
  }
  return p;
}

template <typename T_, int D, int K> dim3 grid_of(int bh, int seq_len) {
  const int m = 16 * TileCfg<T_, D, K>::W;
  return dim3((seq_len + m - 1) / m, bh);
}
template <typename T_, int D, int K> dim3 block_of() { return dim3(32 * TileCfg<T_, D, K>::W); }

int main(int argc, char** argv) {
  using T_ = ANDREA_SAN_TYPE;
  constexpr int D = ANDREA_SAN_D;
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <batch*heads> <seq_len> [threads|fibers]\n", argv[0]);
    return 2;
  }
  const int bh = std::atoi(argv[1]), seq_len = std::atoi(argv[2]);
  const auto mode = (argc > 3 && std::strcmp(argv[3], "fibers") == 0) ? andrea_emu::FIBERS
                                                                        : andrea_emu::THREADS;
  const size_t n = (size_t)bh * seq_len * D, rows = (size_t)bh * seq_len;
  unsigned state = 12345u;
  T_ *q = random_buffer<T_>(n, state), *k = random_buffer<T_>(n, state);
  T_ *v = random_buffer<T_>(n, state), *dout = random_buffer<T_>(n, state);
  T_ *o = new T_[n], *dq = new T_[n], *dk = new T_[n], *dv = new T_[n];
  float *lse = new float[rows], *delta = new float[rows];
  const float scale = 1.0f / std::sqrt((float)D);

#if defined(ANDREA_SAN_PIPE_W)
  const auto same_bits = [&](const T_* a, const T_* b) {  // n elements, bit for bit
    return std::memcmp(a, b, n * sizeof(T_)) == 0;
  };
  constexpr int W = ANDREA_SAN_PIPE_W, N = ANDREA_SAN_PIPE_N, S = ANDREA_SAN_PIPE_S;
  const dim3 pgrid((seq_len + 16 * W - 1) / (16 * W), bh), pblock(32 * W);
  andrea_emu::launch(
      pgrid, pblock, mode, [&] { attn_fwd_pipe<T_, D, W, N, S, 0>(q, k, v, o, lse, seq_len, scale); },
      PipeSmem<T_, D, KIND_FWD, W, N, S>::bytes);
  andrea_emu::launch(dim3((unsigned)((rows + 127) / 128)), dim3(128), mode,
                     [&] { attn_bwd_preprocess<T_, D>(o, dout, delta, (int)rows); });
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] { attn_bwd_dq_pipe<T_, D, W, N, S, 0>(q, k, v, dout, lse, delta, dq, seq_len, scale); },
      PipeSmem<T_, D, KIND_DQ, W, N, S>::bytes);
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] {
        attn_bwd_dkdv_pipe<T_, D, W, N, S, 0, ANDREA_SAN_PIPE_P>(q, k, v, dout, lse, delta, dk,
                                                                  dv, seq_len, scale);
      },
      PipeSmem<T_, D, KIND_DKDV, W, N, S>::bytes);
  // The backward through dS at the same tiles, into buffers of its own; dS is an uninitialised
  // exactly sized allocation (dQ must zero what dK/dV leaves unwritten). Same N: the same bits.
  const int stride = (seq_len + 127) / 128 * 128;
  T_ *ds = new T_[(size_t)bh * seq_len * stride], *dq2 = new T_[n], *dk2 = new T_[n];
  T_* dv2 = new T_[n];
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] {
        attn_bwd_dkdv_ds<T_, D, W, N, S, 0, ANDREA_SAN_PIPE_P>(q, k, v, dout, lse, delta, dk2,
                                                                dv2, ds, seq_len, stride, scale);
      },
      PipeSmem<T_, D, KIND_DKDV, W, N, S>::bytes);
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] { attn_bwd_dq_ds<T_, D, W, N, S, 0>(k, ds, dq2, seq_len, stride, scale); },
      DsSmem<T_, D, W, N, S>::bytes);
#if defined(ANDREA_SAN_WGMMA)
  T_* o2 = new T_[n];
  float* lse2 = new float[rows];
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] { attn_fwd_wgmma<T_, D, W, N, S, 0>(q, k, v, o2, lse2, seq_len, scale); },
      HopperSmem<T_, D, KIND_FWD, W, N, S>::bytes);
  T_* ds3 = new T_[(size_t)bh * seq_len * stride];
  T_ *dq3 = new T_[n], *dk3 = new T_[n], *dv3 = new T_[n];
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] {
        attn_bwd_dkdv_ds_wgmma<T_, D, W, N, S, 0, 1>(q, k, v, dout, lse, delta, dk3, dv3, ds3,
                                                     seq_len, stride, scale);
      },
      HopperSmem<T_, D, KIND_DKDV, W, N, S>::bytes);
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] { attn_bwd_dq_ds_wgmma<T_, D, W, N, S, 0>(k, ds3, dq3, seq_len, stride, scale); },
      HopperSmem<T_, D, KIND_DQ_DS, W, N, S>::bytes);
  // and the backward that recomputes S and dP in dQ, on wgmma
  T_ *dq5 = new T_[n], *dk5 = new T_[n], *dv5 = new T_[n];
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] {
        attn_bwd_dkdv_wgmma<T_, D, W, N, S, 0, 1>(q, k, v, dout, lse, delta, dk5, dv5, seq_len,
                                                  scale);
      },
      HopperSmem<T_, D, KIND_DKDV, W, N, S>::bytes);
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] { attn_bwd_dq_wgmma<T_, D, W, N, S, 0>(q, k, v, dout, lse, delta, dq5, seq_len, scale); },
      HopperSmem<T_, D, KIND_DQ, W, N, S>::bytes);
  // the forward (o2, lse2) and both backwards (dq3.., dq5..) against the pipelined kernels
  const auto same_as_pipelined = [&] {
    return same_bits(o, o2) && std::memcmp(lse, lse2, rows * sizeof(float)) == 0 &&
           same_bits(dq, dq3) && same_bits(dk, dk3) && same_bits(dv, dv3) &&
           same_bits(dq, dq5) && same_bits(dk, dk5) && same_bits(dv, dv5);
  };
  const bool same_wgmma = same_as_pipelined();
  // The overlapped twins, at least 3 stages (tile it-1's stage is read a tile longer): the
  // forward, dK/dV through dS (dQ from dS as above), and the recomputing dK/dV and dQ.
  constexpr int SO = S < 3 ? 3 : S;
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] { attn_fwd_wgmma_overlap<T_, D, W, N, SO, 0>(q, k, v, o2, lse2, seq_len, scale); },
      HopperSmem<T_, D, KIND_FWD, W, N, SO>::bytes);
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] {
        attn_bwd_dkdv_ds_wgmma_overlap<T_, D, W, N, SO, 0, 1>(q, k, v, dout, lse, delta, dk3, dv3,
                                                              ds3, seq_len, stride, scale);
      },
      HopperSmem<T_, D, KIND_DKDV, W, N, SO>::bytes);
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] { attn_bwd_dq_ds_wgmma<T_, D, W, N, S, 0>(k, ds3, dq3, seq_len, stride, scale); },
      HopperSmem<T_, D, KIND_DQ_DS, W, N, S>::bytes);
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] {
        attn_bwd_dkdv_wgmma_overlap<T_, D, W, N, SO, 0, 1>(q, k, v, dout, lse, delta, dk5, dv5,
                                                           seq_len, scale);
      },
      HopperSmem<T_, D, KIND_DKDV, W, N, SO>::bytes);
  andrea_emu::launch(
      pgrid, pblock, mode,
      [&] {
        attn_bwd_dq_wgmma_overlap<T_, D, W, N, SO, 0>(q, k, v, dout, lse, delta, dq5, seq_len,
                                                      scale);
      },
      HopperSmem<T_, D, KIND_DQ, W, N, SO>::bytes);
  const bool same_overlap = same_as_pipelined();
  delete[] o2; delete[] lse2; delete[] ds3; delete[] dq3; delete[] dk3; delete[] dv3;
  delete[] dq5; delete[] dk5; delete[] dv5;
  if (!same_wgmma) {
    std::fprintf(stderr, "the wgmma kernels differ from the pipelined ones\n");
    return 1;
  }
  if (!same_overlap) {
    std::fprintf(stderr, "the overlapped wgmma kernels differ from the pipelined ones\n");
    return 1;
  }
  // dK, dV and dQ in one kernel, dQ added in key-block order (one warpgroup, 64 keys a block,
  // 64 queries a tile): its float32 buffer and turn counters exactly sized; it sums in another
  // order than the pipelined backward, so within 2e-2 of it rather than its bits.
  {
    const int tiles = (seq_len + 63) / 64;
    float* acc = new float[n];
    int* count = new int[(size_t)bh * tiles]();
    T_ *dq6 = new T_[n], *dk6 = new T_[n], *dv6 = new T_[n];
    andrea_emu::launch(
        dim3(tiles, bh), dim3(128), mode,
        [&] {
          attn_bwd_dkdv_dq_wgmma<T_, D, 4, 64, 2, 0>(q, k, v, dout, lse, delta, dq6, dk6, dv6,
                                                     acc, count, seq_len, scale);
        },
        HopperSmem<T_, D, KIND_DKDV_DQ, 4, 64, 2>::bytes);
    // its overlapped twin (a tile's share added while the next tile's products run): the bits
    T_ *dq7 = new T_[n], *dk7 = new T_[n], *dv7 = new T_[n];
    std::fill(count, count + (size_t)bh * tiles, 0);
    andrea_emu::launch(
        dim3(tiles, bh), dim3(128), mode,
        [&] {
          attn_bwd_dkdv_dq_wgmma_overlap<T_, D, 4, 64, 3, 0>(q, k, v, dout, lse, delta, dq7, dk7,
                                                             dv7, acc, count, seq_len, scale);
        },
        HopperSmem<T_, D, KIND_DKDV_DQ, 4, 64, 3>::bytes);
    const bool same_twin = same_bits(dq6, dq7) && same_bits(dk6, dk7) && same_bits(dv6, dv7);
    delete[] dq7; delete[] dk7; delete[] dv7;
    if (!same_twin) {
      std::fprintf(stderr, "dQ in order: the overlapped twin differs from the plain kernel\n");
      return 1;
    }
    double worst = 0.0, top = 1.0;
    for (size_t i = 0; i < n; ++i) {
      const T_* mine[3] = {dq6, dk6, dv6};
      const T_* theirs[3] = {dq, dk, dv};
      for (int g = 0; g < 3; ++g) {
        worst = std::max(worst, (double)std::fabs(to_float(mine[g][i]) - to_float(theirs[g][i])));
        top = std::max(top, (double)std::fabs(to_float(theirs[g][i])));
      }
    }
    delete[] acc; delete[] count; delete[] dq6; delete[] dk6; delete[] dv6;
    if (!(worst <= 2e-2 * top)) {
      std::fprintf(stderr, "dQ in order differs from the pipelined backward by %g\n", worst);
      return 1;
    }
  }
#endif
  const bool same = same_bits(dq, dq2) && same_bits(dk, dk2) && same_bits(dv, dv2);
  delete[] ds; delete[] dq2; delete[] dk2; delete[] dv2;
  if (!same) {
    std::fprintf(stderr, "the backward through dS differs from the pipelined backward\n");
    return 1;
  }
  // A whole head's backward in one block, its query chunks dK/dV's passes: the same bits.
  constexpr int NP = N / ANDREA_SAN_PIPE_P;
  T_ *dq4 = new T_[n], *dk4 = new T_[n], *dv4 = new T_[n];
  andrea_emu::launch(
      dim3(1, bh), pblock, mode,
      [&] {
        attn_bwd_fused<T_, D, W, NP, 0>(q, k, v, dout, lse, delta, dq4, dk4, dv4, seq_len, scale);
      },
      FusedSmem<T_, D, W, NP>::bytes(seq_len));
  const bool same_fused = same_bits(dq, dq4) && same_bits(dk, dk4) && same_bits(dv, dv4);
  delete[] dq4; delete[] dk4; delete[] dv4;
  if (!same_fused) {
    std::fprintf(stderr, "the whole-head backward differs from the pipelined backward\n");
    return 1;
  }
#else
  andrea_emu::launch(grid_of<T_, D, KIND_FWD>(bh, seq_len), block_of<T_, D, KIND_FWD>(), mode,
                     [&] { attn_fwd<T_, D>(q, k, v, o, lse, seq_len, scale); });
  andrea_emu::launch(dim3((unsigned)((rows + 127) / 128)), dim3(128), mode,
                     [&] { attn_bwd_preprocess<T_, D>(o, dout, delta, (int)rows); });
  andrea_emu::launch(grid_of<T_, D, KIND_DQ>(bh, seq_len), block_of<T_, D, KIND_DQ>(), mode,
                     [&] { attn_bwd_dq<T_, D>(q, k, v, dout, lse, delta, dq, seq_len, scale); });
  andrea_emu::launch(grid_of<T_, D, KIND_DKDV>(bh, seq_len), block_of<T_, D, KIND_DKDV>(), mode,
                     [&] {
                       attn_bwd_dkdv<T_, D>(q, k, v, dout, lse, delta, dk, dv, seq_len, scale);
                     });
#endif
  double checksum = 0.0;
  for (size_t i = 0; i < n; ++i)
    checksum += to_float(o[i]) + to_float(dq[i]) + to_float(dk[i]) + to_float(dv[i]);
  for (size_t i = 0; i < rows; ++i) checksum += lse[i];
  std::printf("checksum %.6f\n", checksum);
  delete[] q; delete[] k; delete[] v; delete[] dout; delete[] o;
  delete[] dq; delete[] dk; delete[] dv; delete[] lse; delete[] delta;
  return std::isfinite(checksum) ? 0 : 1;
}
