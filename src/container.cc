// Encoder / validating decoder of the spinn module container (layout in container.h).
#include "container.h"

#include <tvm/ffi/error.h>

#include <cstring>
#include <limits>

#include "fnv1a.h"

namespace tvm_spinn {
namespace {

template <typename T>
void PutLE(std::string* out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out->push_back(static_cast<char>(static_cast<uint64_t>(value) >> (8 * i) & 0xff));
  }
}

/*! \brief Bounds-checked little-endian cursor over an untrusted buffer. */
class Reader {
 public:
  Reader(const char* data, size_t size) : data_(data), size_(size) {}

  size_t offset() const { return offset_; }
  size_t remaining() const { return size_ - offset_; }

  /*! \brief Make sure `n` more bytes exist; `what` names the field for the message. */
  void Require(uint64_t n, const char* what) const {
    if (n > remaining()) {
      // need = offset + n may exceed 2^64 for a corrupted u64 length: saturate.
      uint64_t need = n > std::numeric_limits<uint64_t>::max() - offset_
                          ? std::numeric_limits<uint64_t>::max()
                          : offset_ + n;
      TVM_FFI_THROW(ValueError) << "spinn module: truncated container (need " << need
                                << " bytes, have " << size_ << ") while reading " << what;
    }
  }

  template <typename T>
  T ReadLE(const char* what) {
    Require(sizeof(T), what);
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) {
      v |= static_cast<uint64_t>(static_cast<unsigned char>(data_[offset_ + i])) << (8 * i);
    }
    offset_ += sizeof(T);
    return static_cast<T>(v);
  }

  /*! \brief The next `n` bytes, in place (a pointer into the buffer). */
  const char* Skip(uint64_t n, const char* what) {
    Require(n, what);
    const char* out = data_ + offset_;
    offset_ += static_cast<size_t>(n);
    return out;
  }

 private:
  const char* data_;
  size_t size_;
  size_t offset_ = 0;
};

/*! \brief Quote untrusted bytes for an error message: ASCII kept, others as \\xNN. */
std::string Printable(const char* data, size_t n) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(data[i]);
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kDigits[c >> 4]);
      out.push_back(kDigits[c & 0xf]);
    }
  }
  return out;
}

void CheckEnd(const Reader& in, size_t size) {
  if (in.remaining() != 0) {
    TVM_FFI_THROW(ValueError) << "spinn module: " << in.remaining()
                              << " trailing bytes after the checksum (container is " << size
                              << " bytes, expected " << in.offset() << ")";
  }
}

/*! \brief The rest of a version-3 container (after the program length): digest, checksum. */
ModuleContents DecodeExternal(const char* data, size_t size, Reader* in, const char* symbol,
                              uint32_t sym_len, uint64_t prog_len) {
  const char* digest = in->Skip(kProgramDigestBytes, "program digest");
  const size_t checked = in->offset();
  uint64_t stored = in->ReadLE<uint64_t>("checksum");
  CheckEnd(*in, size);
  uint64_t computed = Fnv1a64(data, checked);
  if (stored != computed) {
    TVM_FFI_THROW(ValueError) << "spinn module: checksum mismatch (stored 0x" << Hex64(stored)
                              << ", computed 0x" << Hex64(computed) << "): container is corrupted";
  }
  if (sym_len == 0) {
    TVM_FFI_THROW(ValueError) << "spinn module: empty symbol in container";
  }
  ModuleContents out;
  out.symbol.assign(symbol, sym_len);
  out.program_size = static_cast<size_t>(prog_len);
  out.external = true;
  out.digest.assign(digest, kProgramDigestBytes);
  return out;
}

}  // namespace

/*!
 * \brief The container checksum: FNV-1a of the framing [data, data + framing) and of the
 *        program's own digest (see container.h).
 */
uint64_t ContainerChecksum(const char* data, size_t framing, const char* program, size_t program_size) {
  static constexpr char kProgramMagic[8] = {'S', 'P', 'I', 'N', 'N', 'P', 'R', 'G'};
  constexpr size_t kDigest = 32;
  uint64_t state = Fnv1a64(data, framing);
  if (program_size >= sizeof(kProgramMagic) + kDigest &&
      std::memcmp(program, kProgramMagic, sizeof(kProgramMagic)) == 0) {
    return Fnv1a64(program + program_size - kDigest, kDigest, state);
  }
  return Fnv1a64(program, program_size, state);
}

