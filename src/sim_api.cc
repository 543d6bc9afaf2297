// Global functions tvm_spinn.sim.*: validated entry points of the bit-exact kernels.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/reflection/registry.h>

#include <tvm/ffi/container/array.h>

#include <algorithm>
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
constexpr DLDataType kI64{kDLInt, 64, 1};

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

void SimTranspose2D(TensorView src, TensorView dst, int64_t threads) {
  const char* func = "tvm_spinn.sim.transpose2d";
  if (src.ndim() != 2 || dst.ndim() != 2) {
    TVM_FFI_THROW(ValueError) << func << ": src and dst must be 2-D, got src " << ShapeStr(src)
                              << ", dst " << ShapeStr(dst);
  }
  const DLDataType dtype = src.dtype();
  const int itemsize = dtype.bits / 8;
  if (dtype.lanes != 1 || dtype.bits % 8 != 0 || (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8)) {
    TVM_FFI_THROW(TypeError) << func << ": elements of 1, 2, 4 or 8 bytes, got " << dtype.bits << " bits";
  }
  CheckTensor(func, "src", src, 2, dtype);
  CheckTensor(func, "dst", dst, 2, dtype);
  const std::string detail = "src " + ShapeStr(src) + ", dst " + ShapeStr(dst);
  CheckDim(func, "dst.shape[0]", dst.shape()[0], src.shape()[1], detail);
  CheckDim(func, "dst.shape[1]", dst.shape()[1], src.shape()[0], detail);
  CheckNoOverlap(func, "dst", dst, "src", src);
  const int64_t rows = src.shape()[0], cols = src.shape()[1];
  Transpose2D(static_cast<const char*>(src.data_ptr()) + src.byte_offset(),
              static_cast<char*>(dst.data_ptr()) + dst.byte_offset(), rows, cols, itemsize,
              ThreadsArg(func, threads, rows * cols));
}

/*!
 * \brief Validate the batched GEMM C[batch,M,N] (+)= A[a_index[b]] @ B[b_index[b]], with
 *        A [a_count, M, K], B [b_count, K, N] and int64 index vectors [batch].
 */
BatchedGemm CheckBatchedGemm(const char* func, const TensorView& a, const TensorView& b,
                             const TensorView& c, const TensorView& a_index,
                             const TensorView& b_index, DLDataType in_dtype,
                             DLDataType acc_dtype) {
  CheckTensor(func, "A", a, 3, in_dtype);
  CheckTensor(func, "B", b, 3, in_dtype);
  CheckTensor(func, "C", c, 3, acc_dtype);
  CheckTensor(func, "a_index", a_index, 1, kI64);
  CheckTensor(func, "b_index", b_index, 1, kI64);
  BatchedGemm s;
  s.batch = c.shape()[0];
  s.m = a.shape()[1];
  s.k = a.shape()[2];
  s.n = b.shape()[2];
  const std::string detail = "A " + ShapeStr(a) + ", B " + ShapeStr(b) + ", C " + ShapeStr(c) +
                             ", a_index " + ShapeStr(a_index) + ", b_index " + ShapeStr(b_index);
  CheckDim(func, "B.shape[1]", b.shape()[1], s.k, detail);
  CheckDim(func, "C.shape[1]", c.shape()[1], s.m, detail);
  CheckDim(func, "C.shape[2]", c.shape()[2], s.n, detail);
  CheckDim(func, "a_index.shape[0]", a_index.shape()[0], s.batch, detail);
  CheckDim(func, "b_index.shape[0]", b_index.shape()[0], s.batch, detail);
  CheckNoOverlap(func, "C", c, "A", a);
  CheckNoOverlap(func, "C", c, "B", b);
  CheckNoOverlap(func, "C", c, "a_index", a_index);
  CheckNoOverlap(func, "C", c, "b_index", b_index);
  s.a_index = DataPtr<const int64_t>(a_index);
  s.b_index = DataPtr<const int64_t>(b_index);
  const struct {
    const char* name;
    const int64_t* data;
    int64_t count;
  } indexes[] = {{"a_index", s.a_index, a.shape()[0]}, {"b_index", s.b_index, b.shape()[0]}};
  for (const auto& idx : indexes) {
    for (int64_t i = 0; i < s.batch; ++i) {
      if (idx.data[i] < 0 || idx.data[i] >= idx.count) {
        TVM_FFI_THROW(IndexError) << func << ": " << idx.name << "[" << i << "] = " << idx.data[i]
                                  << " is out of range [0, " << idx.count << ") (" << detail
                                  << ")";
      }
    }
  }
  return s;
}

