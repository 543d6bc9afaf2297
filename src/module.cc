// The "spinn" runtime module: carries one offloaded Relax function (its global symbol and the
// serialized spinn program) and forwards calls to the Python simulator.
//
// Programs are validated when a module is created or loaded, not at its first call: both
// factories hand (symbol, program, key) to the Python-registered validator (kValidateFunc), whose
// error (tvm_spinn.ProgramError, naming the defective field) propagates out of
// tvm.runtime.load_module. The library alone (without the tvm_spinn package) has no validator
// and no executor either, so such a module cannot run until the package validates it.
//
// A module holds its program either as bytes (created by the compiler, or loaded from a
// version-2 container) or as a uint8 tensor over memory the package owns (a version-3 container:
// the program lies after the ELF contents of a sealed library and is mapped, not copied; the
// package's resolver, kResolveFunc, hands out the view). While the package exports a sealed
// library (BeginExternalExport .. EndExternalExport), SaveToBytes writes version-3 containers and
// collects the programs for the package to append to the file.
//
// A program of format version 6 carries a native section (native_section.h): its execution plan
// as instructions of the native interpreter. Without the package (no executor registered), the
// module runs that plan itself, checking every argument's dtype and shape; a program whose
// section names a layer that needs Python raises one error naming it. The section is decoded and
// validated (every count, offset and slot) when the module is created or loaded.
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/memory.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "container.h"
#include "native_section.h"

namespace tvm_spinn {

namespace ffi = tvm::ffi;

/*! \brief Name of the Python-registered executor the module forwards to. */
constexpr const char* kExecuteFunc = "tvm_spinn.runtime.execute";
/*! \brief Name of the Python-registered program validator (see the file comment). */
constexpr const char* kValidateFunc = "tvm_spinn.runtime.validate_program";
/*! \brief Name of the Python-registered resolver of external programs (see the file comment). */
constexpr const char* kResolveFunc = "tvm_spinn.runtime.resolve_program";

/*!
 * \brief Programs SaveToBytes moved out of their containers during this thread's export of a
 *        sealed library (TVM serializes the import tree on the calling thread).
 */
struct ExternalExport {
  bool active = false;
  std::vector<ffi::Any> programs;
};
thread_local ExternalExport external_export;

/*! \brief Whether `data` is a spinn program (magic and room for its trailing digest). */
bool IsSpinnProgram(const char* data, size_t size) {
  static constexpr char kProgramMagic[8] = {'S', 'P', 'I', 'N', 'N', 'P', 'R', 'G'};
  return size >= sizeof(kProgramMagic) + kProgramDigestBytes &&
         std::memcmp(data, kProgramMagic, sizeof(kProgramMagic)) == 0;
}

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
        data_(program_.data()),
        size_(program_.size()),
        key_(NewModuleKey()) {
    ffi::Bytes captured = program_;
    program_getter_ = ffi::Function::FromTyped([captured]() -> ffi::Bytes { return captured; });
  }

  /*! \brief A module whose program is `mapped` (1-D uint8, contiguous, on the host). */
  SpinnModuleObj(ffi::String symbol, ffi::Tensor mapped)
      : symbol_(std::move(symbol)),
        mapped_(std::move(mapped)),
        data_(static_cast<const char*>(mapped_.value().GetDLTensorPtr()->data) +
              mapped_.value().GetDLTensorPtr()->byte_offset),
        size_(static_cast<size_t>(mapped_.value().GetDLTensorPtr()->shape[0])),
        key_(NewModuleKey()) {
    ffi::Tensor captured = mapped_.value();
    program_getter_ = ffi::Function::FromTyped([captured]() -> ffi::Tensor { return captured; });
  }

  const char* kind() const final { return "spinn"; }

  int GetPropertyMask() const final {
    return ffi::Module::kBinarySerializable | ffi::Module::kRunnable;
  }

