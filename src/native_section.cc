// Decoder and validator of a spinn program's native section (layout in native_section.h).
#include "native_section.h"

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "native_schema.h"
#include "sim_plan.h"

namespace tvm_spinn {
namespace {

namespace ffi = tvm::ffi;
using namespace schema;  // NOLINT: the schema's names are this file's vocabulary

constexpr size_t kProgramDigest = 32;
constexpr int64_t kMaxBytes = int64_t{1} << 48;  // larger than any buffer a program may name

[[noreturn]] void Fail(const std::string& field, const std::string& defect) {
  TVM_FFI_THROW(ValueError) << "native section: " << field << ": " << defect;
}

uint64_t U64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

uint32_t U32(const char* p) { return static_cast<uint32_t>(U64(p) & 0xffffffffu) ; }

/*! \brief Bounds-checked reader of int64 words over [data, data + size). */
class Words {
 public:
  Words(const char* data, size_t size, size_t pos) : data_(data), size_(size), pos_(pos) {}
  int64_t Next(const char* field) {
    if (pos_ + 8 > size_) Fail(field, "the section ends before it");
    const int64_t v = static_cast<int64_t>(U64(data_ + pos_));
    pos_ += 8;
    return v;
  }
  /*! \brief A count in [0, limit]. */
  int64_t Count(const char* field, int64_t limit) {
    const int64_t v = Next(field);
    if (v < 0 || v > limit) Fail(field, "count " + std::to_string(v) + " out of [0, " + std::to_string(limit) + "]");
    return v;
  }
  size_t pos() const { return pos_; }

