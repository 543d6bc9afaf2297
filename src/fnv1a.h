// 64-bit FNV-1a hash: content key of a spinn program and checksum of the module container.
#ifndef TVM_SPINN_FNV1A_H_
#define TVM_SPINN_FNV1A_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace tvm_spinn {

constexpr uint64_t kFnv1aOffsetBasis = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnv1aPrime = 0x100000001b3ULL;

/*! \brief FNV-1a over [data, data + size), continuing from `state`. */
inline uint64_t Fnv1a64(const void* data, size_t size, uint64_t state = kFnv1aOffsetBasis) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) {
    state ^= p[i];
    state *= kFnv1aPrime;
  }
  return state;
}

/*! \brief Lower-case, zero-padded 16-digit hex spelling of a 64-bit value. */
inline std::string Hex64(uint64_t value) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, value >>= 4) out[i] = kDigits[value & 0xf];
  return out;
}

}  // namespace tvm_spinn

#endif  // TVM_SPINN_FNV1A_H_
