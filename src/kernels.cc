// Kernel implementations. Built with -ffp-contract=off and without -ffast-math: the compiler
// may vectorize across independent outputs (n) but never reorder or fuse one output's chain.
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <limits>
#include <mutex>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

// The public kernels are compiled twice (AVX2 and baseline x86-64) and picked at load time.
// Wider vectors only process more independent outputs per instruction: "avx2" does not enable
// FMA, and -ffp-contract=off would forbid contraction anyway, so results are identical.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define TVM_SPINN_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define TVM_SPINN_MULTIVERSION
#endif
#define TVM_SPINN_INLINE inline __attribute__((always_inline))

namespace tvm_spinn {
namespace {

/*!
 * \brief The M4F's NaN result of a two-operand VADD/VSUB/VMUL/VDIV with FPSCR.DN = 0, as the PE
 *        runtime sets it (FPProcessNaNs, ARMv7-M ARM A2.5.5): a signalling operand quieted (the
 *        first's if both are), else a quiet operand (the first's if both are); an invalid
 *        operation on numbers (inf - inf, 0 * inf) gives the default NaN 0x7FC00000. x86 takes
 *        the first NaN operand whatever its kind, and gives 0xFFC00000 for an invalid operation.
 */
TVM_SPINN_INLINE float M4fNaN(float a, float b) {
  uint32_t ua, ub;
  std::memcpy(&ua, &a, sizeof ua);
  std::memcpy(&ub, &b, sizeof ub);
  const bool na = a != a, nb = b != b;
  uint32_t u = 0x7FC00000u;
  if (na && (ua & 0x00400000u) == 0) {
    u = ua | 0x00400000u;
  } else if (nb && (ub & 0x00400000u) == 0) {
    u = ub | 0x00400000u;
  } else if (na) {
    u = ua;
  } else if (nb) {
    u = ub;
  }
  float q;
  std::memcpy(&q, &u, sizeof q);
  return q;
}

/*! \brief `a * b` and `a + b` as the M4F's VMUL.F32 and VADD.F32 (operand order kept). */
TVM_SPINN_INLINE float M4fMul(float a, float b) {
  const float r = a * b;
  return r == r ? r : M4fNaN(a, b);
}
TVM_SPINN_INLINE float M4fAdd(float a, float b) {
  const float r = a + b;
  return r == r ? r : M4fNaN(a, b);
}

/*!
 * \brief The outputs of C [m, n] the host's arithmetic left NaN, recomputed with the M4F's NaN
 *        rules: from `start` (+0.0 where null), k ascending, each product as the PE's GEMM kernel
 *        issues it (VMUL of B's element by A's, then VADD of the accumulator and the product:
 *        the operand order of the code LLVM emits for it, checked by tests/pe), then `e`'s bias
 *        (VADD of the sum and the bias); a NaN passes the ReLU and the clip unchanged. NaN-ness
 *        does not depend on the rules, only the payload and sign do, so no other output moves.
 */
void M4fNaNOutputs(const float* a, const float* b, float* c, const float* start, int64_t m, int64_t k,
                   int64_t n, const EpilogueF32* e) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const float v = c[i * n + j];
      if (v == v) continue;
      float acc = start ? start[i * n + j] : 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) acc = M4fAdd(acc, M4fMul(b[kk * n + j], a[i * k + kk]));
      if (e && e->bias) acc = M4fAdd(acc, e->bias[e->bias_on_rows ? i : j]);
      c[i * n + j] = acc;
    }
  }
}

/*! \brief Whether any of `n` floats is a NaN. */
TVM_SPINN_INLINE bool AnyNaN(const float* x, int64_t n) {
  bool any = false;
  for (int64_t i = 0; i < n; ++i) any |= x[i] != x[i];
  return any;
}

// Blocking keeps a C row tile and the touched B rows in L1/L2; it only changes the order in
// which *different* outputs are visited, never the k order of any single output.
constexpr int64_t kTileN = 512;
constexpr int64_t kTileM = 4;

/*!
 * \brief acc + prod on a signed (32 - shift)-bit two's complement accumulator; counts a wrap.
 *
 * For acc_bits <= 31 the exact sum fits int32 (|acc| <= 2^30, |prod| <= 2^30), so it is
 * computed exactly, wrapped by a shift pair and compared. For acc_bits == 32 (kFull32) the sum
 * is taken modulo 2^32 and a wrap is a signed overflow, detected from the sign bits.
 */
template <bool kFull32>
TVM_SPINN_INLINE int32_t WrapAdd(int32_t acc, int32_t prod, int shift, int32_t* wraps) {
  if constexpr (kFull32) {
    const auto sum =
        static_cast<int32_t>(static_cast<uint32_t>(acc) + static_cast<uint32_t>(prod));
    *wraps += ((acc ^ sum) & (prod ^ sum)) < 0;
    return sum;
  } else {
    const int32_t sum = acc + prod;  // exact
    const int32_t wrapped = static_cast<int32_t>(static_cast<uint32_t>(sum) << shift) >> shift;
    *wraps += (wrapped != sum);
    return wrapped;
  }
}

/*!
 * \brief Integer GEMM on a signed acc_bits-bit accumulator, all in 32-bit lanes.
 *
 * Products are exact in int32 (|a*b| <= 2^30 for int16 operands). For acc_bits <= 31 the exact
 * sum acc + a*b also fits int32 (|acc| <= 2^30), so it is computed exactly, wrapped by a
 * shift pair and compared. For acc_bits == 32 the sum is done modulo 2^32 and a wrap is a signed
 * overflow, detected from the sign bits.
 */
template <typename T, bool kFull32>
TVM_SPINN_INLINE int64_t GemmIntImpl(const T* a, const T* b, int32_t* c, int64_t m, int64_t k,
                                     int64_t n, int acc_bits) {
  const int shift = 32 - acc_bits;
  int64_t wraps = 0;
  for (int64_t i0 = 0; i0 < m; i0 += kTileM) {
    const int64_t mi = std::min(kTileM, m - i0);
    for (int64_t j0 = 0; j0 < n; j0 += kTileN) {
      const int64_t nj = std::min(kTileN, n - j0);
      for (int64_t kk = 0; kk < k; ++kk) {
        const T* __restrict brow = b + kk * n + j0;
        for (int64_t i = i0; i < i0 + mi; ++i) {
          const int32_t av = a[i * k + kk];
          int32_t* __restrict crow = c + i * n + j0;
          int32_t tile_wraps = 0;  // <= kTileN per (k, row): no overflow
          for (int64_t j = 0; j < nj; ++j) {
            crow[j] = WrapAdd<kFull32>(crow[j], av * static_cast<int32_t>(brow[j]), shift, &tile_wraps);
          }
          wraps += tile_wraps;
        }
      }
    }
  }
  return wraps;
}

template <typename T>
TVM_SPINN_INLINE int64_t GemmInt(const T* a, const T* b, int32_t* c, int64_t m, int64_t k,
                                 int64_t n, int acc_bits) {
  static_assert(sizeof(T) <= 2, "products must fit in int32");
  return acc_bits >= 32 ? GemmIntImpl<T, true>(a, b, c, m, k, n, acc_bits)
                        : GemmIntImpl<T, false>(a, b, c, m, k, n, acc_bits);
}

}  // namespace

TVM_SPINN_MULTIVERSION
void GemmF32(const float* a, const float* b, float* c, int64_t m, int64_t k, int64_t n) {
  thread_local std::vector<float> start;
  start.assign(c, c + std::max<int64_t>(m * n, 0));  // for the outputs that end NaN
  for (int64_t i0 = 0; i0 < m; i0 += kTileM) {
    const int64_t mi = std::min(kTileM, m - i0);
    for (int64_t j0 = 0; j0 < n; j0 += kTileN) {
      const int64_t nj = std::min(kTileN, n - j0);
      for (int64_t kk = 0; kk < k; ++kk) {
        const float* brow = b + kk * n + j0;
        for (int64_t i = i0; i < i0 + mi; ++i) {
          const float av = a[i * k + kk];
          float* __restrict crow = c + i * n + j0;
          for (int64_t j = 0; j < nj; ++j) {
            const float prod = av * brow[j];  // rounded to fp32
            crow[j] = crow[j] + prod;         // rounded to fp32
          }
        }
      }
    }
  }
  if (AnyNaN(c, m * n)) M4fNaNOutputs(a, b, c, start.data(), m, k, n, nullptr);
}

TVM_SPINN_MULTIVERSION
int64_t GemmI8(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t k, int64_t n,
               int acc_bits) {
  return GemmInt(a, b, c, m, k, n, acc_bits);
}

TVM_SPINN_MULTIVERSION
int64_t GemmI16(const int16_t* a, const int16_t* b, int32_t* c, int64_t m, int64_t k, int64_t n,
                int acc_bits) {
  return GemmInt(a, b, c, m, k, n, acc_bits);
}


// ---------------------------------------------------------------------------------------------
// Whole-layer kernels: batched, register-blocked, multi-threaded over output blocks.
// ---------------------------------------------------------------------------------------------
namespace {

/*!
 * \brief A persistent worker pool. A job's tasks are claimed from an atomic counter by the
 *        caller and by whichever workers wake in time; the caller waits only for claimed tasks,
 *        so a worker descheduled by a busy machine never delays a job it took no part in.
 */
class ThreadPool {
 public:
  static ThreadPool& Global() {
    static ThreadPool* pool = new ThreadPool();  // never destroyed: workers outlive main()
    return *pool;
  }

  void Run(int64_t tasks, int threads, const std::function<void(int64_t)>& task) {
    if (tasks <= 0) return;
    const int64_t helpers = std::min<int64_t>(threads, tasks) - 1;
    if (helpers <= 0) {
      for (int64_t t = 0; t < tasks; ++t) task(t);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mutex_);  // one job at a time
    auto job = std::make_shared<Job>();
    job->task = &task;
    job->tasks = tasks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int64_t>(workers_.size()) < helpers) {
        workers_.emplace_back([this] { WorkerLoop(); });
        workers_.back().detach();
      }
      job_ = job;
      job_slots_ = helpers;
      ++generation_;
    }
    wake_.notify_all();
    Work(*job);
    std::unique_lock<std::mutex> lock(job->mutex);
    job->finished.wait(lock, [&] { return job->done.load() == job->claimed_done(); });
    {
      std::lock_guard<std::mutex> lk(mutex_);
      job_.reset();
    }
  }

 private:
  struct Job {
    const std::function<void(int64_t)>* task = nullptr;
    int64_t tasks = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mutex;
    std::condition_variable finished;
    // Tasks handed out (<= tasks): the caller waits for exactly these.
    int64_t claimed_done() const { return std::min(next.load(), tasks); }
  };

  static void Work(Job& job) {
    for (int64_t t = job.next.fetch_add(1); t < job.tasks; t = job.next.fetch_add(1)) {
      (*job.task)(t);
      if (job.done.fetch_add(1) + 1 == job.tasks) {
        std::lock_guard<std::mutex> lock(job.mutex);
        job.finished.notify_all();
      }
    }
    // Claims past the end still count as "handed out": wake the caller if it waits on them.
    std::lock_guard<std::mutex> lock(job.mutex);
    job.finished.notify_all();
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (!job_ || job_slots_ <= 0) continue;
        --job_slots_;
        job = job_;
      }
      Work(*job);
    }
  }

  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::shared_ptr<Job> job_;
  int64_t job_slots_ = 0;
  uint64_t generation_ = 0;
};