  ffi::Optional<ffi::Function> GetFunction(const ffi::String& name) final {
    if (name == symbol_) return MakeEntry();
    if (name == "get_program") {
      if (mapped_.has_value()) {  // a copy, made only when asked for (reports, tests)
        ffi::Tensor mapped = mapped_.value();
        const char* data = data_;
        size_t size = size_;
        return ffi::Function::FromTyped(
            [mapped, data, size]() -> ffi::Bytes { return ffi::Bytes(data, size); });
      }
      ffi::Bytes program = program_;
      return ffi::Function::FromTyped([program]() -> ffi::Bytes { return program; });
    }
    if (name == "get_symbol") {
      ffi::String symbol = symbol_;
      return ffi::Function::FromTyped([symbol]() -> ffi::String { return symbol; });
    }
    if (name == "native_run") {  // the program's native plan, whichever executor is registered
      if (!native_ || !native_->runnable) return std::nullopt;
      std::shared_ptr<const NativeProgram> native = native_;
      ffi::String symbol = symbol_;
      return ffi::Function::FromPacked([native, symbol](ffi::PackedArgs args, ffi::Any* rv) {
        RunNative(*native, symbol, args);
      });
    }
    if (name == "native_status") {  // "" when the program runs natively, else why not
      std::string status = NativeStatus(native_.get(), symbol_);
      return ffi::Function::FromTyped([status]() -> ffi::String { return status; });
    }
    if (name == "get_key") {
      ffi::String key = key_;
      return ffi::Function::FromTyped([key]() -> ffi::String { return key; });
    }
    return std::nullopt;
  }

  ffi::Bytes SaveToBytes() const final {
    std::string symbol(symbol_.data(), symbol_.size());
    if (external_export.active && IsSpinnProgram(data_, size_)) {
      external_export.programs.push_back(Program());
      return ffi::Bytes(
          EncodeExternalContainer(symbol, size_, data_ + size_ - kProgramDigestBytes));
    }
    return ffi::Bytes(EncodeContainer(symbol, data_, size_));
  }

  /*! \brief Decode and validate the program's native section, if it has one (throws if bad). */
  void LoadNative() {
    if (!IsSpinnProgram(data_, size_)) return;
    ffi::Any keep = Program();
    native_ = std::make_shared<const NativeProgram>(DecodeNativeProgram(data_, size_, keep));
  }

  /*! \brief Run the Python validator on this module's program, if one is registered. */
  void Validate() const {
    std::optional<ffi::Function> validate = ffi::Function::GetGlobal(kValidateFunc);
    if (validate.has_value()) (*validate)(symbol_, Program(), key_);
  }

  ffi::String InspectSource(const ffi::String& format) const final {
    return ffi::String("spinn module: symbol=" + std::string(symbol_) + " key=" +
                       std::string(key_) + " program_bytes=" + std::to_string(size_));
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
    std::shared_ptr<const NativeProgram> native = native_;
    return ffi::Function::FromPacked([key, symbol, getter, native](ffi::PackedArgs args, ffi::Any* rv) {
      std::optional<ffi::Function> execute = ffi::Function::GetGlobal(kExecuteFunc);
      if (!execute.has_value()) {  // no package: the program's own native plan, or one clear error
        if (native && native->runnable) return RunNative(*native, symbol, args);
        TVM_FFI_THROW(RuntimeError) << NativeStatus(native.get(), symbol);
      }
      std::vector<ffi::AnyView> packed(static_cast<size_t>(args.size()) + 3);
      packed[0] = key;
      packed[1] = getter;
      packed[2] = symbol;
      for (int i = 0; i < args.size(); ++i) packed[i + 3] = args[i];
      execute->CallPacked(packed.data(), static_cast<int32_t>(packed.size()), rv);
    });
  }

  /*! \brief The program as handed to Python: bytes, or the mapped tensor (no copy). */
  ffi::Any Program() const {
    if (mapped_.has_value()) return mapped_.value();
    return program_;
  }