std::string EncodeContainer(const std::string& symbol, const char* program, size_t program_size) {
  if (symbol.size() > std::numeric_limits<uint32_t>::max()) {
    TVM_FFI_THROW(ValueError) << "spinn module: symbol too long (" << symbol.size() << " bytes)";
  }
  std::string out;
  out.reserve(sizeof(kContainerMagic) + 4 + 4 + symbol.size() + 8 + program_size + 8);
  out.append(kContainerMagic, sizeof(kContainerMagic));
  PutLE<uint32_t>(&out, kContainerVersion);
  PutLE<uint32_t>(&out, static_cast<uint32_t>(symbol.size()));
  out.append(symbol);
  PutLE<uint64_t>(&out, static_cast<uint64_t>(program_size));
  const size_t framing = out.size();
  out.append(program, program_size);
  PutLE<uint64_t>(&out, ContainerChecksum(out.data(), framing, program, program_size));
  return out;
}

std::string EncodeExternalContainer(const std::string& symbol, size_t program_size,
                                    const char* digest) {
  if (symbol.size() > std::numeric_limits<uint32_t>::max()) {
    TVM_FFI_THROW(ValueError) << "spinn module: symbol too long (" << symbol.size() << " bytes)";
  }
  std::string out;
  out.append(kContainerMagic, sizeof(kContainerMagic));
  PutLE<uint32_t>(&out, kExternalContainerVersion);
  PutLE<uint32_t>(&out, static_cast<uint32_t>(symbol.size()));
  out.append(symbol);
  PutLE<uint64_t>(&out, static_cast<uint64_t>(program_size));
  out.append(digest, kProgramDigestBytes);
  PutLE<uint64_t>(&out, Fnv1a64(out.data(), out.size()));
  return out;
}

ModuleContents DecodeContainer(const char* data, size_t size) {
  if (data == nullptr && size != 0) {
    TVM_FFI_THROW(ValueError) << "spinn module: null container buffer";
  }
  Reader in(data, size);
  in.Require(sizeof(kContainerMagic), "magic");
  if (std::memcmp(data, kContainerMagic, sizeof(kContainerMagic)) != 0) {
    TVM_FFI_THROW(ValueError) << "spinn module: bad magic (expected \"SPINNMOD\", got \""
                              << Printable(data, sizeof(kContainerMagic))
                              << "\"): not a spinn module container";
  }
  in.Skip(sizeof(kContainerMagic), "magic");
  uint32_t version = in.ReadLE<uint32_t>("container version");
  if (version != kContainerVersion && version != kExternalContainerVersion) {
    TVM_FFI_THROW(ValueError) << "spinn module: unknown container version " << version
                              << " (this runtime reads versions " << kContainerVersion << " and "
                              << kExternalContainerVersion << ")";
  }
  uint32_t sym_len = in.ReadLE<uint32_t>("symbol length");
  const char* symbol = in.Skip(sym_len, "symbol");
  uint64_t prog_len = in.ReadLE<uint64_t>("program length");
  if (version == kExternalContainerVersion) return DecodeExternal(data, size, &in, symbol, sym_len, prog_len);
  const size_t framing = in.offset();
  const char* program = in.Skip(prog_len, "program");
  uint64_t stored = in.ReadLE<uint64_t>("checksum");
  CheckEnd(in, size);
  uint64_t computed = ContainerChecksum(data, framing, program, static_cast<size_t>(prog_len));
  if (stored != computed) {
    TVM_FFI_THROW(ValueError) << "spinn module: checksum mismatch (stored 0x" << Hex64(stored)
                              << ", computed 0x" << Hex64(computed) << "): container is corrupted";
  }
  if (sym_len == 0) {
    TVM_FFI_THROW(ValueError) << "spinn module: empty symbol in container";
  }
  ModuleContents out;
  out.symbol.assign(symbol, sym_len);
  out.program = program;
  out.program_size = static_cast<size_t>(prog_len);
  return out;
}

}  // namespace tvm_spinn