/*! \brief Run task(t) for t in [0, tasks) on up to `threads` threads (the caller is one). */
template <typename F>
void ParallelFor(int64_t tasks, int threads, F&& task) {
  if (tasks <= 0) return;
  if (threads <= 1 || tasks == 1) {
    for (int64_t t = 0; t < tasks; ++t) task(t);
    return;
  }
  const std::function<void(int64_t)> fn = [&task](int64_t t) { task(t); };
  ThreadPool::Global().Run(tasks, threads, fn);
}

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
std::unique_ptr<T[], AlignedFree> AlignedBuffer(size_t count) {
  const size_t bytes = ((count * sizeof(T) + 63) / 64) * 64 + 64;
  return std::unique_ptr<T[], AlignedFree>(static_cast<T*>(std::aligned_alloc(64, bytes)));
}

// fp32 blocking: a 5 x 16 block of C lives in 10 eight-lane registers (6 x 16 spills one with
// the separate multiply and add); A is packed in panels of 5 rows ([k][6]), B in panels of 16 columns ([k][16], zero-padded). kKc-long k blocks keep a B
// panel in L1 and the A block in L2. Blocking only changes which outputs are visited when;
// every output still sees k ascending, and its value between k blocks is the fp32 accumulator.
constexpr int kMr = 5;
constexpr int kNr = 16;
constexpr int64_t kKc = 256;
constexpr int64_t kMc = 120;   // multiple of kMr
constexpr int64_t kNc = 1024;  // multiple of kNr

typedef float V8 __attribute__((vector_size(32)));
typedef float V8u __attribute__((vector_size(32), aligned(4)));

typedef int32_t V8i __attribute__((vector_size(32)));
// The vector helpers below take and return V8 by value: always inlined into their AVX2 or
// default clone, so GCC's note that such a signature's ABI differs between the two is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

// Lane by lane a where m is set, else b (m lanes all ones or all zeros): an exact select.
TVM_SPINN_INLINE V8 Select(V8i m, V8 a, V8 b) {
  return reinterpret_cast<V8>((reinterpret_cast<V8i>(a) & m) | (reinterpret_cast<V8i>(b) & ~m));
}

// How a micro-tile starts and ends (BatchedGemm::zero_c and ::epilogue): from +0.0 instead of
// C's value in the first k block; the epilogue on the finished values in the last, with the
// bias of the tile's first row (`row_bias`, rows consecutive) or first column (`col_bias`).
struct TileEnds {
  bool zero = false;
  const EpilogueF32* e = nullptr;
  const float* row_bias = nullptr;
  const float* col_bias = nullptr;
};

// EpilogueRow's operations on a vector of 8 outputs of one row: `+ bias`, ReLU, clip, each
// lane rounded as the scalar code (the select keeps x > 0 ? x : +0 and the clip's order; a NaN
// lane stays that NaN, as PyTorch's relu and clamp).
TVM_SPINN_INLINE V8 EpilogueV8(V8 v, const EpilogueF32& e, const float* col_bias8, const float* row_bias) {
  if (col_bias8) {
    v = v + *reinterpret_cast<const V8u*>(col_bias8);
  } else if (row_bias) {
    v = v + *row_bias;
  }
  if (e.relu) v = Select((v > V8{}) | (v != v), v, V8{});
  if (e.clip) {
    const V8 hi = V8{} + e.hi, lo = V8{} + e.lo;
    const V8 y = Select((v < hi) | (v != v), v, hi);
    v = Select((y > lo) | (y != y), y, lo);
  }
  return v;
}

// B rows are `ldb` floats apart: kNr for a packed panel, N when read in place (a single row
// panel, where packing B would cost as much as the multiply-adds).
template <int MR>
TVM_SPINN_INLINE void MicroF32(int64_t kc, const float* __restrict ap, const float* __restrict bp,
                               int64_t ldb, float* __restrict c, int64_t ldc, int64_t nc,
                               const TileEnds& ends) {
  V8 acc0[MR], acc1[MR];
  if (ends.zero) {
    for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = V8{};
  } else if (nc == kNr) {
    for (int r = 0; r < MR; ++r) {
      acc0[r] = *reinterpret_cast<const V8u*>(c + r * ldc);
      acc1[r] = *reinterpret_cast<const V8u*>(c + r * ldc + 8);
    }
  } else {
    for (int r = 0; r < MR; ++r) {
      alignas(32) float tmp[kNr] = {};
      std::memcpy(tmp, c + r * ldc, static_cast<size_t>(nc) * sizeof(float));
      acc0[r] = *reinterpret_cast<const V8*>(tmp);
      acc1[r] = *reinterpret_cast<const V8*>(tmp + 8);
    }
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    const V8 b0 = *reinterpret_cast<const V8u*>(bp);
    const V8 b1 = *reinterpret_cast<const V8u*>(bp + 8);
    for (int r = 0; r < MR; ++r) {
      const float av = ap[r];
      const V8 p0 = b0 * av;  // rounded product
      acc0[r] = acc0[r] + p0;  // rounded sum
      const V8 p1 = b1 * av;
      acc1[r] = acc1[r] + p1;
    }
    ap += MR;
    bp += ldb;
  }
  if (ends.e) {
    // the columns' bias padded to 16 lanes (a ragged tile must not read past the bias)
    alignas(32) float cb[kNr] = {};
    if (ends.col_bias) std::memcpy(cb, ends.col_bias, static_cast<size_t>(nc) * sizeof(float));
    for (int r = 0; r < MR; ++r) {
      const float* rb = ends.row_bias ? ends.row_bias + r : nullptr;
      acc0[r] = EpilogueV8(acc0[r], *ends.e, ends.col_bias ? cb : nullptr, rb);
      acc1[r] = EpilogueV8(acc1[r], *ends.e, ends.col_bias ? cb + 8 : nullptr, rb);
    }
  }
  if (nc == kNr) {
    for (int r = 0; r < MR; ++r) {
      *reinterpret_cast<V8u*>(c + r * ldc) = acc0[r];
      *reinterpret_cast<V8u*>(c + r * ldc + 8) = acc1[r];
    }
  } else {
    for (int r = 0; r < MR; ++r) {
      alignas(32) float tmp[kNr];
      *reinterpret_cast<V8*>(tmp) = acc0[r];
      *reinterpret_cast<V8*>(tmp + 8) = acc1[r];
      std::memcpy(c + r * ldc, tmp, static_cast<size_t>(nc) * sizeof(float));
    }
  }
}

// Narrow outputs (N <= 8: a conv on a small feature map, a matrix-vector product) would fill a
// quarter of the 16-column register block: there the lanes run over 8 rows of A instead (A
// packed [k][8], one broadcast B element per column), the same products b * a and sums c + p
// per output, k ascending, so the same bits.
constexpr int kNarrow = 8;

template <int NC>
TVM_SPINN_INLINE void MicroF32Narrow(int64_t kc, const float* __restrict ap, const float* __restrict bp,
                                     int64_t ldb, float* __restrict c, int64_t ldc, int64_t h,
                                     const TileEnds& ends) {
  V8 acc[NC];
  for (int j = 0; j < NC; ++j) {
    alignas(32) float tmp[8] = {};
    if (!ends.zero) {
      for (int64_t r = 0; r < h; ++r) tmp[r] = c[r * ldc + j];
    }
    acc[j] = *reinterpret_cast<const V8*>(tmp);
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    const V8 av = *reinterpret_cast<const V8*>(ap);
    for (int j = 0; j < NC; ++j) {
      const V8 p = bp[j] * av;  // rounded product (b * a, as the wide kernel)
      acc[j] = acc[j] + p;      // rounded sum
    }
    ap += 8;
    bp += ldb;
  }
  if (ends.e) {
    // lanes are rows here: the rows' bias as a vector, a column's as a scalar
    alignas(32) float rb[8] = {};
    if (ends.row_bias) std::memcpy(rb, ends.row_bias, static_cast<size_t>(h) * sizeof(float));
    for (int j = 0; j < NC; ++j) {
      acc[j] = EpilogueV8(acc[j], *ends.e, ends.row_bias ? rb : nullptr, ends.col_bias ? ends.col_bias + j : nullptr);
    }
  }
  for (int j = 0; j < NC; ++j) {
    alignas(32) float tmp[8];
    *reinterpret_cast<V8*>(tmp) = acc[j];
    for (int64_t r = 0; r < h; ++r) c[r * ldc + j] = tmp[r];
  }
}

/*! \brief C[i0:i1, j0:j1] for j1 - j0 <= kNarrow: lanes over rows (see kNarrow). */
TVM_SPINN_MULTIVERSION
void GemmF32Narrow(const float* a, const float* b, float* c, int64_t k, int64_t n, int64_t i0,
                   int64_t i1, int64_t j0, int64_t j1, float* abuf, const TileEnds& block) {
  const int64_t mc = i1 - i0, nc = j1 - j0;
  for (int64_t p0 = 0; p0 < k; p0 += kKc) {
    const int64_t kc = std::min(kKc, k - p0);
    for (int64_t ip = 0; ip < mc; ip += 8) {
      TileEnds ends;
      ends.zero = block.zero && p0 == 0;
      if (p0 + kc == k && block.e) {
        ends.e = block.e;
        ends.row_bias = block.row_bias ? block.row_bias + ip : nullptr;
        ends.col_bias = block.col_bias;
      }
      const int64_t h = std::min<int64_t>(8, mc - ip);
      // Pack A[i0+ip : +h, p0 : p0+kc] as [k][8] (rows past h zero: computed, never stored).
      const float* src = a + (i0 + ip) * k + p0;
      for (int64_t kk = 0; kk < kc; ++kk) {
        float* d = abuf + kk * 8;
        for (int64_t r = 0; r < h; ++r) d[r] = src[r * k + kk];
        for (int64_t r = h; r < 8; ++r) d[r] = 0.0f;
      }
      const float* bp = b + p0 * n + j0;
      float* cp = c + (i0 + ip) * n + j0;
      switch (nc) {
        case 8: MicroF32Narrow<8>(kc, abuf, bp, n, cp, n, h, ends); break;
        case 7: MicroF32Narrow<7>(kc, abuf, bp, n, cp, n, h, ends); break;
        case 6: MicroF32Narrow<6>(kc, abuf, bp, n, cp, n, h, ends); break;
        case 5: MicroF32Narrow<5>(kc, abuf, bp, n, cp, n, h, ends); break;
        case 4: MicroF32Narrow<4>(kc, abuf, bp, n, cp, n, h, ends); break;
        case 3: MicroF32Narrow<3>(kc, abuf, bp, n, cp, n, h, ends); break;
        case 2: MicroF32Narrow<2>(kc, abuf, bp, n, cp, n, h, ends); break;
        default: MicroF32Narrow<1>(kc, abuf, bp, n, cp, n, h, ends); break;
      }
    }
  }
}