void CheckChunk(const char* func, int64_t chunk, int64_t acc_bits) {
  if (acc_bits < 2 || acc_bits > 32) {
    TVM_FFI_THROW(ValueError) << func << ": acc_bits must be in [2, 32], got " << acc_bits;
  }
  if (chunk < 1) {
    TVM_FFI_THROW(ValueError) << func << ": chunk (k-chunk length) must be >= 1, got " << chunk;
  }
}

void SimGemmF32Batched(TensorView a, TensorView b, TensorView c, TensorView a_index,
                       TensorView b_index, int64_t threads) {
  const char* func = "tvm_spinn.sim.gemm_f32_batched";
  const BatchedGemm s = CheckBatchedGemm(func, a, b, c, a_index, b_index, kF32, kF32);
  GemmF32Batched(DataPtr<const float>(a), DataPtr<const float>(b), DataPtr<float>(c), s,
                 ThreadsArg(func, threads, s.batch * s.m * s.n * s.k));
}

int64_t SimGemmI8Batched(TensorView a, TensorView b, TensorView c, TensorView a_index,
                         TensorView b_index, int64_t chunk, int64_t acc_bits, int64_t threads) {
  const char* func = "tvm_spinn.sim.gemm_i8_batched";
  const BatchedGemm s = CheckBatchedGemm(func, a, b, c, a_index, b_index, kI8, kI32);
  CheckChunk(func, chunk, acc_bits);
  return GemmI8Batched(DataPtr<const int8_t>(a), DataPtr<const int8_t>(b), DataPtr<int32_t>(c), s,
                       chunk, static_cast<int>(acc_bits),
                       ThreadsArg(func, threads, s.batch * s.m * s.n * s.k));
}

int64_t SimGemmI16Batched(TensorView a, TensorView b, TensorView c, TensorView a_index,
                          TensorView b_index, int64_t chunk, int64_t acc_bits, int64_t threads) {
  const char* func = "tvm_spinn.sim.gemm_i16_batched";
  const BatchedGemm s = CheckBatchedGemm(func, a, b, c, a_index, b_index, kI16, kI32);
  CheckChunk(func, chunk, acc_bits);
  return GemmI16Batched(DataPtr<const int16_t>(a), DataPtr<const int16_t>(b),
                        DataPtr<int32_t>(c), s, chunk, static_cast<int>(acc_bits),
                        ThreadsArg(func, threads, s.batch * s.m * s.n * s.k));
}

/*!
 * \brief im2col: X [n, C, h, w] -> out [n * groups, (C / groups) * kh * kw, oh * ow]; `geometry`
 *        = (groups, kh, kw, stride_h, stride_w, dil_h, dil_w, pad_top, pad_left, oh, ow); `fill`
 *        is a one-element tensor of X's dtype (the padding value). Only in-bounds X positions are
 *        read, whatever the geometry.
 */
