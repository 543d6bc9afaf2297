// The "spinn" runtime module: carries one offloaded Relax function (its global symbol and the
// serialized spinn program) and forwards calls to the Python simulator.
//
// Programs are validated when a module is created or loaded, not at its first call: both
// factories hand (symbol, program, key) to the Python-registered validator (kValidateFunc), whose
// error (tvm_spinn.ProgramError, naming the defective field) propagates out of
// tvm.runtime.load_module. The library alone (without the tvm_spinn package) has no validator
// and no executor either, so such a module cannot run until the package validates it.
#include <tvm/ffi/any.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/memory.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "container.h"

namespace tvm_spinn {

namespace ffi = tvm::ffi;

/*! \brief Name of the Python-registered executor the module forwards to. */
constexpr const char* kExecuteFunc = "tvm_spinn.runtime.execute";
/*! \brief Name of the Python-registered program validator (see the file comment). */
constexpr const char* kValidateFunc = "tvm_spinn.runtime.validate_program";

/*!
 * \brief Key of the executor's parsed-program cache: unique to each module object in the
 *        process, so two modules never share a cache entry, whatever bytes they claim to hold,
 *        and no pass over hundreds of MB of weights is needed to make it.
 */
std::string NewModuleKey() {
  static std::atomic<uint64_t> counter{0};
  return "spinn-module-" + std::to_string(counter.fetch_add(1) + 1);
}

class SpinnModuleObj final : public ffi::ModuleObj {
 public:
  SpinnModuleObj(ffi::String symbol, ffi::Bytes program)
      : symbol_(std::move(symbol)),
        program_(std::move(program)),
        key_(NewModuleKey()) {
    ffi::Bytes captured = program_;
    program_getter_ = ffi::Function::FromTyped([captured]() -> ffi::Bytes { return captured; });
  }

  const char* kind() const final { return "spinn"; }

  int GetPropertyMask() const final {
    return ffi::Module::kBinarySerializable | ffi::Module::kRunnable;
  }

  ffi::Optional<ffi::Function> GetFunction(const ffi::String& name) final {
    if (name == symbol_) return MakeEntry();
    if (name == "get_program") {
      ffi::Bytes program = program_;
      return ffi::Function::FromTyped([program]() -> ffi::Bytes { return program; });
    }
    if (name == "get_symbol") {
      ffi::String symbol = symbol_;
      return ffi::Function::FromTyped([symbol]() -> ffi::String { return symbol; });
    }
    if (name == "get_key") {
      ffi::String key = key_;
      return ffi::Function::FromTyped([key]() -> ffi::String { return key; });
    }
    return std::nullopt;
  }

  ffi::Bytes SaveToBytes() const final {
    return ffi::Bytes(EncodeContainer(std::string(symbol_.data(), symbol_.size()),
                                      program_.data(), program_.size()));
  }

  /*! \brief Run the Python validator on this module's program, if one is registered. */
  void Validate() const {
    std::optional<ffi::Function> validate = ffi::Function::GetGlobal(kValidateFunc);
    if (validate.has_value()) (*validate)(symbol_, program_, key_);
  }

  ffi::String InspectSource(const ffi::String& format) const final {
    return ffi::String("spinn module: symbol=" + std::string(symbol_) + " key=" +
                       std::string(key_) + " program_bytes=" + std::to_string(program_.size()));
  }

 private:
  /*!
   * \brief The DPS entry point: (inputs..., outputs...) is forwarded unchanged as
   *        execute(key, program_getter, symbol, inputs..., outputs...).
   * \note Captures values, not the module, so no reference cycle is created.
   */
  ffi::Function MakeEntry() const {
    ffi::String key = key_;
    ffi::String symbol = symbol_;
    ffi::Function getter = program_getter_;
    return ffi::Function::FromPacked([key, symbol, getter](ffi::PackedArgs args, ffi::Any* rv) {
      std::optional<ffi::Function> execute = ffi::Function::GetGlobal(kExecuteFunc);
      if (!execute.has_value()) {
        TVM_FFI_THROW(RuntimeError) << "spinn module `" << symbol << "`: global function "
                                    << kExecuteFunc
                                    << " is not registered; import tvm_spinn to run spinn modules";
      }
      std::vector<ffi::AnyView> packed(static_cast<size_t>(args.size()) + 3);
      packed[0] = key;
      packed[1] = getter;
      packed[2] = symbol;
      for (int i = 0; i < args.size(); ++i) packed[i + 3] = args[i];
      execute->CallPacked(packed.data(), static_cast<int32_t>(packed.size()), rv);
    });
  }

  ffi::String symbol_;
  ffi::Bytes program_;
  ffi::String key_;
  ffi::Function program_getter_;
};

ffi::Module CreateSpinnModule(const ffi::String& symbol, const ffi::Bytes& program) {
  if (symbol.empty()) {
    TVM_FFI_THROW(ValueError) << "spinn module: symbol must be a non-empty string";
  }
  auto obj = ffi::make_object<SpinnModuleObj>(symbol, program);
  obj->Validate();  // throws (nothing is returned) on an invalid program
  return ffi::Module(obj);
}

ffi::Module LoadSpinnModuleFromBytes(const ffi::Bytes& bytes) {
  // The container checksum is verified in place; the program is copied once, into the module.
  ModuleContents contents = DecodeContainer(bytes.data(), bytes.size());
  return CreateSpinnModule(ffi::String(contents.symbol),
                           ffi::Bytes(contents.program, contents.program_size));
}

ffi::Bytes ModuleSaveToBytes(const ffi::Module& mod) {
  if (!(mod->GetPropertyMask() & ffi::Module::kBinarySerializable)) {
    TVM_FFI_THROW(ValueError) << "module of kind `" << mod->kind()
                              << "` is not binary-serializable";
  }
  return mod->SaveToBytes();
}

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_spinn.runtime.create_module", CreateSpinnModule,
           "Create a spinn runtime module from (symbol, program bytes).")
      .def("ffi.Module.load_from_bytes.spinn", LoadSpinnModuleFromBytes,
           "Deserialize a spinn module from its versioned container bytes.")
      .def("tvm_spinn.runtime.save_to_bytes", ModuleSaveToBytes,
           "Return Module::SaveToBytes() of a binary-serializable module.");
}

}  // namespace tvm_spinn