/*! \brief One output block C[i0:i1, j0:j1] over all of K, with its own packing buffers. */
TVM_SPINN_MULTIVERSION
void GemmF32Block(const float* a, const float* b, float* c, int64_t k, int64_t n, int64_t i0,
                  int64_t i1, int64_t j0, int64_t j1, float* abuf, float* bbuf, const TileEnds& block) {
  const int64_t mc = i1 - i0, nc = j1 - j0;
  if (nc <= kNarrow && mc >= 8) {
    GemmF32Narrow(a, b, c, k, n, i0, i1, j0, j1, abuf, block);
    return;
  }
  const bool in_place = mc <= kMr;  // one row panel: read full B panels where they are
  for (int64_t p0 = 0; p0 < k; p0 += kKc) {
    const int64_t kc = std::min(kKc, k - p0);
    // Pack B[p0:p0+kc, j0:j1] into 16-column panels (in place: only the ragged last panel).
    for (int64_t jp = in_place ? (nc / kNr) * kNr : 0; jp < nc; jp += kNr) {
      const int64_t w = std::min<int64_t>(kNr, nc - jp);
      float* dst = bbuf + jp * kc;
      const float* src = b + p0 * n + j0 + jp;
      if (w == kNr) {
        for (int64_t kk = 0; kk < kc; ++kk) std::memcpy(dst + kk * kNr, src + kk * n, sizeof(float) * kNr);
      } else {
        for (int64_t kk = 0; kk < kc; ++kk) {
          float* d = dst + kk * kNr;
          std::memcpy(d, src + kk * n, sizeof(float) * static_cast<size_t>(w));
          std::memset(d + w, 0, sizeof(float) * static_cast<size_t>(kNr - w));
        }
      }
    }
    // Pack A[i0:i1, p0:p0+kc] into panels of up to kMr rows ([k][rows]).
    for (int64_t ip = 0; ip < mc; ip += kMr) {
      const int64_t h = std::min<int64_t>(kMr, mc - ip);
      float* dst = abuf + ip * kc;
      const float* src = a + (i0 + ip) * k + p0;
      for (int64_t r = 0; r < h; ++r)
        for (int64_t kk = 0; kk < kc; ++kk) dst[kk * h + r] = src[r * k + kk];
    }
    for (int64_t jp = 0; jp < nc; jp += kNr) {
      const int64_t w = std::min<int64_t>(kNr, nc - jp);
      const bool direct = in_place && w == kNr;
      const float* bp = direct ? b + p0 * n + j0 + jp : bbuf + jp * kc;
      const int64_t ldb = direct ? n : kNr;
      for (int64_t ip = 0; ip < mc; ip += kMr) {
        const int64_t h = std::min<int64_t>(kMr, mc - ip);
        const float* ap = abuf + ip * kc;
        float* cp = c + (i0 + ip) * n + j0 + jp;
        TileEnds ends;
        ends.zero = block.zero && p0 == 0;
        if (p0 + kc == k && block.e) {
          ends.e = block.e;
          ends.row_bias = block.row_bias ? block.row_bias + ip : nullptr;
          ends.col_bias = block.col_bias ? block.col_bias + jp : nullptr;
        }
        switch (h) {
          case 5: MicroF32<5>(kc, ap, bp, ldb, cp, n, w, ends); break;
          case 4: MicroF32<4>(kc, ap, bp, ldb, cp, n, w, ends); break;
          case 3: MicroF32<3>(kc, ap, bp, ldb, cp, n, w, ends); break;
          case 2: MicroF32<2>(kc, ap, bp, ldb, cp, n, w, ends); break;
          default: MicroF32<1>(kc, ap, bp, ldb, cp, n, w, ends); break;
        }
      }
    }
  }
}

// Integer GEMM when no accumulator can wrap (every chunk is accumulator-safe: chunk * max|a*b|
// fits acc_bits): each chunk sum is then exact, and adding exact chunk sums to C modulo 2^32 is
// adding every product to C modulo 2^32, in any grouping. So the result is the int32 wrapping
// GEMM, computed here with the fp32 kernel's register blocking on uint32 lanes (wrapping adds).
typedef uint32_t U8 __attribute__((vector_size(32)));
typedef uint32_t U8u __attribute__((vector_size(32), aligned(4)));

template <int MR>
TVM_SPINN_INLINE void MicroU32(int64_t kc, const uint32_t* __restrict ap,
                               const uint32_t* __restrict bp, int32_t* __restrict c, int64_t ldc,
                               int64_t nc) {
  U8 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) {
    alignas(32) uint32_t tmp[kNr] = {};
    std::memcpy(tmp, c + r * ldc, static_cast<size_t>(nc) * sizeof(uint32_t));
    acc0[r] = *reinterpret_cast<const U8*>(tmp);
    acc1[r] = *reinterpret_cast<const U8*>(tmp + 8);
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    const U8 b0 = *reinterpret_cast<const U8*>(bp);
    const U8 b1 = *reinterpret_cast<const U8*>(bp + 8);
    for (int r = 0; r < MR; ++r) {
      const uint32_t av = ap[r];
      acc0[r] += b0 * av;
      acc1[r] += b1 * av;
    }
    ap += MR;
    bp += kNr;
  }
  for (int r = 0; r < MR; ++r) {
    alignas(32) uint32_t tmp[kNr];
    *reinterpret_cast<U8*>(tmp) = acc0[r];
    *reinterpret_cast<U8*>(tmp + 8) = acc1[r];
    std::memcpy(c + r * ldc, tmp, static_cast<size_t>(nc) * sizeof(uint32_t));
  }
}

template <typename T>
TVM_SPINN_INLINE void GemmWrapBlockImpl(const T* a, const T* b, int32_t* c, int64_t k, int64_t n,
                                        int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                                        uint32_t* abuf, uint32_t* bbuf) {
  const int64_t mc = i1 - i0, nc = j1 - j0;
  for (int64_t p0 = 0; p0 < k; p0 += kKc) {
    const int64_t kc = std::min(kKc, k - p0);
    for (int64_t jp = 0; jp < nc; jp += kNr) {
      const int64_t w = std::min<int64_t>(kNr, nc - jp);
      uint32_t* dst = bbuf + jp * kc;
      const T* src = b + p0 * n + j0 + jp;
      for (int64_t kk = 0; kk < kc; ++kk) {
        uint32_t* d = dst + kk * kNr;
        const T* sr = src + kk * n;
        for (int64_t j = 0; j < w; ++j) d[j] = static_cast<uint32_t>(static_cast<int32_t>(sr[j]));
        for (int64_t j = w; j < kNr; ++j) d[j] = 0;
      }
    }
    for (int64_t ip = 0; ip < mc; ip += kMr) {
      const int64_t h = std::min<int64_t>(kMr, mc - ip);
      uint32_t* dst = abuf + ip * kc;
      const T* src = a + (i0 + ip) * k + p0;
      for (int64_t r = 0; r < h; ++r)
        for (int64_t kk = 0; kk < kc; ++kk)
          dst[kk * h + r] = static_cast<uint32_t>(static_cast<int32_t>(src[r * k + kk]));
    }
    for (int64_t jp = 0; jp < nc; jp += kNr) {
      const int64_t w = std::min<int64_t>(kNr, nc - jp);
      const uint32_t* bp = bbuf + jp * kc;
      for (int64_t ip = 0; ip < mc; ip += kMr) {
        const int64_t h = std::min<int64_t>(kMr, mc - ip);
        const uint32_t* ap = abuf + ip * kc;
        int32_t* cp = c + (i0 + ip) * n + j0 + jp;
        switch (h) {
          case 5: MicroU32<5>(kc, ap, bp, cp, n, w); break;
          case 4: MicroU32<4>(kc, ap, bp, cp, n, w); break;
          case 3: MicroU32<3>(kc, ap, bp, cp, n, w); break;
          case 2: MicroU32<2>(kc, ap, bp, cp, n, w); break;
          default: MicroU32<1>(kc, ap, bp, cp, n, w); break;
        }
      }
    }
  }
}

TVM_SPINN_MULTIVERSION
void GemmWrapBlockI8(const int8_t* a, const int8_t* b, int32_t* c, int64_t k, int64_t n,
                     int64_t i0, int64_t i1, int64_t j0, int64_t j1, uint32_t* abuf,
                     uint32_t* bbuf) {
  GemmWrapBlockImpl(a, b, c, k, n, i0, i1, j0, j1, abuf, bbuf);
}

TVM_SPINN_MULTIVERSION
void GemmWrapBlockI16(const int16_t* a, const int16_t* b, int32_t* c, int64_t k, int64_t n,
                      int64_t i0, int64_t i1, int64_t j0, int64_t j1, uint32_t* abuf,
                      uint32_t* bbuf) {
  GemmWrapBlockImpl(a, b, c, k, n, i0, i1, j0, j1, abuf, bbuf);
}

inline void GemmWrapBlock(const int8_t* a, const int8_t* b, int32_t* c, int64_t k, int64_t n,
                          int64_t i0, int64_t i1, int64_t j0, int64_t j1, uint32_t* abuf,
                          uint32_t* bbuf) {
  GemmWrapBlockI8(a, b, c, k, n, i0, i1, j0, j1, abuf, bbuf);
}
inline void GemmWrapBlock(const int16_t* a, const int16_t* b, int32_t* c, int64_t k, int64_t n,
                          int64_t i0, int64_t i1, int64_t j0, int64_t j1, uint32_t* abuf,
                          uint32_t* bbuf) {
  GemmWrapBlockI16(a, b, c, k, n, i0, i1, j0, j1, abuf, bbuf);
}

/*! \brief Split [0, total) into blocks of at most `max_block` (a multiple of `unit`). */
int64_t BlockSize(int64_t total, int64_t max_block, int64_t unit) {
  if (total <= 0) return unit;
  const int64_t blocks = (total + max_block - 1) / max_block;
  const int64_t size = (total + blocks - 1) / blocks;
  return ((size + unit - 1) / unit) * unit;
}

