// Argument validation for the simulator kernels: every defect becomes a ValueError/TypeError
// naming the function and the argument instead of a crash.
#ifndef TVM_SPINN_TENSOR_CHECK_H_
#define TVM_SPINN_TENSOR_CHECK_H_

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

namespace tvm_spinn {

/*! \brief "(2, 3)" */
inline std::string ShapeStr(const tvm::ffi::TensorView& t) {
  std::ostringstream os;
  os << '(';
  for (int32_t i = 0; i < t.ndim(); ++i) os << (i ? ", " : "") << t.shape()[i];
  os << (t.ndim() == 1 ? ",)" : ")");
  return os.str();
}

inline bool SameDType(DLDataType x, DLDataType y) {
  return x.code == y.code && x.bits == y.bits && x.lanes == y.lanes;
}

/*! \brief Typed pointer to the first element (data + byte_offset). */
template <typename T>
inline T* DataPtr(const tvm::ffi::TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

/*!
 * \brief Check one tensor argument of `func`: host memory, rank, dtype, C-contiguity.
 * \throws TypeError on dtype mismatch, ValueError otherwise.
 */
inline void CheckTensor(const char* func, const char* arg, const tvm::ffi::TensorView& t,
                        int32_t ndim, DLDataType dtype) {
  if (t.device().device_type != kDLCPU) {
    TVM_FFI_THROW(ValueError) << func << ": argument `" << arg
                              << "` must be in host (CPU) memory, got device type "
                              << static_cast<int>(t.device().device_type);
  }
  if (!SameDType(t.dtype(), dtype)) {
    TVM_FFI_THROW(TypeError) << func << ": argument `" << arg << "` must have dtype "
                             << tvm::ffi::DLDataTypeToString(dtype) << ", got "
                             << tvm::ffi::DLDataTypeToString(t.dtype());
  }
  if (t.ndim() != ndim) {
    TVM_FFI_THROW(ValueError) << func << ": argument `" << arg << "` must be " << ndim
                              << "-D, got a " << t.ndim() << "-D tensor of shape " << ShapeStr(t);
  }
  for (int32_t i = 0; i < t.ndim(); ++i) {
    if (t.shape()[i] < 0) {
      TVM_FFI_THROW(ValueError) << func << ": argument `" << arg << "` has a negative extent "
                                << ShapeStr(t);
    }
  }
  if (!t.IsContiguous()) {
    TVM_FFI_THROW(ValueError) << func << ": argument `" << arg << "` of shape " << ShapeStr(t)
                              << " must be C-contiguous (row-major, no strides)";
  }
  if (t.numel() > 0 && t.data_ptr() == nullptr) {
    TVM_FFI_THROW(ValueError) << func << ": argument `" << arg << "` has a null data pointer";
  }
}

/*! \brief Require `actual == expected` for a dimension, with both tensors in the message. */
inline void CheckDim(const char* func, const char* what, int64_t actual, int64_t expected,
                     const std::string& detail) {
  if (actual != expected) {
    TVM_FFI_THROW(ValueError) << func << ": shape mismatch: " << what << " is " << actual
                              << " but must be " << expected << " (" << detail << ")";
  }
}

/*! \brief The output must not share memory with an input (kernels read inputs while writing). */
inline void CheckNoOverlap(const char* func, const char* out_name,
                           const tvm::ffi::TensorView& out, const char* in_name,
                           const tvm::ffi::TensorView& in) {
  if (out.numel() == 0 || in.numel() == 0) return;
  const auto* o0 = DataPtr<const char>(out);
  const auto* o1 = o0 + tvm::ffi::GetDataSize(static_cast<size_t>(out.numel()), out.dtype());
  const auto* i0 = DataPtr<const char>(in);
  const auto* i1 = i0 + tvm::ffi::GetDataSize(static_cast<size_t>(in.numel()), in.dtype());
  if (o0 < i1 && i0 < o1) {
    TVM_FFI_THROW(ValueError) << func << ": output `" << out_name << "` overlaps input `"
                              << in_name << "` in memory";
  }
}

/*! \brief A kernel's `threads` argument: > 0 as given (at most 1024), 0 for SimThreads(work). */
inline int ThreadsArg(const char* func, int64_t threads, int64_t work) {
  if (threads < 0) {
    TVM_FFI_THROW(ValueError) << func << ": threads must be >= 0 (0: TVM_SPINN_SIM_THREADS or "
                              << "all cores), got " << threads;
  }
  return threads > 0 ? static_cast<int>(std::min<int64_t>(threads, 1024)) : SimThreads(work);
}

}  // namespace tvm_spinn

#endif  // TVM_SPINN_TENSOR_CHECK_H_