 private:
  const char* data_;
  size_t size_;
  size_t pos_;
};

/*! \brief A uint8 view of memory `keep` owns, or a copy of it where it is not 8-byte aligned. */
struct ViewAlloc {
  const char* ptr;
  ffi::Any keep;
  bool own;
  void AllocData(DLTensor* t) {
    if (!own) {
      t->data = const_cast<char*>(ptr);
      return;
    }
    const size_t n = ffi::GetDataSize(*t);
    t->data = std::aligned_alloc(64, (n + 63) / 64 * 64 + 64);
    if (t->data == nullptr) TVM_FFI_THROW(RuntimeError) << "native section: out of memory";
    std::memcpy(t->data, ptr, n);
  }
  void FreeData(DLTensor* t) {
    if (own) std::free(t->data);
  }
};

bool ValidDType(int64_t code, int64_t bits) {
  const bool kind_ok = code == kDLInt || code == kDLUInt || code == kDLFloat || code == kDLBool;
  return kind_ok && (bits == 8 || bits == 16 || bits == 32 || bits == 64);
}

/*! \brief Bytes of `numel` elements of `bits`, checked against kMaxBytes. */
int64_t Bytes(int64_t numel, int64_t bits, const char* field) {
  if (numel < 0 || numel > kMaxBytes / 8) Fail(field, "element count " + std::to_string(numel));
  return numel * (bits / 8);
}

}  // namespace

uint32_t Crc32(const void* data, size_t size) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

void NativeProgram::CheckBlob() const {
  if (blob_checked->load(std::memory_order_acquire)) return;
  if (Crc32(blob, static_cast<size_t>(blob_len)) != blob_crc) {
    TVM_FFI_THROW(ValueError) << "native section: blob_crc: the program's constant blob is damaged "
                                 "(CRC-32 mismatch)";
  }
  blob_checked->store(true, std::memory_order_release);
}

NativeProgram DecodeNativeProgram(const char* data, size_t size, ffi::Any keep) {
  NativeProgram out;
  // The program's framing (version 5's checks are the Python validator's; only what the section
  // needs is read here, each length against what is left).
  if (size < 24 + 8 + kProgramDigest) return out;
  const uint32_t version = U32(data + 8);
  if (version != 6) return out;
  const size_t end = size - kProgramDigest;  // the section ends where the digest starts
  const uint64_t hlen = U64(data + 16);
  if (hlen > end - 24) Fail("header length", "does not fit the program");
  size_t pos = 24 + static_cast<size_t>(hlen);
  pos += (64 - pos % 64) % 64;
  if (pos + 8 > end) Fail("blob length", "the program ends before it");
  const uint64_t blob_len = U64(data + pos);
  pos += 8;
  if (blob_len > end - pos) Fail("blob length", "does not fit the program");
  const char* blob = data + pos;
  pos += static_cast<size_t>(blob_len);
  pos += (64 - pos % 64) % 64;
  if (pos + 24 + 8 > end) Fail("framing", "the program ends before its native section");
  const char* s = data + pos;
  const size_t len = end - pos;
  if (std::memcmp(s, kSectionMagic, sizeof(kSectionMagic)) != 0) Fail("magic", "not a native section");
  if (U32(s + 8) != kSectionVersion) {
    Fail("version", std::to_string(U32(s + 8)) + " is not supported (this runtime reads " +
                        std::to_string(kSectionVersion) + ")");
  }
  if (U64(s + 16) != len) Fail("length", "the section does not end where the program's digest starts");
  if (len % 8 != 0) Fail("length", "not a multiple of 8");
  if (Crc32(s, len - 8) != U32(s + len - 8) || U32(s + len - 4) != 0) {
    Fail("checksum", "CRC-32 mismatch (damaged section)");
  }
  const size_t body = len - 8;  // the checksum words are not read as fields
  out.present = true;
  const uint32_t status = U32(s + 12);
  Words w(s, body, 24);
  const int64_t max_words = static_cast<int64_t>(body / 8);
  if (status == kStatusPython) {
    out.layer_index = w.Next("layer");
    const int64_t name_len = w.Count("layer name", static_cast<int64_t>(body));
    const int64_t reason_len = w.Count("reason", static_cast<int64_t>(body));
    if (w.pos() + static_cast<size_t>(name_len) + static_cast<size_t>(reason_len) > body) {
      Fail("layer name", "the section ends before it");
    }
    out.layer.assign(s + w.pos(), static_cast<size_t>(name_len));
    out.reason.assign(s + w.pos() + name_len, static_cast<size_t>(reason_len));
    return out;
  }
  if (status != kStatusPlan) Fail("status", std::to_string(status));
  if (w.Next("blob_bytes") != static_cast<int64_t>(blob_len)) {
    Fail("blob_bytes", "does not match the program's constant blob");
  }
  const int64_t blob_crc = w.Next("blob_crc");
  if (blob_crc < 0 || blob_crc > 0xffffffffLL) Fail("blob_crc", "not a CRC-32");
  const int64_t header_crc = w.Next("header_crc");
  if (header_crc < 0 || header_crc > 0xffffffffLL) Fail("header_crc", "not a CRC-32");
  if (Crc32(data + 24, static_cast<size_t>(hlen)) != static_cast<uint32_t>(header_crc)) {
    out.reason = "the program was changed after its plan was compiled: its header differs";
    return out;  // present, not runnable: the package runs it; without it, one error saying why
  }
  out.blob = blob;
  out.blob_len = blob_len;
  out.blob_crc = static_cast<uint32_t>(blob_crc);
  out.keep = keep;
  const int64_t n_inputs = w.Count("n_inputs", max_words);
  const int64_t n_outputs = w.Count("n_outputs", max_words);
  const int64_t n_consts = w.Count("n_consts", max_words);
  const int64_t n_run = w.Count("n_run_args", max_words);
  const int64_t n_temps = w.Count("n_temps", max_words);
  const int64_t n_code = w.Count("n_code", max_words);
  const int64_t inline_bytes = w.Count("inline_bytes", static_cast<int64_t>(body));
  out.n_inputs = n_inputs;
  for (int64_t i = 0; i < n_inputs + n_outputs; ++i) {
    NativeArgSpec spec;
    const int64_t code = w.Next("argument dtype"), bits = w.Next("argument dtype");
    if (!ValidDType(code, bits)) Fail("argument " + std::to_string(i), "bad dtype");
    const int64_t ndim = w.Count("argument rank", kMaxDims);
    int64_t numel = 1;
    for (int d = 0; d < kMaxDims; ++d) {
      const int64_t extent = w.Next("argument shape");
      if (d >= ndim) continue;
      if (extent < 0 || extent > kMaxBytes || (extent > 0 && numel > kMaxBytes / extent)) {
        Fail("argument " + std::to_string(i), "bad extent " + std::to_string(extent));
      }
      numel *= extent;
      spec.shape.push_back(extent);
    }
    Bytes(numel, bits, "argument size");
    spec.code = static_cast<uint8_t>(code);
    spec.bits = static_cast<uint8_t>(bits);
    out.args.push_back(std::move(spec));
  }
  struct ConstRef {
    int64_t kind, code, bits, numel, offset;
  };
  std::vector<ConstRef> consts;
  for (int64_t i = 0; i < n_consts; ++i) {
    ConstRef c{w.Next("constant kind"), w.Next("constant dtype"), w.Next("constant dtype"),
               w.Next("constant numel"), w.Next("constant offset")};
    if ((c.kind != kConstProgram && c.kind != kConstInline) || !ValidDType(c.code, c.bits)) {
      Fail("constant " + std::to_string(i), "bad kind or dtype");
    }
    const int64_t nbytes = Bytes(c.numel, c.bits, "constant size");
    const int64_t limit = c.kind == kConstProgram ? static_cast<int64_t>(blob_len) : inline_bytes;
    if (c.offset < 0 || c.offset > limit || nbytes > limit - c.offset) {
      Fail("constant " + std::to_string(i), "bytes [" + std::to_string(c.offset) + ", +" + std::to_string(nbytes) +
                                                ") outside its " + (c.kind == kConstProgram ? "blob" : "inline data"));
    }
    consts.push_back(c);
  }
  std::vector<int64_t> outputs_seen(static_cast<size_t>(n_outputs), 0);
  for (int64_t i = 0; i < n_run; ++i) {
    const int64_t a = w.Next("plan argument");
    if (a < 0 || a >= n_inputs + n_outputs) Fail("plan argument " + std::to_string(i), "no DPS argument " + std::to_string(a));
    if (a >= n_inputs && outputs_seen[static_cast<size_t>(a - n_inputs)]++) {
      Fail("plan argument " + std::to_string(i), "output written twice");
    }
    out.plan_args.push_back(a);
  }
  for (int64_t seen : outputs_seen) {
    if (!seen) Fail("plan arguments", "an output is never written");
  }
  ffi::Array<int64_t> temps;
  for (int64_t i = 0; i < n_temps; ++i) temps.push_back(w.Count("temporary bytes", kMaxBytes));
  ffi::Array<int64_t> code;
  for (int64_t i = 0; i < n_code; ++i) code.push_back(w.Next("code"));
  size_t inline_at = w.pos();
  inline_at += (kSectionAlign - inline_at % kSectionAlign) % kSectionAlign;
  if (inline_at + static_cast<size_t>(inline_bytes) != body) {
    Fail("inline_bytes", "the inline data does not end where the checksum starts");
  }
  ffi::Array<ffi::Tensor> tensors;
  for (const ConstRef& c : consts) {
    const char* ptr = (c.kind == kConstProgram ? blob : s + inline_at) + c.offset;
    const bool own = reinterpret_cast<uintptr_t>(ptr) % 8 != 0;
    DLDataType dtype{static_cast<uint8_t>(c.code), static_cast<uint8_t>(c.bits), 1};
    int64_t shape[1] = {c.numel};
    tensors.push_back(ffi::Tensor::FromNDAlloc(ViewAlloc{ptr, keep, own}, ffi::ShapeView(shape, 1), dtype,
                                               DLDevice{kDLCPU, 0}));
  }
  ffi::Array<int64_t> arg_bytes;
  for (int64_t a : out.plan_args) {
    const NativeArgSpec& spec = out.args[static_cast<size_t>(a)];
    int64_t numel = 1;
    for (int64_t d : spec.shape) numel *= d;
    arg_bytes.push_back(numel * (spec.bits / 8));
  }
  try {
    out.plan = PlanCreate(code, tensors, arg_bytes, temps);
  } catch (const ffi::Error& err) {
    Fail("code", err.message());
  }
  out.runnable = true;
  return out;
}

}  // namespace tvm_spinn