int ConfiguredThreads() {
  if (const char* env = std::getenv("TVM_SPINN_SIM_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && v > 0) return static_cast<int>(std::min<long>(v, 1024));
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw ? static_cast<int>(hw) : 1;
}

template <typename T, bool kFull32>
TVM_SPINN_INLINE int64_t ChunkedIntBlock(const T* a, const T* b, int32_t* c, int64_t k, int64_t n,
                                         int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                                         int64_t chunk, int acc_bits) {
  constexpr int64_t kRows = 4, kCols = 256;
  const int shift = 32 - acc_bits;
  int64_t wraps = 0;
  alignas(64) int32_t part[kRows][kCols];
  const int64_t mi = i1 - i0, nj = j1 - j0;
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t k1 = std::min(k, k0 + chunk);
    for (int64_t i = 0; i < mi; ++i) std::memset(part[i], 0, sizeof(int32_t) * static_cast<size_t>(nj));
    for (int64_t kk = k0; kk < k1; ++kk) {
      const T* __restrict brow = b + kk * n + j0;
      for (int64_t i = 0; i < mi; ++i) {
        const int32_t av = a[(i0 + i) * k + kk];
        int32_t* __restrict prow = part[i];
        int32_t row_wraps = 0;
        for (int64_t j = 0; j < nj; ++j) {
          prow[j] = WrapAdd<kFull32>(prow[j], av * static_cast<int32_t>(brow[j]), shift, &row_wraps);
        }
        wraps += row_wraps;
      }
    }
    for (int64_t i = 0; i < mi; ++i) {  // the M4F's 32-bit adds of the chunk sums
      int32_t* __restrict crow = c + (i0 + i) * n + j0;
      for (int64_t j = 0; j < nj; ++j)
        crow[j] = static_cast<int32_t>(static_cast<uint32_t>(crow[j]) +
                                       static_cast<uint32_t>(part[i][j]));
    }
  }
  return wraps;
}

template <typename T>
TVM_SPINN_INLINE int64_t ChunkedInt(const T* a, const T* b, int32_t* c, int64_t k, int64_t n,
                                    int64_t i0, int64_t i1, int64_t j0, int64_t j1, int64_t chunk,
                                    int acc_bits) {
  return acc_bits >= 32
             ? ChunkedIntBlock<T, true>(a, b, c, k, n, i0, i1, j0, j1, chunk, acc_bits)
             : ChunkedIntBlock<T, false>(a, b, c, k, n, i0, i1, j0, j1, chunk, acc_bits);
}

TVM_SPINN_MULTIVERSION
int64_t ChunkedI8(const int8_t* a, const int8_t* b, int32_t* c, int64_t k, int64_t n, int64_t i0,
                  int64_t i1, int64_t j0, int64_t j1, int64_t chunk, int acc_bits) {
  return ChunkedInt(a, b, c, k, n, i0, i1, j0, j1, chunk, acc_bits);
}

TVM_SPINN_MULTIVERSION
int64_t ChunkedI16(const int16_t* a, const int16_t* b, int32_t* c, int64_t k, int64_t n,
                   int64_t i0, int64_t i1, int64_t j0, int64_t j1, int64_t chunk, int acc_bits) {
  return ChunkedInt(a, b, c, k, n, i0, i1, j0, j1, chunk, acc_bits);
}

/*!
 * \brief Run `block` over the (batch, row block, column block) grid of a batched GEMM, in
 *        parallel, each thread with its own packing buffers of `Buf` (reused across calls).
 *        Blocks are finer in n when a layer has fewer blocks than twice the threads; blocking
 *        only changes which outputs a thread visits, never the k order of an output.
 */
template <typename Buf, typename T, typename C, typename Block>
void PackedBlocks(const T* a, const T* b, C* c, const BatchedGemm& s, int threads, Block block) {
  const int64_t mc = BlockSize(s.m, kMc, kMr);
  int64_t nc = BlockSize(s.n, kNc, kNr);
  const int64_t mb = (s.m + mc - 1) / mc;
  while (s.batch * mb * ((s.n + nc - 1) / nc) < 2 * int64_t{threads} && nc > 4 * kNr) {
    nc = ((nc / 2 + kNr - 1) / kNr) * kNr;
  }
  const int64_t nb = (s.n + nc - 1) / nc;
  const int64_t kc = std::min(kKc, std::max<int64_t>(s.k, 1));
  ParallelFor(s.batch * mb * nb, threads, [&](int64_t t) {
    thread_local std::unique_ptr<Buf[], AlignedFree> abuf, bbuf;
    thread_local int64_t abuf_size = 0, bbuf_size = 0;
    if (abuf_size < mc * kc) {
      abuf = AlignedBuffer<Buf>(static_cast<size_t>(mc * kc));
      abuf_size = mc * kc;
    }
    if (bbuf_size < nc * kc) {
      bbuf = AlignedBuffer<Buf>(static_cast<size_t>(nc * kc));
      bbuf_size = nc * kc;
    }
    const int64_t bi = t / (mb * nb), rest = t % (mb * nb);
    const int64_t i0 = (rest / nb) * mc, j0 = (rest % nb) * nc;
    block(a + s.a_index[bi] * s.m * s.k, b + s.b_index[bi] * s.k * s.n, c + bi * s.m * s.n, s.k,
          s.n, i0, std::min(s.m, i0 + mc), j0, std::min(s.n, j0 + nc), abuf.get(), bbuf.get());
  });
}

template <typename T, typename Block>
int64_t GemmIntBatched(const T* a, const T* b, int32_t* c, const BatchedGemm& s, int64_t chunk,
                       int acc_bits, int threads, Block block) {
  constexpr int64_t kRows = 4, kCols = 256;
  if (s.batch <= 0 || s.m <= 0 || s.n <= 0) return 0;
  if (chunk <= 0) chunk = std::max<int64_t>(s.k, 1);
  // No partial sum of a chunk can leave the accumulator (|a*b| <= 2^(2*bits-2)): no wraps, and
  // the result is the int32 wrapping GEMM (see GemmWrapBlockImpl).
  const int64_t max_product = int64_t{1} << (2 * (8 * sizeof(T)) - 2);
  const int64_t acc_max = (int64_t{1} << (acc_bits - 1)) - 1;
  if (std::min(chunk, s.k) <= acc_max / max_product && s.m >= kMr) {  // (few rows: packing costs)
    PackedBlocks<uint32_t>(a, b, c, s, threads,
                           [](const T* ab, const T* bb, int32_t* cb, int64_t k, int64_t n, int64_t i0,
                              int64_t i1, int64_t j0, int64_t j1, uint32_t* ap, uint32_t* bp) {
                             GemmWrapBlock(ab, bb, cb, k, n, i0, i1, j0, j1, ap, bp);
                           });
    return 0;
  }
  const int64_t mb = (s.m + kRows - 1) / kRows, nb = (s.n + kCols - 1) / kCols;
  std::atomic<int64_t> wraps{0};
  ParallelFor(s.batch * mb * nb, threads, [&](int64_t t) {
    const int64_t bi = t / (mb * nb), rest = t % (mb * nb);
    const int64_t i0 = (rest / nb) * kRows, j0 = (rest % nb) * kCols;
    const int64_t w = block(a + s.a_index[bi] * s.m * s.k, b + s.b_index[bi] * s.k * s.n,
                            c + bi * s.m * s.n, s.k, s.n, i0, std::min(s.m, i0 + kRows), j0,
                            std::min(s.n, j0 + kCols), chunk, acc_bits);
    if (w) wraps.fetch_add(w);
  });
  return wraps.load();
}

template <typename T>
void Im2ColImpl(const T* x, T* out, const Im2ColShape& s, T fill, int threads) {
  const int64_t planes = s.n * s.groups * s.cg;  // one task per input channel of each image
  const int64_t pixels = s.oh * s.ow;
  ParallelFor(planes, threads, [&](int64_t plane) {
    const T* src = x + plane * s.h * s.w;
    // plane = (img * groups + g) * cg + c: its rows start at ((img*groups+g) * cg + c) * kh*kw.
    T* dst = out + plane * s.kh * s.kw * pixels;
    for (int64_t i = 0; i < s.kh; ++i) {
      for (int64_t j = 0; j < s.kw; ++j) {
        T* row = dst + (i * s.kw + j) * pixels;
        const int64_t dx = j * s.dil_w - s.pad_left;
        for (int64_t oy = 0; oy < s.oh; ++oy) {
          T* o = row + oy * s.ow;
          const int64_t iy = oy * s.stride_h - s.pad_top + i * s.dil_h;
          if (iy < 0 || iy >= s.h) {
            std::fill(o, o + s.ow, fill);
            continue;
          }
          const T* in = src + iy * s.w;
          if (s.stride_w == 1) {
            // ix = ox + dx: valid for ox in [max(0, -dx), min(ow, w - dx))
            const int64_t lo = std::clamp<int64_t>(-dx, 0, s.ow);
            const int64_t hi = std::clamp<int64_t>(s.w - dx, lo, s.ow);
            std::fill(o, o + lo, fill);
            if (hi > lo) std::memcpy(o + lo, in + lo + dx, sizeof(T) * static_cast<size_t>(hi - lo));
            std::fill(o + hi, o + s.ow, fill);
          } else {
            for (int64_t ox = 0; ox < s.ow; ++ox) {
              const int64_t ix = ox * s.stride_w + dx;
              o[ox] = (ix >= 0 && ix < s.w) ? in[ix] : fill;
            }
          }
        }
      }
    }
  });
}

// Element-wise float additions on whole 8-lane vectors, written `acc + x` like the
// GEMM micro-kernel: when both operands are NaN, x86 returns the first operand's payload, and
// explicit vector operations keep the operand order the reference (numpy: `acc + x`) has.
// `n8` is a multiple of 8: callers pad rows to it (the padding lanes are never stored back).
// A NaN lane takes the M4F's NaN (M4fAdd) instead.
TVM_SPINN_INLINE void AddRow(float* __restrict acc, const float* __restrict x, int64_t n8) {
  for (int64_t v = 0; v < n8; v += 8) {
    const V8 a = *reinterpret_cast<const V8u*>(acc + v);
    const V8 b = *reinterpret_cast<const V8u*>(x + v);
    V8 r = a + b;
    if (AnyNaN(reinterpret_cast<const float*>(&r), 8)) {
      for (int l = 0; l < 8; ++l) r[l] = M4fAdd(a[l], b[l]);
    }
    *reinterpret_cast<V8u*>(acc + v) = r;
  }
}

TVM_SPINN_INLINE void AddScalarRow(float* __restrict acc, float x, int64_t n8) {
  for (int64_t v = 0; v < n8; v += 8) {
    const V8 a = *reinterpret_cast<const V8u*>(acc + v);
    V8 r = a + x;
    if (AnyNaN(reinterpret_cast<const float*>(&r), 8)) {
      for (int l = 0; l < 8; ++l) r[l] = M4fAdd(a[l], x);
    }
    *reinterpret_cast<V8u*>(acc + v) = r;
  }
}

/*! \brief The epilogue on one row held in `row` (n8 lanes; `bias_cols` padded likewise). */
TVM_SPINN_INLINE void EpilogueRow(float* row, int64_t cols, int64_t n8, const float* bias_cols,
                                  float bias, const EpilogueF32& e) {
  if (bias_cols) {
    AddRow(row, bias_cols, n8);
  } else if (e.bias) {
    AddScalarRow(row, bias, n8);
  }
  if (e.relu) {
    for (int64_t j = 0; j < cols; ++j) row[j] = (row[j] > 0.0f || row[j] != row[j]) ? row[j] : 0.0f;
  }
  if (e.clip) {  // NaN kept, as the relu
    const float lo = e.lo, hi = e.hi;
    for (int64_t j = 0; j < cols; ++j) {
      const float y = (row[j] < hi || row[j] != row[j]) ? row[j] : hi;
      row[j] = (y > lo || y != y) ? y : lo;
    }
  }
}

/*! \brief A thread's scratch rows (8-lane padded), reused across calls. */
float* Scratch(std::vector<float>* buf, int64_t floats) {
  if (static_cast<int64_t>(buf->size()) < floats) buf->resize(static_cast<size_t>(floats));
  return buf->data();
}

TVM_SPINN_MULTIVERSION
void EpilogueRows(float* c, int64_t rows, int64_t cols, const EpilogueF32& e) {
  thread_local std::vector<float> scratch;
  const int64_t n8 = (cols + 7) / 8 * 8;
  float* row = Scratch(&scratch, 2 * n8);
  float* bias_cols = nullptr;
  if (e.bias && !e.bias_on_rows) {
    bias_cols = row + n8;
    std::memcpy(bias_cols, e.bias, sizeof(float) * cols);
    std::fill(bias_cols + cols, bias_cols + n8, 0.0f);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = c + r * cols;
    std::memcpy(row, out, sizeof(float) * cols);
    std::fill(row + cols, row + n8, 0.0f);
    EpilogueRow(row, cols, n8, bias_cols, (e.bias && e.bias_on_rows) ? e.bias[r] : 0.0f, e);
    std::memcpy(out, row, sizeof(float) * cols);
  }
}

// Splits the 16 floats at p into their even lanes (to d0) and odd lanes (to d1): a stride-2
// row's two column phases.
TVM_SPINN_INLINE void SplitLanes(const float* p, float* d0, float* d1) {
  const V8 a = *reinterpret_cast<const V8u*>(p);
  const V8 b = *reinterpret_cast<const V8u*>(p + 8);
#if defined(__clang__)
  *reinterpret_cast<V8u*>(d0) = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
  *reinterpret_cast<V8u*>(d1) = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#else
  typedef int32_t I8 __attribute__((vector_size(32)));
  *reinterpret_cast<V8u*>(d0) = __builtin_shuffle(a, b, I8{0, 2, 4, 6, 8, 10, 12, 14});
  *reinterpret_cast<V8u*>(d1) = __builtin_shuffle(a, b, I8{1, 3, 5, 7, 9, 11, 13, 15});
#endif
}

// One input plane of a depthwise conv: its window rows are copied once into `pad` (padding
// +0.0, as im2col's fill; 8 floats of slack at the end for whole-vector reads), then every
// output of the plane's `mult` output channels adds its kh * kw taps in im2col order (k
// strictly ascending), 8 outputs at a time.
TVM_SPINN_MULTIVERSION
void DepthwisePlane(const float* x, const float* w, float* out, const float* bias,
                    const DepthwiseShape& s, const EpilogueF32& e, bool zero_out, float* pad,
                    int64_t hp, int64_t wp, float* acc, float* phases, int64_t wq) {
  for (int64_t r = 0; r < hp; ++r) {
    float* d = pad + r * wp;
    const int64_t iy = r - s.pad_top;
    if (iy < 0 || iy >= s.h) {
      std::fill(d, d + wp, 0.0f);
      continue;
    }
    // column c reads x column c - pad_left where that is in [0, w)
    const int64_t lo = std::clamp<int64_t>(s.pad_left, 0, wp);
    const int64_t hi = std::clamp<int64_t>(s.w + s.pad_left, lo, wp);
    std::fill(d, d + lo, 0.0f);
    if (hi > lo) std::memcpy(d + lo, x + iy * s.w + (lo - s.pad_left), sizeof(float) * (hi - lo));
    std::fill(d + hi, d + wp, 0.0f);
  }
  std::fill(pad + hp * wp, pad + hp * wp + 8, 0.0f);
  if (s.stride_w != 1) {
    // strided columns, de-interleaved once per plane: phase q of row r holds the padded row's
    // columns q, q + sw, q + 2 sw, ... (zero-filled to wq), so every tap reads contiguously
    for (int64_t r = 0; r < hp; ++r) {
      int64_t done = 0;  // columns of each phase written with vectors (stride 2: most of them)
      if (s.stride_w == 2) {
        const float* p = pad + r * wp;
        float* d0 = phases + r * 2 * wq;
        float* d1 = d0 + wq;
        for (; 2 * done + 16 <= wp; done += 8) SplitLanes(p + 2 * done, d0 + done, d1 + done);
      }
      for (int64_t q = 0; q < s.stride_w; ++q) {
        float* d = phases + (r * s.stride_w + q) * wq;
        int64_t t = done;
        for (int64_t c = q + done * s.stride_w; c < wp; c += s.stride_w) d[t++] = pad[r * wp + c];
        std::fill(d + t, d + wq, 0.0f);
      }
    }
    std::fill(phases + hp * s.stride_w * wq, phases + hp * s.stride_w * wq + 8, 0.0f);
  }
  const int64_t n8 = (s.ow + 7) / 8 * 8;
  const int64_t taps = s.kh * s.kw;
  // where tap t of output row 0 reads (in place with stride 1, reading whole vectors into the
  // slack; else in its column phase); output row oy reads `pitch` floats further on
  const float* rows[64];
  std::vector<const float*> many;
  const float** src = rows;
  if (taps > 64) {
    many.resize(static_cast<size_t>(taps));
    src = many.data();
  }
  for (int64_t i = 0; i < s.kh; ++i) {
    const int64_t r = i * s.dil_h;
    for (int64_t j = 0; j < s.kw; ++j) {
      // output ox reads padded column ox * sw + c0 = (ox + c0 / sw) * sw + c0 % sw
      const int64_t c0 = j * s.dil_w;
      src[i * s.kw + j] = s.stride_w == 1 ? pad + r * wp + c0
                                          : phases + (r * s.stride_w + c0 % s.stride_w) * wq + c0 / s.stride_w;
    }
  }
  const int64_t pitch = s.stride_w == 1 ? s.stride_h * wp : s.stride_h * s.stride_w * wq;
  // the plane's outputs as vectors of 8 (each row padded to n8): unit u is row u / (n8 / 8)
  const int64_t per_row = n8 / 8, units = s.oh * per_row;
  const bool epilogue = e.bias || e.relu || e.clip;
  // whole rows of vectors are stored in place; a ragged row (ow % 8) goes through `acc`
  const bool direct = s.ow % 8 == 0;
  auto offset = [&](int64_t u) { return (u / per_row) * pitch + (u % per_row) * 8; };
  for (int64_t m = 0; m < s.mult; ++m) {
    const float* wm = w + m * taps;
    float* om = out + m * s.oh * s.ow;
    const float* row_bias = e.bias ? bias + m : nullptr;
    if (!zero_out) {
      for (int64_t oy = 0; oy < s.oh; ++oy) {
        std::memcpy(acc + oy * n8, om + oy * s.ow, sizeof(float) * s.ow);
        std::fill(acc + oy * n8 + s.ow, acc + (oy + 1) * n8, 0.0f);
      }
    }
    auto start = [&](int64_t u) { return zero_out ? V8{} : *reinterpret_cast<const V8u*>(acc + u * 8); };
    // the epilogue on the finished vector (EpilogueRow's operations), then its store
    auto finish = [&](int64_t u, V8 v) {
      if (epilogue) v = EpilogueV8(v, e, nullptr, row_bias);
      float* dst = direct ? om + (u / per_row) * s.ow + (u % per_row) * 8 : acc + u * 8;
      *reinterpret_cast<V8u*>(dst) = v;
    };
    // each output from its value through the taps in order, x * w rounded then added, as the
    // GEMM micro-kernel: the same instructions, so the same bits, NaN payloads included. Four
    // vectors at once, from any rows: independent chains hide the add latency even when a row
    // is one or two vectors wide (MobileNet's 16x16 and 8x8 maps).
    int64_t u = 0;
    for (; u + 4 <= units; u += 4) {
      const int64_t f0 = offset(u), f1 = offset(u + 1), f2 = offset(u + 2), f3 = offset(u + 3);
      V8 a0 = start(u), a1 = start(u + 1), a2 = start(u + 2), a3 = start(u + 3);
      for (int64_t t = 0; t < taps; ++t) {
        const float* b = src[t];
        const float wt = wm[t];
        const V8 p0 = *reinterpret_cast<const V8u*>(b + f0) * wt;  // rounded product
        a0 = a0 + p0;                                               // rounded sum
        const V8 p1 = *reinterpret_cast<const V8u*>(b + f1) * wt;
        a1 = a1 + p1;
        const V8 p2 = *reinterpret_cast<const V8u*>(b + f2) * wt;
        a2 = a2 + p2;
        const V8 p3 = *reinterpret_cast<const V8u*>(b + f3) * wt;
        a3 = a3 + p3;
      }
      finish(u, a0);
      finish(u + 1, a1);
      finish(u + 2, a2);
      finish(u + 3, a3);
    }
    for (; u < units; ++u) {
      const int64_t f = offset(u);
      V8 a = start(u);
      for (int64_t t = 0; t < taps; ++t) {
        const V8 p = *reinterpret_cast<const V8u*>(src[t] + f) * wm[t];  // rounded product
        a = a + p;                                                       // rounded sum
      }
      finish(u, a);
    }
    if (!direct) {
      for (int64_t oy = 0; oy < s.oh; ++oy) std::memcpy(om + oy * s.ow, acc + oy * n8, sizeof(float) * s.ow);
    }
  }
}

}  // namespace

