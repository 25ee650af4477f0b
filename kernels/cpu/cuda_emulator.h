// cuda_emulator.h - runs unchanged CUDA kernels on the CPU (g++ -include this header).
//
// The execution model, as far as andrea's kernels need it:
//  - blocks run one at a time, in order; so __shared__ can be block-scoped static storage;
//  - the threads of a block are fibers (ucontext, one OS thread; fast) or OS threads (pthreads;
//    what ThreadSanitizer understands), chosen per launch;
//  - __syncthreads is a block-wide barrier, __syncwarp a warp barrier;
//  - warp collectives (shuffles, and the kernels' emulated ldmatrix/mma through
//    warp_allgather) exchange through per-warp slots: write own slot, warp barrier, read.
//    Slots are double-buffered, so one barrier per collective is enough: a lane can only
//    overwrite a buffer after the next collective's barrier, which every lane reaches only
//    after it has read the previous contents.
//  - dynamic shared memory (the kernel file's ANDREA_DYNAMIC_SHARED) is one heap buffer of
//    exactly the launch's size, filled with 0xff bytes (NaN in every element type) at the start
//    of every block, as a GPU's is undefined;
//  - cp.async (cp_async, cp_async_commit, cp_async_wait): a copy is read at issue but lands in
//    shared memory only at the wait_group that completes its group, and its destination reads
//    as 0xff bytes until then, so a missing wait (or a missing barrier before a buffer is
//    reused) gives NaNs here as it gives stale data on a GPU.
//  - wgmma.mma_async (async_mma_issue, async_mma_commit, async_mma_wait): the kernel file gives
//    each operation as a function of its accumulator; it runs only at the wait_group that
//    completes its group, reading shared memory then, and the accumulator registers read as NaN
//    from the issue until then; operations on one accumulator chain in issue order, as on the
//    GPU. So a missing wait, or shared memory overwritten before it, shows here too.
// Not emulated: memory ordering between threads without barriers (fibers are sequentially
// consistent), warp divergence (collectives need all 32 lanes), and the proxy and register
// fences wgmma needs (fence.proxy.async, wgmma.fence): the emulator has one memory proxy.
#pragma once

#include <pthread.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define ANDREA_EMULATOR 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace andrea_emu {

enum Mode { FIBERS = 0, THREADS = 1 };

constexpr int kWarp = 32;
constexpr int kSlotBytes = 64;

