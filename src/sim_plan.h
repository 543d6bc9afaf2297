// The native-run interpreter (sim_plan.cc), for callers inside the library (the spinn module
// running a program's native section, native_section.cc).
#ifndef TVM_SPINN_SIM_PLAN_H_
#define TVM_SPINN_SIM_PLAN_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cstdint>

namespace tvm_spinn {

/*!
 * \brief A plan over `consts` (captured), `arg_bytes.size()` call arguments and temporaries of
 *        `temp_bytes`, every instruction of `code` validated against the slots' sizes; returns
 *        the function running it: f(*args).
 * \throws tvm::ffi::Error (ValueError) naming the defect of an invalid plan.
 */
tvm::ffi::Function PlanCreate(tvm::ffi::Array<int64_t> code, tvm::ffi::Array<tvm::ffi::Tensor> consts,
                              tvm::ffi::Array<int64_t> arg_bytes, tvm::ffi::Array<int64_t> temp_bytes);

}  // namespace tvm_spinn

#endif  // TVM_SPINN_SIM_PLAN_H_
