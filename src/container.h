// Versioned binary container of a spinn runtime module (what SaveToBytes writes).
//
// Layout, all integers little-endian:
//   magic      8 bytes  "SPINNMOD"
//   version    u32      kContainerVersion
//   sym_len    u32
//   symbol     sym_len bytes (UTF-8, non-empty)
//   prog_len   u64
//   program    prog_len bytes (opaque: produced and parsed by Python)
//   checksum   u64      FNV-1a 64 of the framing (magic .. prog_len) and of the program's
//                       digest: its last 32 bytes when the program is a spinn program (magic
//                       "SPINNPRG"), whose BLAKE2b-256 digest of every other byte the validator
//                       verifies at load; else of the whole program. So a module of hundreds of
//                       MB of weights is not hashed twice.
//
// Version 3 (an *external* program, written only while a sealed library is exported, see
// python/tvm_spinn/runtime/loader.py): the program bytes are not in the container but after the
// ELF contents of the library file, where they can be memory-mapped instead of being copied by
// TVM's loader (twice) and by this module. The container then names them:
//   magic, version (3), sym_len, symbol, prog_len   as above
//   digest     32 bytes  the program's trailing BLAKE2b-256 digest (its identity in the file)
//   checksum   u64       FNV-1a 64 of every byte before it
#ifndef TVM_SPINN_CONTAINER_H_
#define TVM_SPINN_CONTAINER_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace tvm_spinn {

constexpr char kContainerMagic[8] = {'S', 'P', 'I', 'N', 'N', 'M', 'O', 'D'};
constexpr uint32_t kContainerVersion = 2;
/*! \brief Version of a container naming an external program (see the layout above). */
constexpr uint32_t kExternalContainerVersion = 3;
/*! \brief Bytes of a spinn program's trailing digest. */
constexpr size_t kProgramDigestBytes = 32;

/*!
 * \brief What a valid container holds. `program` points into the decoded buffer (no copy): it
 *        lives as long as that buffer.
 */
struct ModuleContents {
  std::string symbol;
  const char* program = nullptr;  // nullptr for an external program (version 3)
  size_t program_size = 0;
  bool external = false;
  std::string digest;  // external only: the program's trailing digest
};

/*! \brief Serialize symbol + program ([program, program + program_size)) into the container. */
std::string EncodeContainer(const std::string& symbol, const char* program, size_t program_size);

/*!
 * \brief Serialize a version-3 container naming the external program of `program_size` bytes
 *        whose trailing digest is `digest` (kProgramDigestBytes bytes).
 */
std::string EncodeExternalContainer(const std::string& symbol, size_t program_size,
                                    const char* digest);

/*!
 * \brief Parse and validate a container. The checksum is computed over the buffer in place,
 *        before anything is copied out of it.
 * \throws tvm::ffi::Error (kind ValueError) with a "spinn module: ..." message on any defect;
 *         never reads outside [data, data + size).
 */
ModuleContents DecodeContainer(const char* data, size_t size);

}  // namespace tvm_spinn

#endif  // TVM_SPINN_CONTAINER_H_