[[noreturn]] inline void die(const char* what) {
  std::fprintf(stderr, "cuda_emulator: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

struct Barrier {  // fiber-mode barrier: count arrivals, release by bumping the generation
  int count = 0;
  unsigned gen = 0;
  int expected = 0;
};

struct WarpState {
  alignas(64) unsigned char slot[2][kWarp][kSlotBytes];
  Barrier fbar;
  pthread_barrier_t tbar;
};

struct Launch;

struct AsyncCopy {  // one cp.async in flight: the bytes read at issue and where they land
  void* dst;
  int bytes;
  unsigned char data[16];
};

// One wgmma in flight: what it does to its accumulator's true value when its group completes.
struct AsyncMma {
  float* acc;
  std::function<void(float*)> run;
};

// An accumulator with operations in flight: its registers read NaN, its true value is here.
struct InFlight {
  float* acc;
  int n;
  int pending;
  std::vector<float> value;
};

struct Thread {
  dim3 tid, bid;
  int linear = 0;
  unsigned parity = 0;  // which slot buffer this lane's next collective uses
  bool done = false;
  Launch* launch = nullptr;
  ucontext_t ctx;
  std::vector<AsyncCopy> uncommitted;            // cp.async issued since the last commit
  std::deque<std::vector<AsyncCopy>> committed;  // groups in commit order, oldest first
  std::vector<AsyncMma> mma_uncommitted;           // wgmma issued since the last commit
  std::deque<std::vector<AsyncMma>> mma_committed;
  std::vector<InFlight> in_flight;
};

struct Launch {
  Mode mode = FIBERS;
  dim3 grid, block;
  int nthreads = 0;
  std::vector<Thread> threads;
  std::vector<WarpState> warps;
  void (*body)(void*) = nullptr;
  void* body_arg = nullptr;
  // dynamic shared memory: exactly the launch's bytes (AddressSanitizer sees an overrun)
  std::unique_ptr<unsigned char[]> dynamic_shared;
  size_t dynamic_bytes = 0;
  // fibers
  Barrier block_bar;
  ucontext_t main_ctx;
  int current = 0;
  int live = 0;
  long stalls = 0;  // consecutive waiting resumptions without progress: deadlock detector
  std::unique_ptr<char[]> stacks;  // not zero-filled: allocation only
  // threads
  pthread_barrier_t tblock_bar;
};

inline thread_local Thread* cur = nullptr;
inline dim3 g_grid, g_block;
constexpr size_t kStack = 256 * 1024;

// ----------------------------------------------------------------------------------- fibers
inline void switch_to(Launch& L, int next) {
  Thread* from = &L.threads[L.current];
  L.current = next;
  cur = &L.threads[next];
  if (swapcontext(&from->ctx, &L.threads[next].ctx) != 0) die("swapcontext failed");
}

inline int next_live(Launch& L) {
  for (int step = 1; step <= L.nthreads; ++step) {
    const int i = (L.current + step) % L.nthreads;
    if (!L.threads[i].done) return i;
  }
  return -1;
}

inline void wait_yield(Launch& L) {  // a fiber that waits on a barrier lets the next one run
  if (++L.stalls > 4L * L.nthreads + 64)
    die("deadlock: a barrier is not reached by every thread of the block (or warp)");
  const int n = next_live(L);
  if (n < 0 || n == L.current) die("deadlock: the only runnable thread waits on a barrier");
  switch_to(L, n);
}

inline void fiber_wait(Launch& L, Barrier& b) {
  const unsigned gen = b.gen;
  if (++b.count >= b.expected) {
    b.count = 0;
    ++b.gen;
    L.stalls = 0;
    return;
  }
  while (b.gen == gen) wait_yield(L);
}

inline void fiber_exit_release(Barrier& b) {  // an exited thread no longer counts
  --b.expected;
  if (b.count > 0 && b.count >= b.expected) {
    b.count = 0;
    ++b.gen;
  }
}

inline void fiber_entry(unsigned lo, unsigned hi) {
  Launch& L = *reinterpret_cast<Launch*>(((uintptr_t)hi << 32) | (uintptr_t)lo);
  L.body(L.body_arg);
  Thread& me = L.threads[L.current];
  me.done = true;
  --L.live;
  L.stalls = 0;
  fiber_exit_release(L.block_bar);
  fiber_exit_release(L.warps[me.linear / kWarp].fbar);
  const int n = next_live(L);
  cur = nullptr;
  if (n < 0) {
    setcontext(&L.main_ctx);
  } else {
    L.current = n;
    cur = &L.threads[n];
    setcontext(&L.threads[n].ctx);
  }
  die("setcontext returned");
}

inline void run_fibers(Launch& L) {
  L.stacks.reset(new char[(size_t)L.nthreads * kStack]);
  for (unsigned bz = 0; bz < L.grid.z; ++bz)
    for (unsigned by = 0; by < L.grid.y; ++by)
      for (unsigned bx = 0; bx < L.grid.x; ++bx) {
        L.block_bar = Barrier{0, 0, L.nthreads};
        if (L.dynamic_bytes) std::memset(L.dynamic_shared.get(), 0xff, L.dynamic_bytes);
        for (size_t w = 0; w < L.warps.size(); ++w) {
          const int lanes = std::min(kWarp, L.nthreads - (int)w * kWarp);
          L.warps[w].fbar = Barrier{0, 0, lanes};
        }
        for (int i = 0; i < L.nthreads; ++i) {
          Thread& t = L.threads[i];
          t.bid = dim3(bx, by, bz);
          t.done = false;
          t.parity = 0;
          t.uncommitted.clear();
          t.committed.clear();
          t.mma_uncommitted.clear();
          t.mma_committed.clear();
          t.in_flight.clear();
          if (getcontext(&t.ctx) != 0) die("getcontext failed");
          t.ctx.uc_stack.ss_sp = &L.stacks[(size_t)i * kStack];
          t.ctx.uc_stack.ss_size = kStack;
          t.ctx.uc_link = nullptr;
          const uintptr_t p = (uintptr_t)&L;
          makecontext(&t.ctx, (void (*)())fiber_entry, 2, (unsigned)(p & 0xffffffffu),
                      (unsigned)(p >> 32));
        }
        L.live = L.nthreads;
        L.stalls = 0;
        L.current = 0;
        cur = &L.threads[0];
        if (swapcontext(&L.main_ctx, &L.threads[0].ctx) != 0) die("swapcontext failed");
        cur = nullptr;
      }
}

// ---------------------------------------------------------------------------------- threads
inline void run_threads(Launch& L) {
  pthread_barrier_init(&L.tblock_bar, nullptr, L.nthreads);
  for (size_t w = 0; w < L.warps.size(); ++w) {
    const int lanes = std::min(kWarp, L.nthreads - (int)w * kWarp);
    pthread_barrier_init(&L.warps[w].tbar, nullptr, lanes);
  }
  std::vector<std::thread> pool;
  pool.reserve(L.nthreads);
  for (int i = 0; i < L.nthreads; ++i)
    pool.emplace_back([&L, i] {
      Thread& t = L.threads[i];
      cur = &t;
      for (unsigned bz = 0; bz < L.grid.z; ++bz)
        for (unsigned by = 0; by < L.grid.y; ++by)
          for (unsigned bx = 0; bx < L.grid.x; ++bx) {
            t.bid = dim3(bx, by, bz);
            t.parity = 0;
            t.uncommitted.clear();
            t.committed.clear();
            t.mma_uncommitted.clear();
            t.mma_committed.clear();
            t.in_flight.clear();
            if (L.dynamic_bytes) {  // thread 0 refills the block's; the others wait for it
              if (i == 0) std::memset(L.dynamic_shared.get(), 0xff, L.dynamic_bytes);
              pthread_barrier_wait(&L.tblock_bar);
            }
            L.body(L.body_arg);
            // blocks run one at a time: no thread starts the next block before all finished
            pthread_barrier_wait(&L.tblock_bar);
          }
      cur = nullptr;
    });
  for (auto& th : pool) th.join();
  pthread_barrier_destroy(&L.tblock_bar);
  for (auto& w : L.warps) pthread_barrier_destroy(&w.tbar);
}

// ------------------------------------------------------------------------------- interface
inline void syncthreads() {
  Launch& L = *cur->launch;
  if (L.mode == FIBERS)
    fiber_wait(L, L.block_bar);
  else
    pthread_barrier_wait(&L.tblock_bar);
}

inline void syncwarp() {
  Launch& L = *cur->launch;
  WarpState& w = L.warps[cur->linear / kWarp];
  if (L.mode == FIBERS)
    fiber_wait(L, w.fbar);
  else
    pthread_barrier_wait(&w.tbar);
}

// Every lane passes `bytes` bytes at `mine`; afterwards all[lane] holds lane's bytes.
inline void warp_allgather(const void* mine, void* all, size_t bytes) {
  if (bytes > (size_t)kSlotBytes) die("warp_allgather: value larger than a slot");
  Thread& me = *cur;
  Launch& L = *me.launch;
  WarpState& w = L.warps[me.linear / kWarp];
  const int lane = me.linear % kWarp;
  const unsigned p = me.parity;
  me.parity ^= 1u;
  std::memcpy(w.slot[p][lane], mine, bytes);
  syncwarp();
  for (int i = 0; i < kWarp; ++i) std::memcpy((char*)all + i * bytes, w.slot[p][i], bytes);
}

// The calling thread's dynamic shared memory (its block's).
inline unsigned char* dynamic_shared() { return cur->launch->dynamic_shared.get(); }

// cp.async of `bytes` (4 or 16): src_bytes of them read from src now, the rest zeros (PTX's
// src-size zero fill); they land at dst only when a cp_async_wait completes the group.
inline void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  if (bytes != 4 && bytes != 8 && bytes != 16) die("cp.async copies 4, 8 or 16 bytes");
  if (src_bytes < 0 || src_bytes > bytes) die("cp.async src-size out of range");
  if ((uintptr_t)dst % bytes || (src_bytes && (uintptr_t)src % bytes))
    die("cp.async: misaligned address");
  AsyncCopy c{dst, bytes, {}};
  std::memcpy(c.data, src, src_bytes);
  std::memset(c.data + src_bytes, 0, bytes - src_bytes);
  std::memset(dst, 0xff, bytes);  // in flight: what a reader sees is undefined
  cur->uncommitted.push_back(c);
}

inline void cp_async_commit() {
  Thread& me = *cur;
  me.committed.push_back(std::move(me.uncommitted));
  me.uncommitted.clear();
}

// Waits until at most `pending` committed groups are still in flight: the older ones land.
inline void cp_async_wait(int pending) {
  Thread& me = *cur;
  while ((int)me.committed.size() > pending) {
    for (const AsyncCopy& c : me.committed.front()) std::memcpy(c.dst, c.data, c.bytes);
    me.committed.pop_front();
  }
}

// The shared-memory address of p (an offset into the block's dynamic shared memory, the only
// kind the wgmma kernels use), as cvta.to.shared gives it on a GPU.
inline unsigned shared_address(const void* p) {
  const Launch& L = *cur->launch;
  const unsigned char* base = L.dynamic_shared.get();
  const unsigned char* at = (const unsigned char*)p;
  if (at < base || at >= base + L.dynamic_bytes) die("shared_address: not in dynamic shared memory");
  return (unsigned)(at - base);
}

// n bytes of shared memory at address addr (an offset as shared_address gives).
inline const unsigned char* shared_at(unsigned addr, size_t n) {
  const Launch& L = *cur->launch;
  if ((size_t)addr + n > L.dynamic_bytes) die("wgmma: descriptor reads past dynamic shared memory");
  return L.dynamic_shared.get() + addr;
}

// wgmma.mma_async on this thread's n-float accumulator acc: run(value) does the product on the
// accumulator's true value when its group completes; until then acc reads NaN.
inline void async_mma_issue(float* acc, int n, std::function<void(float*)> run) {
  Thread& me = *cur;
  InFlight* f = nullptr;
  for (InFlight& x : me.in_flight)
    if (x.acc == acc) f = &x;
  if (f == nullptr) {
    me.in_flight.push_back(InFlight{acc, n, 0, std::vector<float>(acc, acc + n)});
    f = &me.in_flight.back();
    for (int i = 0; i < n; ++i) acc[i] = std::nanf("");
  } else if (f->n != n) {
    die("wgmma: one accumulator issued with two sizes");
  }
  ++f->pending;
  me.mma_uncommitted.push_back(AsyncMma{acc, std::move(run)});
}

inline void async_mma_commit() {
  Thread& me = *cur;
  me.mma_committed.push_back(std::move(me.mma_uncommitted));
  me.mma_uncommitted.clear();
}

// wgmma.wait_group: at most `pending` groups stay in flight; the older ones complete in order,
// and an accumulator with nothing left in flight gets its value back.
inline void async_mma_wait(int pending) {
  Thread& me = *cur;
  while ((int)me.mma_committed.size() > pending) {
    for (AsyncMma& op : me.mma_committed.front()) {
      for (size_t i = 0; i < me.in_flight.size(); ++i) {
        InFlight& f = me.in_flight[i];
        if (f.acc != op.acc) continue;
        op.run(f.value.data());
        if (--f.pending == 0) {
          std::copy(f.value.begin(), f.value.end(), f.acc);
          me.in_flight.erase(me.in_flight.begin() + i);
        }
        break;
      }
    }
    me.mma_committed.pop_front();
  }
}

template <typename F>
void launch(dim3 grid, dim3 block, Mode mode, F&& kernel_call, size_t dynamic_bytes = 0) {
  Launch L;
  L.mode = mode;
  L.grid = grid;
  L.block = block;
  L.nthreads = (int)(block.x * block.y * block.z);
  if (L.nthreads <= 0 || L.nthreads > 1024) die("block size must be 1..1024 threads");
  if (L.nthreads % kWarp != 0) die("block size must be a multiple of 32 (whole warps)");
  L.threads.resize(L.nthreads);
  L.dynamic_bytes = dynamic_bytes;
  if (dynamic_bytes) L.dynamic_shared.reset(new unsigned char[dynamic_bytes]);
  L.warps = std::vector<WarpState>((L.nthreads + kWarp - 1) / kWarp);
  for (int i = 0; i < L.nthreads; ++i) {
    Thread& t = L.threads[i];
    t.linear = i;
    t.tid = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
    t.launch = &L;
  }
  struct Holder {
    F* f;
    static void call(void* p) { (*static_cast<Holder*>(p)->f)(); }
  } holder{&kernel_call};
  L.body = &Holder::call;
  L.body_arg = &holder;
  g_grid = grid;
  g_block = block;
  if (mode == FIBERS)
    run_fibers(L);
  else
    run_threads(L);
}

template <typename V> V shfl(V v, int src_lane) {
  static_assert(sizeof(V) <= (size_t)kSlotBytes, "shuffle value too large");
  V all[kWarp];
  warp_allgather(&v, all, sizeof(V));
  return all[src_lane & (kWarp - 1)];
}

inline int lane_id() { return cur->linear % kWarp; }

}  // namespace andrea_emu