int SimThreads(int64_t work) { return work < (int64_t{1} << 22) ? 1 : ConfiguredThreads(); }

void GemmF32Batched(const float* a, const float* b, float* c, const BatchedGemm& s, int threads) {
  if (s.batch <= 0 || s.m <= 0 || s.n <= 0) return;
  if (s.k <= 0) {  // no products: the start value and the epilogue only
    if (s.zero_c) std::fill(c, c + s.batch * s.m * s.n, 0.0f);
    if (s.epilogue) ApplyEpilogueF32(c, s.batch, s.m, s.n, *s.epilogue, threads);
    return;
  }
  const EpilogueF32* e = s.epilogue;
  thread_local std::vector<float> start;  // C's values before, for the outputs that end NaN
  if (!s.zero_c) start.assign(c, c + s.batch * s.m * s.n);
  const bool on_rows = e && e->bias && e->bias_on_rows;
  const bool on_cols = e && e->bias && !e->bias_on_rows;
  PackedBlocks<float>(a, b, c, s, threads,
                      [&](const float* ab, const float* bb, float* cb, int64_t k, int64_t n, int64_t i0,
                          int64_t i1, int64_t j0, int64_t j1, float* ap, float* bp) {
                        TileEnds block;
                        block.zero = s.zero_c;
                        block.e = e;
                        block.row_bias = on_rows ? e->bias + i0 : nullptr;
                        block.col_bias = on_cols ? e->bias + j0 : nullptr;
                        GemmF32Block(ab, bb, cb, k, n, i0, i1, j0, j1, ap, bp, block);
                      });
  // NaN payloads and signs by the M4F's rules: the host's vector arithmetic gives x86's
  ParallelFor(s.batch, threads, [&](int64_t t) {
    float* ct = c + t * s.m * s.n;
    if (!AnyNaN(ct, s.m * s.n)) return;
    M4fNaNOutputs(a + s.a_index[t] * s.m * s.k, b + s.b_index[t] * s.k * s.n, ct,
                  s.zero_c ? nullptr : start.data() + t * s.m * s.n, s.m, s.k, s.n, e);
  });
}

