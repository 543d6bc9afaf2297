// Global functions tvm_spinn.sim.*: validated entry points of the bit-exact kernels.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/reflection/registry.h>

#include <cstdint>
#include <sstream>
#include <string>

#include "kernels.h"
#include "tensor_check.h"

namespace tvm_spinn {
namespace {

using tvm::ffi::TensorView;

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kI8{kDLInt, 8, 1};
constexpr DLDataType kI16{kDLInt, 16, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};

/*! \brief Validate A[M,K] @ B[K,N] -> C[M,N] and return (M, K, N). */
void CheckGemm(const char* func, const TensorView& a, const TensorView& b, const TensorView& c,
               DLDataType in_dtype, DLDataType acc_dtype, int64_t* m, int64_t* k, int64_t* n) {
  CheckTensor(func, "A", a, 2, in_dtype);
  CheckTensor(func, "B", b, 2, in_dtype);
  CheckTensor(func, "C", c, 2, acc_dtype);
  *m = a.shape()[0];
  *k = a.shape()[1];
  *n = b.shape()[1];
  std::string detail = "A " + ShapeStr(a) + ", B " + ShapeStr(b) + ", C " + ShapeStr(c);
  CheckDim(func, "B.shape[0]", b.shape()[0], *k, detail);
  CheckDim(func, "C.shape[0]", c.shape()[0], *m, detail);
  CheckDim(func, "C.shape[1]", c.shape()[1], *n, detail);
  CheckNoOverlap(func, "C", c, "A", a);
  CheckNoOverlap(func, "C", c, "B", b);
}

/*! \brief acc_bits range, and C's initial values must be representable in the accumulator. */
void CheckAccumulator(const char* func, const TensorView& c, int64_t acc_bits) {
  if (acc_bits < 2 || acc_bits > 32) {
    TVM_FFI_THROW(ValueError) << func << ": acc_bits must be in [2, 32], got " << acc_bits;
  }
  const int64_t lo = -(int64_t{1} << (acc_bits - 1));
  const int64_t hi = (int64_t{1} << (acc_bits - 1)) - 1;
  const int32_t* data = DataPtr<const int32_t>(c);
  const int64_t count = c.numel();
  for (int64_t i = 0; i < count; ++i) {
    if (data[i] < lo || data[i] > hi) {
      TVM_FFI_THROW(ValueError) << func << ": argument `C` element " << i << " = " << data[i]
                                << " does not fit the signed " << acc_bits
                                << "-bit accumulator [" << lo << ", " << hi << "]";
    }
  }
}

void SimGemmF32(TensorView a, TensorView b, TensorView c) {
  int64_t m, k, n;
  CheckGemm("tvm_spinn.sim.gemm_f32", a, b, c, kF32, kF32, &m, &k, &n);
  GemmF32(DataPtr<const float>(a), DataPtr<const float>(b), DataPtr<float>(c), m, k, n);
}

int64_t SimGemmI8(TensorView a, TensorView b, TensorView c, int64_t acc_bits) {
  const char* func = "tvm_spinn.sim.gemm_i8";
  int64_t m, k, n;
  CheckGemm(func, a, b, c, kI8, kI32, &m, &k, &n);
  CheckAccumulator(func, c, acc_bits);
  return GemmI8(DataPtr<const int8_t>(a), DataPtr<const int8_t>(b), DataPtr<int32_t>(c), m, k, n,
                static_cast<int>(acc_bits));
}

int64_t SimGemmI16(TensorView a, TensorView b, TensorView c, int64_t acc_bits) {
  const char* func = "tvm_spinn.sim.gemm_i16";
  int64_t m, k, n;
  CheckGemm(func, a, b, c, kI16, kI32, &m, &k, &n);
  CheckAccumulator(func, c, acc_bits);
  return GemmI16(DataPtr<const int16_t>(a), DataPtr<const int16_t>(b), DataPtr<int32_t>(c), m, k,
                 n, static_cast<int>(acc_bits));
}

void SimRowSumF32(TensorView x, TensorView out) {
  const char* func = "tvm_spinn.sim.row_sum_f32";
  CheckTensor(func, "X", x, 2, kF32);
  CheckTensor(func, "out", out, 1, kF32);
  CheckDim(func, "out.shape[0]", out.shape()[0], x.shape()[0],
           "X " + ShapeStr(x) + ", out " + ShapeStr(out));
  CheckNoOverlap(func, "out", out, "X", x);
  RowSumF32(DataPtr<const float>(x), DataPtr<float>(out), x.shape()[0], x.shape()[1]);
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_spinn.sim.gemm_f32", SimGemmF32,
           "C[M,N] += A[M,K] @ B[K,N] in float32 with non-fused multiply-add, k ascending.")
      .def("tvm_spinn.sim.gemm_i8", SimGemmI8,
           "C[M,N] += A @ B (int8) on a wrapping acc_bits-bit accumulator; returns wrap count.")
      .def("tvm_spinn.sim.gemm_i16", SimGemmI16,
           "C[M,N] += A @ B (int16) on a wrapping acc_bits-bit accumulator; returns wrap count.")
      .def("tvm_spinn.sim.row_sum_f32", SimRowSumF32,
           "out[r] = sequential left-to-right float32 sum of X[r, :].");
}

}  // namespace tvm_spinn