#define threadIdx (andrea_emu::cur->tid)
#define blockIdx (andrea_emu::cur->bid)
#define blockDim (andrea_emu::g_block)
#define gridDim (andrea_emu::g_grid)
#define warpSize 32

inline void __syncthreads() { andrea_emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { andrea_emu::syncwarp(); }

template <typename V> V __shfl_sync(unsigned, V v, int src, int = 32) {
  return andrea_emu::shfl(v, src);
}
template <typename V> V __shfl_xor_sync(unsigned, V v, int mask, int = 32) {
  return andrea_emu::shfl(v, andrea_emu::lane_id() ^ mask);
}
template <typename V> V __shfl_down_sync(unsigned, V v, unsigned delta, int = 32) {
  const int src = andrea_emu::lane_id() + (int)delta;
  const V got = andrea_emu::shfl(v, src & 31);
  return src < 32 ? got : v;
}

// Bit casts and math intrinsics.
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// exp2f, log2f, expf, logf, fmaxf, fminf, sqrtf, fabsf come from <cmath>.

// Atomics.
template <typename V> V atomicAdd(V* p, V v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* p, float v) {
  float old, want;
  __atomic_load(p, &old, __ATOMIC_SEQ_CST);
  do want = old + v;
  while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  return old;
}
template <typename V> V atomicMax(V* p, V v) {
  V old, want;
  __atomic_load(p, &old, __ATOMIC_SEQ_CST);
  do want = old < v ? v : old;
  while (!__atomic_compare_exchange(p, &old, &want, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  return old;
}
template <typename V> V atomicExch(V* p, V v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