int64_t GemmI8Batched(const int8_t* a, const int8_t* b, int32_t* c, const BatchedGemm& s,
                      int64_t chunk, int acc_bits, int threads) {
  return GemmIntBatched(a, b, c, s, chunk, acc_bits, threads, ChunkedI8);
}

int64_t GemmI16Batched(const int16_t* a, const int16_t* b, int32_t* c, const BatchedGemm& s,
                       int64_t chunk, int acc_bits, int threads) {
  return GemmIntBatched(a, b, c, s, chunk, acc_bits, threads, ChunkedI16);
}

void Im2Col(const void* x, void* out, const Im2ColShape& s, int elem_bytes, const void* fill,
            int threads) {
  switch (elem_bytes) {
    case 1: {
      uint8_t f;
      std::memcpy(&f, fill, 1);
      Im2ColImpl(static_cast<const uint8_t*>(x), static_cast<uint8_t*>(out), s, f, threads);
      break;
    }
    case 2: {
      uint16_t f;
      std::memcpy(&f, fill, 2);
      Im2ColImpl(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), s, f, threads);
      break;
    }
    default: {
      uint32_t f;
      std::memcpy(&f, fill, 4);
      Im2ColImpl(static_cast<const uint32_t*>(x), static_cast<uint32_t*>(out), s, f, threads);
      break;
    }
  }
}

namespace {
// 64 x 64 blocks: a block of src rows and the block of dst rows it fills both stay in L1 (16 KB
// each for 4-byte elements), so every cache line is read once and written once.
constexpr int64_t kTransposeBlock = 64;

template <typename T>
void TransposeBlocks(const T* src, T* dst, int64_t rows, int64_t cols, int threads) {
  const int64_t bands = (cols + kTransposeBlock - 1) / kTransposeBlock;  // dst row bands
  ParallelFor(bands, threads, [&](int64_t band) {
    const int64_t c0 = band * kTransposeBlock, c1 = std::min(cols, c0 + kTransposeBlock);
    for (int64_t r0 = 0; r0 < rows; r0 += kTransposeBlock) {
      const int64_t r1 = std::min(rows, r0 + kTransposeBlock);
      for (int64_t c = c0; c < c1; ++c) {
        T* out = dst + c * rows;
        for (int64_t r = r0; r < r1; ++r) out[r] = src[r * cols + c];
      }
    }
  });
}
}  // namespace

void Transpose2D(const void* src, void* dst, int64_t rows, int64_t cols, int itemsize, int threads) {
  switch (itemsize) {
    case 1: TransposeBlocks(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), rows, cols, threads); break;
    case 2: TransposeBlocks(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), rows, cols, threads); break;
    case 4: TransposeBlocks(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), rows, cols, threads); break;
    default: TransposeBlocks(static_cast<const uint64_t*>(src), static_cast<uint64_t*>(dst), rows, cols, threads); break;
  }
}

namespace {
/*!
 * \brief The M4F's NaN for the sum `a + b` (FPSCR.DN = 0, FPProcessNaNs in the v7-M ARM): a
 *        signalling operand first (the first's if both are), else a quiet one (the first's if
 *        both are), quieted; inf + -inf gives the default NaN 0x7FC00000 (x86 keeps the first
 *        operand and gives 0xFFC00000).
 */
float M4fAddNaN(float a, float b) { return M4fNaN(a, b); }
}  // namespace

float M4fNaNOf(float a, float b) { return M4fNaN(a, b); }

void RowSumF32(const float* x, float* out, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    float acc = 0.0f;
    for (int64_t j = 0; j < cols; ++j) {
      const float s = acc + row[j];
      acc = s == s ? s : M4fAddNaN(acc, row[j]);
    }
    out[r] = acc;
  }
}

void ApplyEpilogueF32(float* c, int64_t outer, int64_t rows, int64_t cols, const EpilogueF32& e,
                      int threads) {
  if (outer <= 0 || rows <= 0 || cols <= 0) return;
  ParallelFor(outer, threads, [&](int64_t t) { EpilogueRows(c + t * rows * cols, rows, cols, e); });
}

// Small feature maps (ow <= 8, one output channel per input channel): the row kernel above fills
// few lanes and pays its per-row setup for a handful of outputs. There 8 channels go in the lanes
// instead: the padded input of 8 channels channel-minor ([hp][wp][8]), the weights [taps][8];
// each lane performs the row kernel's operations for its channel (from the output's value, taps
// in order, x * w rounded then added, padding reading +0.0, then the epilogue), so the same bits.
TVM_SPINN_MULTIVERSION
void DepthwiseChannels(const float* x, const float* w, float* out, const DepthwiseShape& s,
                       const EpilogueF32& e, bool zero_out, int64_t block, int64_t hp, int64_t wp,
                       float* xt, float* wt, float* ot) {
  const int64_t blocks = (s.groups + 7) / 8;
  const int64_t img = block / blocks, c0 = (block % blocks) * 8;
  const int lanes = static_cast<int>(std::min<int64_t>(8, s.groups - c0));
  const int64_t taps = s.kh * s.kw;
  std::fill(xt, xt + hp * wp * 8, 0.0f);
  for (int l = 0; l < lanes; ++l) {
    const float* xc = x + (img * s.groups + c0 + l) * s.h * s.w;
    for (int64_t iy = 0; iy < s.h; ++iy) {
      const int64_t r = iy + s.pad_top;
      if (r >= hp) break;
      for (int64_t ix = 0; ix < s.w; ++ix) {
        const int64_t c = ix + s.pad_left;
        if (c < wp) xt[(r * wp + c) * 8 + l] = xc[iy * s.w + ix];
      }
    }
    for (int64_t t = 0; t < taps; ++t) wt[t * 8 + l] = w[(c0 + l) * taps + t];
  }
  for (int l = lanes; l < 8; ++l) {
    for (int64_t t = 0; t < taps; ++t) wt[t * 8 + l] = 0.0f;
  }
  const int64_t plane = s.oh * s.ow;
  float* ob = out + (img * s.groups + c0) * plane;
  // the outputs' values, channel-minor like the input ([oh * ow][8]); lanes past `lanes` +0.0
  if (zero_out) {
    std::fill(ot, ot + plane * 8, 0.0f);
  } else {
    for (int64_t p = 0; p < plane; ++p) {
      for (int l = 0; l < 8; ++l) ot[p * 8 + l] = l < lanes ? ob[l * plane + p] : 0.0f;
    }
  }
  // where output pixel p's first tap reads
  auto at = [&](int64_t p) { return xt + ((p / s.ow) * s.stride_h * wp + (p % s.ow) * s.stride_w) * 8; };
  auto tap = [&](int64_t t) { return ((t / s.kw) * s.dil_h * wp + (t % s.kw) * s.dil_w) * 8; };
  // four pixels at a time: independent chains hide the add latency
  int64_t p = 0;
  for (; p + 4 <= plane; p += 4) {
    const float* r0 = at(p);
    const float* r1 = at(p + 1);
    const float* r2 = at(p + 2);
    const float* r3 = at(p + 3);
    V8 a0 = *reinterpret_cast<const V8*>(ot + p * 8);
    V8 a1 = *reinterpret_cast<const V8*>(ot + p * 8 + 8);
    V8 a2 = *reinterpret_cast<const V8*>(ot + p * 8 + 16);
    V8 a3 = *reinterpret_cast<const V8*>(ot + p * 8 + 24);
    for (int64_t t = 0; t < taps; ++t) {
      const int64_t f = tap(t);
      const V8 wv = *reinterpret_cast<const V8*>(wt + t * 8);
      const V8 p0 = *reinterpret_cast<const V8*>(r0 + f) * wv;  // rounded product
      a0 = a0 + p0;                                              // rounded sum
      const V8 p1 = *reinterpret_cast<const V8*>(r1 + f) * wv;
      a1 = a1 + p1;
      const V8 p2 = *reinterpret_cast<const V8*>(r2 + f) * wv;
      a2 = a2 + p2;
      const V8 p3 = *reinterpret_cast<const V8*>(r3 + f) * wv;
      a3 = a3 + p3;
    }
    *reinterpret_cast<V8*>(ot + p * 8) = a0;
    *reinterpret_cast<V8*>(ot + p * 8 + 8) = a1;
    *reinterpret_cast<V8*>(ot + p * 8 + 16) = a2;
    *reinterpret_cast<V8*>(ot + p * 8 + 24) = a3;
  }
  for (; p < plane; ++p) {
    const float* r = at(p);
    V8 a = *reinterpret_cast<const V8*>(ot + p * 8);
    for (int64_t t = 0; t < taps; ++t) {
      const V8 q = *reinterpret_cast<const V8*>(r + tap(t)) * *reinterpret_cast<const V8*>(wt + t * 8);
      a = a + q;
    }
    *reinterpret_cast<V8*>(ot + p * 8) = a;
  }
  // the epilogue, lane by lane the row kernel's operations (bias added, then relu, then clip)
  alignas(32) float bias[8] = {};
  for (int l = 0; l < lanes && e.bias; ++l) bias[l] = e.bias[c0 + l];
  for (int64_t q = 0; q < plane; ++q) {
    float* v = ot + q * 8;
    if (e.bias) *reinterpret_cast<V8*>(v) = *reinterpret_cast<const V8*>(v) + *reinterpret_cast<const V8*>(bias);
    for (int l = 0; l < lanes; ++l) {
      float y = v[l];
      if (e.relu) y = (y > 0.0f || y != y) ? y : 0.0f;
      if (e.clip) {
        const float z = (y < e.hi || y != y) ? y : e.hi;
        y = (z > e.lo || z != z) ? z : e.lo;
      }
      ob[l * plane + q] = y;
    }
  }
}

void DepthwiseConvHost(const float* x, const float* w, float* out, const DepthwiseShape& s,
                       const EpilogueF32& e, int threads, bool zero_out);