  /*! \brief Why the program cannot run without the package ("" if it can). */
  static std::string NativeStatus(const NativeProgram* native, const ffi::String& symbol) {
    std::ostringstream os;
    os << "spinn module `" << std::string(symbol) << "`: ";
    if (native == nullptr || !native->present) {
      os << "global function " << kExecuteFunc
         << " is not registered and the program has no native section; import tvm_spinn to run spinn modules";
    } else if (!native->runnable && native->layer_index >= 0) {
      os << "layer `" << native->layer << "` needs the Python runtime (" << native->reason
         << "); import tvm_spinn to run spinn modules";
    } else if (!native->runnable) {
      os << "the program needs the Python runtime (" << native->reason
         << "); import tvm_spinn to run spinn modules";
    } else {
      return "";
    }
    return os.str();
  }

  /*! \brief Run the native plan on DPS arguments (inputs, then outputs), each checked. */
  static void RunNative(const NativeProgram& native, const ffi::String& symbol, ffi::PackedArgs args) {
    const size_t n = native.args.size();
    if (static_cast<size_t>(args.size()) != n) {
      TVM_FFI_THROW(ValueError) << "spinn module `" << std::string(symbol) << "`: expected " << native.n_inputs
                                << " inputs and " << n - static_cast<size_t>(native.n_inputs)
                                << " outputs, got " << args.size() << " arguments";
    }
    std::vector<ffi::TensorView> views;
    views.reserve(n);
    native.CheckBlob();  // before the first run: the weights the plan reads are the compiled ones
    for (size_t i = 0; i < n; ++i) {
      const NativeArgSpec& spec = native.args[i];
      std::optional<ffi::TensorView> t = args[static_cast<int>(i)].try_cast<ffi::TensorView>();
      bool ok = t.has_value() && t->device().device_type == kDLCPU && t->IsContiguous() &&
                t->dtype().code == spec.code && t->dtype().bits == spec.bits && t->dtype().lanes == 1 &&
                t->ndim() == static_cast<int>(spec.shape.size());
      for (size_t d = 0; ok && d < spec.shape.size(); ++d) ok = t->shape()[d] == spec.shape[d];
      if (!ok) {
        std::ostringstream shape;
        for (size_t d = 0; d < spec.shape.size(); ++d) shape << (d ? ", " : "") << spec.shape[d];
        TVM_FFI_THROW(ValueError) << "spinn module `" << std::string(symbol) << "`: "
                                  << (i < static_cast<size_t>(native.n_inputs) ? "input" : "output")
                                  << " (argument " << i << ") must be a contiguous host tensor of shape ("
                                  << shape.str() << ") and dtype code " << int(spec.code) << " bits "
                                  << int(spec.bits);
      }
      views.push_back(*t);
    }
    std::vector<ffi::AnyView> packed(native.plan_args.size());
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = views[static_cast<size_t>(native.plan_args[i])];
    ffi::Any rv;
    native.plan.CallPacked(packed.data(), static_cast<int32_t>(packed.size()), &rv);
  }

  ffi::String symbol_;
  std::shared_ptr<const NativeProgram> native_;  // the program's native section, decoded
  ffi::Bytes program_;                   // inline programs
  ffi::Optional<ffi::Tensor> mapped_;    // external or compiler-owned programs (program_ empty)
  const char* data_;
  size_t size_;
  ffi::String key_;
  ffi::Function program_getter_;
};

ffi::Module CreateSpinnModule(const ffi::String& symbol, const ffi::Bytes& program) {
  if (symbol.empty()) {
    TVM_FFI_THROW(ValueError) << "spinn module: symbol must be a non-empty string";
  }
  auto obj = ffi::make_object<SpinnModuleObj>(symbol, program);
  obj->LoadNative();  // throws on a damaged native section
  obj->Validate();  // throws (nothing is returned) on an invalid program
  return ffi::Module(obj);
}

/*!
 * \brief A module over `program`, a 1-D contiguous uint8 host tensor the caller owns (the
 *        compiler's freshly serialized bytes, viewed through DLPack): held, never copied.
 */