void SimIm2Col(TensorView x, TensorView out, TensorView fill, tvm::ffi::Array<int64_t> geometry,
               int64_t threads) {
  const char* func = "tvm_spinn.sim.im2col";
  const DLDataType dt = x.dtype();
  if (dt.lanes != 1 || !(dt.bits == 8 || dt.bits == 16 || dt.bits == 32) ||
      !(dt.code == kDLFloat || dt.code == kDLInt || dt.code == kDLUInt) ||
      (dt.code == kDLFloat && dt.bits != 32)) {
    TVM_FFI_THROW(TypeError) << func << ": argument `X` must have an 8/16/32-bit integer or "
                             << "float32 dtype, got " << tvm::ffi::DLDataTypeToString(dt);
  }
  CheckTensor(func, "X", x, 4, dt);
  CheckTensor(func, "out", out, 3, dt);
  CheckTensor(func, "fill", fill, 1, dt);
  CheckDim(func, "fill.shape[0]", fill.shape()[0], 1, "fill " + ShapeStr(fill));
  if (geometry.size() != 11) {
    TVM_FFI_THROW(ValueError) << func << ": geometry must have 11 entries (groups, kh, kw, "
                              << "stride_h, stride_w, dil_h, dil_w, pad_top, pad_left, oh, ow), "
                              << "got " << geometry.size();
  }
  int64_t g[11];
  for (int i = 0; i < 11; ++i) {
    g[i] = geometry[i];
    if (i < 7 ? g[i] < 1 : g[i] < 0) {
      TVM_FFI_THROW(ValueError) << func << ": geometry[" << i << "] = " << g[i]
                                << " is out of range (groups, kh, kw, strides and dilations "
                                << "must be >= 1, padding and output extents >= 0)";
    }
  }
  Im2ColShape s;
  s.groups = g[0];
  s.kh = g[1];
  s.kw = g[2];
  s.stride_h = g[3];
  s.stride_w = g[4];
  s.dil_h = g[5];
  s.dil_w = g[6];
  s.pad_top = g[7];
  s.pad_left = g[8];
  s.oh = g[9];
  s.ow = g[10];
  s.n = x.shape()[0];
  s.h = x.shape()[2];
  s.w = x.shape()[3];
  if (x.shape()[1] % s.groups != 0) {
    TVM_FFI_THROW(ValueError) << func << ": channels " << x.shape()[1]
                              << " are not divisible by groups " << s.groups;
  }
  s.cg = x.shape()[1] / s.groups;
  const std::string detail = "X " + ShapeStr(x) + ", out " + ShapeStr(out);
  CheckDim(func, "out.shape[0]", out.shape()[0], s.n * s.groups, detail);
  CheckDim(func, "out.shape[1]", out.shape()[1], s.cg * s.kh * s.kw, detail);
  CheckDim(func, "out.shape[2]", out.shape()[2], s.oh * s.ow, detail);
  CheckNoOverlap(func, "out", out, "X", x);
  Im2Col(x.data_ptr() ? DataPtr<const void>(x) : nullptr, DataPtr<void>(out), s, dt.bits / 8,
         DataPtr<const void>(fill), ThreadsArg(func, threads, out.numel() / 8));
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
      .def("tvm_spinn.sim.gemm_f32_batched", SimGemmF32Batched,
           "C[b] += A[a_index[b]] @ B[b_index[b]] for every b, float32, non-fused, k ascending; "
           "multi-threaded (threads 0: TVM_SPINN_SIM_THREADS or all cores), same bits.")
      .def("tvm_spinn.sim.gemm_i8_batched", SimGemmI8Batched,
           "C[b] += sum over k-chunks of wrapping acc_bits accumulations of A[a_index[b]] @ "
           "B[b_index[b]] (int8), chunk sums added in int32; returns the wrap count.")
      .def("tvm_spinn.sim.gemm_i16_batched", SimGemmI16Batched,
           "As gemm_i8_batched with int16 operands.")
      .def("tvm_spinn.sim.im2col", SimIm2Col,
           "im2col of an NCHW tensor: [n*groups, (C/groups)*kh*kw, oh*ow], padding reads fill.")
      .def("tvm_spinn.sim.row_sum_f32", SimRowSumF32,
           "out[r] = sequential left-to-right float32 sum of X[r, :].")
      .def("tvm_spinn.sim.transpose2d", SimTranspose2D,
           "dst[c, r] = src[r, c]: a cache-blocked, multi-threaded 2-D transpose (any 1/2/4/8-byte dtype).");
}

}  // namespace tvm_spinn