namespace {
/*!
 * \brief The outputs of a depthwise conv the host's arithmetic left NaN, recomputed with the
 *        M4F's NaN rules as M4fNaNOutputs does for im2col + the batched GEMM (VMUL of the input
 *        by the tap's weight, VADD of the accumulator and the product, then of the bias).
 */
void DepthwiseNaNOutputs(const float* x, const float* w, float* out, const float* start,
                         const DepthwiseShape& s, const EpilogueF32& e) {
  const int64_t planes = s.n * s.groups * s.mult, size = s.oh * s.ow;
  for (int64_t p = 0; p < planes; ++p) {
    float* o = out + p * size;
    if (!AnyNaN(o, size)) continue;
    const int64_t oc = p % (s.groups * s.mult), img = p / (s.groups * s.mult), g = oc / s.mult;
    const float* xp = x + (img * s.groups + g) * s.h * s.w;
    const float* wp = w + oc * s.kh * s.kw;
    for (int64_t oy = 0; oy < s.oh; ++oy) {
      for (int64_t ox = 0; ox < s.ow; ++ox) {
        const float v = o[oy * s.ow + ox];
        if (v == v) continue;
        float acc = start ? start[p * size + oy * s.ow + ox] : 0.0f;
        for (int64_t i = 0; i < s.kh; ++i) {
          for (int64_t j = 0; j < s.kw; ++j) {
            const int64_t iy = oy * s.stride_h + i * s.dil_h - s.pad_top;
            const int64_t ix = ox * s.stride_w + j * s.dil_w - s.pad_left;
            const float xv = (iy >= 0 && iy < s.h && ix >= 0 && ix < s.w) ? xp[iy * s.w + ix] : 0.0f;
            acc = M4fAdd(acc, M4fMul(xv, wp[i * s.kw + j]));
          }
        }
        if (e.bias) acc = M4fAdd(acc, e.bias[oc]);
        o[oy * s.ow + ox] = acc;
      }
    }
  }
}
}  // namespace

void DepthwiseConvF32(const float* x, const float* w, float* out, const DepthwiseShape& s,
                      const EpilogueF32& e, int threads, bool zero_out) {
  if (s.n <= 0 || s.groups <= 0 || s.mult <= 0 || s.oh <= 0 || s.ow <= 0) return;
  thread_local std::vector<float> start;  // out's values before, for the outputs that end NaN
  if (!zero_out) start.assign(out, out + s.n * s.groups * s.mult * s.oh * s.ow);
  DepthwiseConvHost(x, w, out, s, e, threads, zero_out);
  DepthwiseNaNOutputs(x, w, out, zero_out ? nullptr : start.data(), s, e);
}

void DepthwiseConvHost(const float* x, const float* w, float* out, const DepthwiseShape& s,
                       const EpilogueF32& e, int threads, bool zero_out) {
  if (s.mult == 1 && s.ow <= 8 && s.groups >= 8) {
    const int64_t hp = (s.oh - 1) * s.stride_h + (s.kh - 1) * s.dil_h + 1;
    const int64_t wp = (s.ow - 1) * s.stride_w + (s.kw - 1) * s.dil_w + 1;
    const int64_t taps = s.kh * s.kw;
    ParallelFor(s.n * ((s.groups + 7) / 8), threads, [&](int64_t block) {
      thread_local std::unique_ptr<float[], AlignedFree> buf;
      thread_local int64_t size = 0;
      const int64_t need = (hp * wp + taps + s.oh * s.ow) * 8;
      if (size < need) {
        buf = AlignedBuffer<float>(static_cast<size_t>(need));
        size = need;
      }
      DepthwiseChannels(x, w, out, s, e, zero_out, block, hp, wp, buf.get(), buf.get() + hp * wp * 8,
                        buf.get() + (hp * wp + taps) * 8);
    });
    return;
  }
  // the padded window rows and columns the outputs read
  const int64_t hp = (s.oh - 1) * s.stride_h + (s.kh - 1) * s.dil_h + 1;
  const int64_t wp = (s.ow - 1) * s.stride_w + (s.kw - 1) * s.dil_w + 1;
  const int64_t n8 = (s.ow + 7) / 8 * 8;
  // a phase row holds every column an output row reads from it: ow - 1 + (kw - 1) dw / sw + 1
  const int64_t wq = (wp + s.stride_w - 1) / s.stride_w;
  ParallelFor(s.n * s.groups, threads, [&](int64_t plane) {
    thread_local std::vector<float> scratch;
    // the padded plane and its column phases (each + 8 floats of slack), the accumulator rows
    float* pad = Scratch(&scratch, hp * wp + 8 + s.oh * n8 + (s.stride_w > 1 ? hp * s.stride_w * wq + 8 : 0));
    const int64_t g = plane % s.groups;
    const float* bias = e.bias ? e.bias + g * s.mult : nullptr;
    DepthwisePlane(x + plane * s.h * s.w, w + g * s.mult * s.kh * s.kw,
                   out + plane * s.mult * s.oh * s.ow, bias, s, e, zero_out, pad, hp, wp,
                   pad + hp * wp + 8, pad + hp * wp + 8 + s.oh * n8, wq);
  });
}

// -- transcendental models ----------------------------------------------------------------------
// Written as sequences of separately rounded float operations (-ffp-contract=off, no fast-math),
// element by element, so every build and every x86 SIMD level gives the same bits.
namespace {

// 2^e as a float, for e in [-126, 127] (a normal number: exact).
inline float Pow2(int e) {
  uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// p * 2^n for p in [0.5, 2) and n in [-151, 128], rounded once (as ldexp): a product by an
// exact power of two only rounds when the result is subnormal, and the split products below
// are exact until their last one.
inline float Scale2(float p, int n) {
  if (n > 127) return (p * Pow2(127)) * Pow2(n - 127);
  if (n < -126) return (p * Pow2(n + 64)) * Pow2(-64);
  return p * Pow2(n);
}

inline float ExpModel(float x) {
  if (!(x == x)) return x;                    // NaN
  if (x > 88.72283905206835f) return x + INFINITY;  // exp overflows float32 (inf stays inf)
  if (x < -103.97208f) return 0.0f;           // below half the smallest subnormal
  // n = round(x / ln 2), ties to even: adding and subtracting 1.5 * 2^23 rounds a float of
  // magnitude < 2^22 to an integer in the current (nearest-even) mode, as nearbyint does
  const float shifted = x * 1.44269504088896341f + 12582912.0f;
  const float fn = shifted - 12582912.0f;
  float r = x - fn * 0.693359375f;            // Cody-Waite: ln 2 = C1 + C2, C1 exact in 9 bits
  r = r - fn * -2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2;
  p = p + r;
  p = p + 1.0f;
  return Scale2(p, static_cast<int>(fn));
}

inline float TanhModel(float x) {
  const float z = std::fabs(x);
  if (z > 0.625f) {
    if (z > 44.0f) return x > 0.0f ? 1.0f : -1.0f;  // exp(2z) overflows: tanh is +-1 exactly
    const float s = ExpModel(z + z);
    const float t = 1.0f - 2.0f / (s + 1.0f);
    return x < 0.0f ? -t : t;
  }
  if (x == 0.0f) return x;  // keeps the sign of zero
  const float s = x * x;
  float p = -5.70498872745e-3f;
  p = p * s + 2.06390887954e-2f;
  p = p * s - 5.37397155531e-2f;
  p = p * s + 1.33314422036e-1f;
  p = p * s - 3.33332819422e-1f;
  p = p * s;
  p = p * x;
  return p + x;  // NaN propagates through the polynomial
}

}  // namespace

void ExpF32(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = ExpModel(x[i]);
}

void TanhF32(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = TanhModel(x[i]);
}

namespace {

// A NaN with its quiet bit set (what an M4F arithmetic instruction makes of a NaN operand,
// FPSCR.DN = 0: its sign and payload kept).
inline float QuietNaN(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits |= 0x00400000u;
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}

// For a NaN x the activations below return the NaN the PE kernel's instructions pass on (each
// operation with a NaN operand returns its first NaN operand, quieted: ARMv7-M ARM A2.5.5):
// x86 returns the first operand of the instruction the compiler chose, whose operands of a
// commutative multiply or add it may swap, so the C++ arithmetic cannot be left to decide.
inline float GeluModel(float x) {
  if (!(x == x)) return QuietNaN(x);  // 0.5 * x is the first NaN of the final product
  const float u = x * 0.70710678118654752f;
  const float sign = u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : (u == u ? 0.0f : u));  // np.sign
  const float a = std::fabs(u);
  const float q = 0.3275911f * a;
  const float t = 1.0f / (1.0f + q);
  float p = t * 1.061405429f;
  p = -1.453152027f + p;
  p = t * p;
  p = 1.421413741f + p;
  p = t * p;
  p = -0.284496736f + p;
  p = t * p;
  p = 0.254829592f + p;
  p = t * p;
  const float na = -a;
  const float e = ExpModel(na * a);
  const float pe = p * e;
  const float erf = sign * (1.0f - pe);
  const float half = 0.5f * x;
  return half * (1.0f + erf);
}

inline float GeluTanhModel(float x) {
  const float c = 0.044715f * x;
  const float c2 = c * x;
  const float c3 = c2 * x;
  const float inner = 0.7978845608028654f * (x + c3);
  const float half = 0.5f * x;
  return half * (1.0f + TanhModel(inner));
}

inline float SigmoidModel(float x) {
  if (!(x == x)) return QuietNaN(-x);  // exp(-x) is -x (VNEG flips the sign), then 1 + e and 1 / d pass it on
  return 1.0f / (1.0f + ExpModel(-x));
}

}  // namespace

namespace {
void ActivationHost(const float* x, float* out, int64_t n, Activation act);
}  // namespace

void ActivationF32(const float* x, float* out, int64_t n, Activation act) {
  ActivationHost(x, out, n, act);
  // an invalid operation on numbers (gelu(-inf): -inf * 0) gives the M4F's default NaN
  // 0x7FC00000 (FPSCR.DN = 0 keeps only operands' NaNs); x86's is 0xFFC00000
  const uint32_t d = 0x7FC00000u;
  for (int64_t i = 0; i < n; ++i) {
    if (out[i] != out[i] && x[i] == x[i]) std::memcpy(out + i, &d, sizeof d);
  }
}

namespace {
void ActivationHost(const float* x, float* out, int64_t n, Activation act) {
  switch (act) {
    case Activation::kGelu:
      for (int64_t i = 0; i < n; ++i) out[i] = GeluModel(x[i]);
      break;
    case Activation::kGeluTanh:
      for (int64_t i = 0; i < n; ++i) out[i] = GeluTanhModel(x[i]);
      break;
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = SigmoidModel(x[i]);
      break;
  }
}
}  // namespace

