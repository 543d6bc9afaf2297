// tvm_spinn.runtime.version(): identifies the runtime library build.
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#ifndef TVM_SPINN_VERSION
#error "TVM_SPINN_VERSION must be defined by the build system"
#endif

namespace tvm_spinn {

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef().def("tvm_spinn.runtime.version",
                        []() -> tvm::ffi::String { return "spinn-runtime " TVM_SPINN_VERSION; });
}

}  // namespace tvm_spinn