ffi::Module CreateSpinnModuleView(const ffi::String& symbol, const ffi::Tensor& program) {
  if (symbol.empty()) {
    TVM_FFI_THROW(ValueError) << "spinn module: symbol must be a non-empty string";
  }
  const DLTensor* t = program.GetDLTensorPtr();
  bool ok = t->device.device_type == kDLCPU && t->ndim == 1 && t->dtype.code == kDLUInt &&
            t->dtype.bits == 8 && t->dtype.lanes == 1 &&
            (t->strides == nullptr || t->strides[0] == 1 || t->shape[0] <= 1);
  if (!ok) {
    TVM_FFI_THROW(ValueError) << "spinn module `" << symbol
                              << "`: a program view must be a 1-D contiguous uint8 host tensor";
  }
  auto obj = ffi::make_object<SpinnModuleObj>(symbol, program);
  obj->LoadNative();  // throws on a damaged native section
  obj->Validate();  // throws (nothing is returned) on an invalid program
  return ffi::Module(obj);
}

/*! \brief The module of a version-3 container: its program from the package's resolver. */
ffi::Module LoadExternalModule(const ModuleContents& contents) {
  std::optional<ffi::Function> resolve = ffi::Function::GetGlobal(kResolveFunc);
  if (!resolve.has_value()) {
    TVM_FFI_THROW(ValueError) << "spinn module `" << contents.symbol
                              << "`: its program is stored after the library's ELF contents; "
                                 "import tvm_spinn and load the library with "
                                 "tvm_spinn.load_module";
  }
  ffi::Tensor mapped = (*resolve)(ffi::Bytes(contents.digest), static_cast<int64_t>(contents.program_size))
                           .cast<ffi::Tensor>();
  // The resolver is Python code: check what the module will read through the pointer.
  const DLTensor* t = mapped.GetDLTensorPtr();
  bool ok = t->device.device_type == kDLCPU && t->ndim == 1 && t->dtype.code == kDLUInt &&
            t->dtype.bits == 8 && t->dtype.lanes == 1 &&
            static_cast<uint64_t>(t->shape[0]) == contents.program_size &&
            (t->strides == nullptr || t->strides[0] == 1);
  const char* data = ok ? static_cast<const char*>(t->data) + t->byte_offset : nullptr;
  if (!ok || !IsSpinnProgram(data, contents.program_size) ||
      std::memcmp(data + contents.program_size - kProgramDigestBytes, contents.digest.data(),
                  kProgramDigestBytes) != 0) {
    TVM_FFI_THROW(ValueError) << "spinn module `" << contents.symbol
                              << "`: the resolved program does not match its container (size "
                              << contents.program_size << " and digest)";
  }
  auto obj = ffi::make_object<SpinnModuleObj>(ffi::String(contents.symbol), std::move(mapped));
  obj->LoadNative();
  obj->Validate();
  return ffi::Module(obj);
}

ffi::Module LoadSpinnModuleFromBytes(const ffi::Bytes& bytes) {
  // The container checksum is verified in place; an inline program is copied once, into the
  // module; an external one is not copied at all.
  ModuleContents contents = DecodeContainer(bytes.data(), bytes.size());
  if (contents.external) return LoadExternalModule(contents);
  return CreateSpinnModule(ffi::String(contents.symbol),
                           ffi::Bytes(contents.program, contents.program_size));
}

void BeginExternalExport() {
  external_export.active = true;
  external_export.programs.clear();
}

ffi::Array<ffi::Any> EndExternalExport() {
  ffi::Array<ffi::Any> out(external_export.programs.begin(), external_export.programs.end());
  external_export.active = false;
  external_export.programs.clear();
  return out;
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
      .def("tvm_spinn.runtime.create_module_view", CreateSpinnModuleView,
           "Create a spinn runtime module over (symbol, 1-D uint8 host tensor), without a copy.")
      .def("ffi.Module.load_from_bytes.spinn", LoadSpinnModuleFromBytes,
           "Deserialize a spinn module from its versioned container bytes.")
      .def("tvm_spinn.runtime.save_to_bytes", ModuleSaveToBytes,
           "Return Module::SaveToBytes() of a binary-serializable module.")
      .def("tvm_spinn.runtime.begin_external_export", BeginExternalExport,
           "On this thread, SaveToBytes moves spinn programs out of their containers.")
      .def("tvm_spinn.runtime.end_external_export", EndExternalExport,
           "Stop moving programs out; return those moved since begin_external_export, in order.");
}

}  // namespace tvm_spinn
