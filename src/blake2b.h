// BLAKE2b (RFC 7693), unkeyed, one shot: the content key of a spinn program.
//
// The key decides which parsed program the Python executor reuses, so it must be
// collision-resistant (FNV-1a is not: colliding inputs are easy to construct).
#ifndef TVM_SPINN_BLAKE2B_H_
#define TVM_SPINN_BLAKE2B_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace tvm_spinn {
namespace blake2b_detail {

constexpr uint64_t kIV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
                             0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                             0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

constexpr uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

inline uint64_t Rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline uint64_t Load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, AArch64): the format's byte order
  return v;
}

// One round on the 16 working words, with the message words permuted by sigma[r]. Written on
// named locals (not an indexed array) so the compiler keeps the state in registers.
#define TVM_SPINN_B2B_G(a, b, c, d, x, y) \
  a = a + b + (x);                         \
  d = Rotr(d ^ a, 32);                     \
  c = c + d;                               \
  b = Rotr(b ^ c, 24);                     \
  a = a + b + (y);                         \
  d = Rotr(d ^ a, 16);                     \
  c = c + d;                               \
  b = Rotr(b ^ c, 63)

inline void Compress(uint64_t h[8], const unsigned char block[128], uint64_t t, bool last) {
  uint64_t m[16];
  for (int i = 0; i < 16; ++i) m[i] = Load64(block + 8 * i);
  uint64_t v0 = h[0], v1 = h[1], v2 = h[2], v3 = h[3], v4 = h[4], v5 = h[5], v6 = h[6], v7 = h[7];
  uint64_t v8 = kIV[0], v9 = kIV[1], v10 = kIV[2], v11 = kIV[3];
  uint64_t v12 = kIV[4] ^ t;  // the high word of the 128-bit counter stays 0 (inputs < 2^64 bytes)
  uint64_t v13 = kIV[5];
  uint64_t v14 = last ? ~kIV[6] : kIV[6];
  uint64_t v15 = kIV[7];
#pragma GCC unroll 12
  for (int r = 0; r < 12; ++r) {
    const uint8_t* s = kSigma[r];
    TVM_SPINN_B2B_G(v0, v4, v8, v12, m[s[0]], m[s[1]]);
    TVM_SPINN_B2B_G(v1, v5, v9, v13, m[s[2]], m[s[3]]);
    TVM_SPINN_B2B_G(v2, v6, v10, v14, m[s[4]], m[s[5]]);
    TVM_SPINN_B2B_G(v3, v7, v11, v15, m[s[6]], m[s[7]]);
    TVM_SPINN_B2B_G(v0, v5, v10, v15, m[s[8]], m[s[9]]);
    TVM_SPINN_B2B_G(v1, v6, v11, v12, m[s[10]], m[s[11]]);
    TVM_SPINN_B2B_G(v2, v7, v8, v13, m[s[12]], m[s[13]]);
    TVM_SPINN_B2B_G(v3, v4, v9, v14, m[s[14]], m[s[15]]);
  }
  h[0] ^= v0 ^ v8;
  h[1] ^= v1 ^ v9;
  h[2] ^= v2 ^ v10;
  h[3] ^= v3 ^ v11;
  h[4] ^= v4 ^ v12;
  h[5] ^= v5 ^ v13;
  h[6] ^= v6 ^ v14;
  h[7] ^= v7 ^ v15;
}

#undef TVM_SPINN_B2B_G

}  // namespace blake2b_detail

/*!
 * \brief Unkeyed BLAKE2b of [data, data + size) with an `out_bytes`-byte digest (1..64), as
 *        lower-case hex; equals Python's hashlib.blake2b(data, digest_size=out_bytes).hexdigest().
 *        Reads the input in place (no copy).
 */
inline std::string Blake2bHex(const void* data, size_t size, size_t out_bytes = 32) {
  using namespace blake2b_detail;
  uint64_t h[8];
  for (int i = 0; i < 8; ++i) h[i] = kIV[i];
  h[0] ^= 0x01010000ULL ^ static_cast<uint64_t>(out_bytes);
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t done = 0;
  // Every full block but the last is compressed as "not last"; the final (possibly partial or
  // empty) block is zero-padded and flagged.
  while (size - done > 128) {
    Compress(h, p + done, done + 128, false);
    done += 128;
  }
  unsigned char tail[128] = {0};
  if (size > done) std::memcpy(tail, p + done, size - done);
  Compress(h, tail, size, true);
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * out_bytes);
  for (size_t i = 0; i < out_bytes; ++i) {
    auto byte = static_cast<unsigned char>(h[i / 8] >> (8 * (i % 8)));
    out.push_back(kDigits[byte >> 4]);
    out.push_back(kDigits[byte & 0xf]);
  }
  return out;
}

}  // namespace tvm_spinn

#endif  // TVM_SPINN_BLAKE2B_H_