namespace {
/*! \brief The host's operations: the fast path (its NaNs are fixed afterwards where a row has one). */
struct HostOps {
  static float Add(float a, float b) { return a + b; }
  static float Sub(float a, float b) { return a - b; }
  static float Mul(float a, float b) { return a * b; }
  static float Div(float a, float b) { return a / b; }
  static float Sqrt(float a) { return std::sqrt(a); }
};

/*! \brief The M4F's VADD/VSUB/VMUL/VDIV/VSQRT with their NaN results (M4fNaN: a signalling operand
 *         first, then the first quiet one; an invalid operation's default NaN 0x7FC00000), operand
 *         order kept: a row with a NaN output is computed again with these. */
struct M4fOps {
  static float Add(float a, float b) { return M4fAdd(a, b); }
  static float Sub(float a, float b) {
    const float r = a - b;
    return r == r ? r : M4fNaN(a, b);
  }
  static float Mul(float a, float b) { return M4fMul(a, b); }
  static float Div(float a, float b) {
    const float r = a / b;
    return r == r ? r : M4fNaN(a, b);
  }
  static float Sqrt(float a) {
    const float r = std::sqrt(a);
    return r == r ? r : M4fNaN(a, a);  // a NaN quieted; the square root of a negative number: default NaN
  }
};

template <typename Ops>
void SoftmaxRow(const float* xr, float* o, int64_t cols) {
  float m = -INFINITY;
  for (int64_t j = 0; j < cols; ++j) {
    const float v = xr[j];
    if (!(v == v)) {  // NaN: the max is the row's first NaN (the PE kernel's rule)
      m = v;
      break;
    }
    if (v > m) m = v;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < cols; ++j) {
    o[j] = ExpModel(Ops::Sub(xr[j], m));
    sum = Ops::Add(sum, o[j]);
  }
  for (int64_t j = 0; j < cols; ++j) o[j] = Ops::Div(o[j], sum);
}
}  // namespace

void SoftmaxRowsF32(const float* x, float* out, int64_t rows, int64_t cols, int threads) {
  ParallelFor(rows, threads, [&](int64_t r) {
    const float* xr = x + r * cols;
    float* o = out + r * cols;
    SoftmaxRow<HostOps>(xr, o, cols);
    if (AnyNaN(o, cols)) SoftmaxRow<M4fOps>(xr, o, cols);  // the NaNs' sign and payload as the M4F has them
  });
}

namespace {

// Cephes logf, operations in its order, each rounded once (no contraction, CMakeLists.txt).
inline float LogModel(float x) {
  if (!(x == x)) return x;                     // NaN
  if (x < 0.0f) return std::numeric_limits<float>::quiet_NaN();
  if (x == 0.0f) return -INFINITY;
  if (x == INFINITY) return x;
  int e = 0;
  float m = std::frexp(x, &e);                 // x = m 2^e, m in [0.5, 1): exact
  if (m < 0.707106781186547524f) {
    e -= 1;
    m = m + m - 1.0f;                          // m + m exact; the subtract is exact (Sterbenz)
  } else {
    m = m - 1.0f;
  }
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m;
  y = y * z;
  const float fe = static_cast<float>(e);
  y = y + -2.12194440e-4f * fe;
  y = y + -0.5f * z;
  float r = m + y;
  r = r + 0.693359375f * fe;
  return r;
}

// The row's max (its first NaN if it has one) and the sequential fp32 sum of exp(x - max): the
// softmax's statistics (SoftmaxRowsF32), shared by the cross-entropy kernels; Ops as SoftmaxRow's.
template <typename Ops>
inline void SoftmaxStats(const float* xr, int64_t cols, float* m_out, float* s_out) {
  float m = -INFINITY;
  for (int64_t j = 0; j < cols; ++j) {
    const float v = xr[j];
    if (!(v == v)) {
      m = v;
      break;
    }
    if (v > m) m = v;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < cols; ++j) sum = Ops::Add(sum, ExpModel(Ops::Sub(xr[j], m)));
  *m_out = m;
  *s_out = sum;
}

// One row's loss `log(s) - (z[t] - m)`.
template <typename Ops>
inline float CrossEntropyRow(const float* zr, int64_t cols, int64_t t) {
  float m, s;
  SoftmaxStats<Ops>(zr, cols, &m, &s);
  return Ops::Sub(LogModel(s), Ops::Sub(zr[t], m));
}

// One row's gradient `(exp(z - m) / s - [j == t]) / divisor`.
template <typename Ops>
inline void CrossEntropyGradRow(const float* zr, float* o, int64_t cols, int64_t t, float divisor) {
  float m, s;
  SoftmaxStats<Ops>(zr, cols, &m, &s);
  for (int64_t j = 0; j < cols; ++j) {
    const float p = Ops::Div(ExpModel(Ops::Sub(zr[j], m)), s);
    o[j] = Ops::Div(Ops::Sub(p, j == t ? 1.0f : 0.0f), divisor);
  }
}

}  // namespace

void LogF32(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = LogModel(x[i]);
}

void CrossEntropyRowsF32(const float* z, const int32_t* labels, float* out, int64_t rows,
                         int64_t cols, int64_t ignore_index, int threads) {
  ParallelFor(rows, threads, [&](int64_t r) {
    if (labels[r] == ignore_index) {
      out[r] = 0.0f;
      return;
    }
    const float* zr = z + r * cols;
    out[r] = CrossEntropyRow<HostOps>(zr, cols, labels[r]);
    // the NaN's sign and payload as the M4F has them (an invalid inf - inf is its default NaN)
    if (!(out[r] == out[r])) out[r] = CrossEntropyRow<M4fOps>(zr, cols, labels[r]);
  });
}

void CrossEntropyGradRowsF32(const float* z, const int32_t* labels, float* out, int64_t rows,
                             int64_t cols, float divisor, int threads) {
  ParallelFor(rows, threads, [&](int64_t r) {
    const float* zr = z + r * cols;
    float* o = out + r * cols;
    CrossEntropyGradRow<HostOps>(zr, o, cols, labels[r], divisor);
    if (AnyNaN(o, cols)) CrossEntropyGradRow<M4fOps>(zr, o, cols, labels[r], divisor);  // the M4F's NaNs
  });
}

namespace {

// The blocked fp32 sum of term(0), ..., term(cols - 1) (kernels.h, kLayerNormBlock): each block
// summed left to right from 0, the block sums added left to right from 0. A row split over PEs
// sums its blocks in parallel and adds only the block sums along the chain of its chunks. Each
// term is one fp32 value (a product rounded before the add: no contraction, CMakeLists.txt).
template <typename Ops, typename Term>
float BlockedSumF32(int64_t cols, Term term) {
  float sum = 0.0f;
  for (int64_t b = 0; b < cols; b += kLayerNormBlock) {
    const int64_t e = std::min(cols, b + kLayerNormBlock);
    float s = 0.0f;
    for (int64_t j = b; j < e; ++j) {
      const float t = term(j);
      s = Ops::Add(s, t);
    }
    sum = Ops::Add(sum, s);
  }
  return sum;
}

template <typename Ops>
void LayerNormRow(const float* xr, const float* gamma, const float* beta, float eps, float d, float* o,
                  int64_t cols) {
  const float mean = Ops::Div(BlockedSumF32<Ops>(cols, [&](int64_t j) { return xr[j]; }), d);
  const float sq = BlockedSumF32<Ops>(cols, [&](int64_t j) {
    o[j] = Ops::Sub(xr[j], mean);
    return Ops::Mul(o[j], o[j]);
  });
  const float den = Ops::Sqrt(Ops::Add(Ops::Div(sq, d), eps));
  for (int64_t j = 0; j < cols; ++j) {
    float y = Ops::Div(o[j], den);
    if (gamma) y = Ops::Mul(y, gamma[j]);
    if (beta) y = Ops::Add(y, beta[j]);
    o[j] = y;
  }
}

template <typename Ops>
void RmsNormRow(const float* xr, const float* weight, float eps, float d, float* o, int64_t cols) {
  const float m = Ops::Div(BlockedSumF32<Ops>(cols, [&](int64_t j) { return Ops::Mul(xr[j], xr[j]); }), d);
  const float v = Ops::Add(m, eps);
  const float root = Ops::Sqrt(v);
  const float inv = Ops::Div(1.0f, root);
  for (int64_t j = 0; j < cols; ++j) {
    // x * r: the generated code's VMUL takes r as its first operand (the two NaNs' order matters)
    const float h = Ops::Mul(inv, xr[j]);
    o[j] = weight ? Ops::Mul(weight[j], h) : h;
  }
}

}  // namespace

void LayerNormRowsF32(const float* x, const float* gamma, const float* beta, float eps, float* out,
                      int64_t rows, int64_t cols, int threads) {
  const float d = static_cast<float>(cols);
  ParallelFor(rows, threads, [&](int64_t r) {
    const float* xr = x + r * cols;
    float* o = out + r * cols;
    LayerNormRow<HostOps>(xr, gamma, beta, eps, d, o, cols);
    if (AnyNaN(o, cols)) LayerNormRow<M4fOps>(xr, gamma, beta, eps, d, o, cols);  // the M4F's NaNs
  });
}

void RmsNormRowsF32(const float* x, const float* weight, float eps, float* out, int64_t rows,
                    int64_t cols, int threads) {
  const float d = static_cast<float>(cols);
  ParallelFor(rows, threads, [&](int64_t r) {
    const float* xr = x + r * cols;
    float* o = out + r * cols;
    RmsNormRow<HostOps>(xr, weight, eps, d, o, cols);
    if (AnyNaN(o, cols)) RmsNormRow<M4fOps>(xr, weight, eps, d, o, cols);  // the M4F's NaNs
  });
}

void MaxPool2dBackwardF32(const float* dy, const float* x, float* dx, const PoolGradShape& s,
                          int threads) {
  const int64_t h = s.h, w = s.w, oh = s.oh, ow = s.ow, kh = s.kh, kw = s.kw, sh = s.sh, sw = s.sw;
  const float lowest = -3.4028234663852886e38f;
  // Each element's sum runs over the windows holding it from the nearest backwards (window
  // row descending, then column descending) and adds +0.0 for the windows not taking it. Those
  // +0.0 terms leave the sum's bits as they are (it starts at +0.0, never becomes -0.0, and a
  // NaN sum is already quiet), so the windows are visited in that descending order and each
  // adds its gradient to the one element it takes: the same additions in the same order.
  ParallelFor(s.planes, threads, [&](int64_t p) {
    const float* xp = x + p * h * w;
    const float* gp = dy + p * oh * ow;
    float* op = dx + p * h * w;
    std::fill(op, op + h * w, 0.0f);
    for (int64_t oy = oh - 1; oy >= 0; --oy) {
      for (int64_t ox = ow - 1; ox >= 0; --ox) {
        float best = lowest;
        int64_t ti = -1, tj = -1;  // nothing taken yet (TVM's argmax identity)
        for (int64_t i = 0; i < kh; ++i) {
          const int64_t r = oy * sh + i - s.pt;
          for (int64_t j = 0; j < kw; ++j) {
            const int64_t c = ox * sw + j - s.pl;
            const float v = (r >= 0 && r < h && c >= 0 && c < w) ? xp[r * w + c] : lowest;
            if (!(best > v || best == v)) ti = r, tj = c;
            best = best > v ? best : v;
          }
        }
        // a tap in the padding (taken after a NaN) is no element's
        if (ti >= 0 && ti < h && tj >= 0 && tj < w) {
          float* e = op + ti * w + tj;
          // the PE's VADD takes the gradient as its first operand (the code LLVM emits for
          // `dx + dy`, checked by tests/pe): its NaN wins a tie of two quiet or two signalling NaNs
          *e = M4fAdd(gp[oy * ow + ox], *e);
        }
      }
    }
  });
}

}  // namespace tvm_spinn
