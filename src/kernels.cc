// Kernel implementations. Built with -ffp-contract=off and without -ffast-math: the compiler
// may vectorize across independent outputs (n) but never reorder or fuse one output's chain.
#include "kernels.h"

#include <algorithm>
#include <cstddef>

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

// Blocking keeps a C row tile and the touched B rows in L1/L2; it only changes the order in
// which *different* outputs are visited, never the k order of any single output.
constexpr int64_t kTileN = 512;
constexpr int64_t kTileM = 4;

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
            const int32_t prod = av * static_cast<int32_t>(brow[j]);
            const int32_t acc = crow[j];
            if constexpr (kFull32) {
              const auto sum = static_cast<int32_t>(static_cast<uint32_t>(acc) +
                                                    static_cast<uint32_t>(prod));
              tile_wraps += ((acc ^ sum) & (prod ^ sum)) < 0;
              crow[j] = sum;
            } else {
              const int32_t sum = acc + prod;  // exact
              const int32_t wrapped =
                  static_cast<int32_t>(static_cast<uint32_t>(sum) << shift) >> shift;
              tile_wraps += (wrapped != sum);
              crow[j] = wrapped;
            }
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

void RowSumF32(const float* x, float* out, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    float acc = 0.0f;
    for (int64_t j = 0; j < cols; ++j) acc = acc + row[j];
    out[r] = acc;
  }
}

}  // namespace tvm_spinn
