// The native section of a spinn program (format version 6): the program's execution plan as
// instructions of the native interpreter (sim_plan.cc), so that the spinn module runs the
// program without the Python package.
//
// Program layout of version 6 (version 5's, see python/tvm_spinn/program/format.py, with the
// section between the constant blob and the digest):
//   magic "SPINNPRG", u32 version, u32 reserved, u64 header length H, header (H bytes),
//   zero padding to a multiple of 64, u64 blob length B, blob (B bytes),
//   zero padding to a multiple of 64, section (its length in its own framing), digest (32 bytes)
//
// Section layout (little-endian; written by python/tvm_spinn/program/native_section.py; the
// codes and framing constants come from native_schema.h, generated from the one schema):
//   magic "SPINNPLN" (8), u32 version, u32 status, u64 section length L (all of it)
//   status kStatusPython: i64 layer index (-1: the program as a whole), i64 name bytes N,
//     i64 reason bytes R, name, reason (UTF-8), zero padding to 8
//   status kStatusPlan: i64 words
//     blob_bytes blob_crc header_crc n_inputs n_outputs n_consts n_run_args n_temps n_code inline_bytes
//     (blob_crc: CRC-32 of the constant blob, checked before the first run: the package checks
//     the program's digest, a process without it this; header_crc: CRC-32 of the header text the
//     plan was compiled for: a program whose header was changed since has no runnable plan)
//     per DPS argument (inputs, then outputs): dtype_code dtype_bits ndim shape[kMaxDims]
//     per constant: kind (kConstProgram: offset into the blob; kConstInline: offset into the
//       inline data) dtype_code dtype_bits numel offset
//     per argument of the plan (the run's inputs, then its outputs): its DPS argument index
//     per temporary: bytes
//     code: n_code words
//     zero padding to a multiple of kSectionAlign (from the section start), inline data
//   u32 CRC-32 (zlib's) of every section byte before it, u32 0
//
// Every count, offset, extent and slot is checked before anything is read through it: a damaged
// or foreign section is a ValueError naming the field, never an out-of-bounds read.
#ifndef TVM_SPINN_NATIVE_SECTION_H_
#define TVM_SPINN_NATIVE_SECTION_H_

#include <tvm/ffi/any.h>
#include <tvm/ffi/function.h>

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tvm_spinn {

/*! \brief A DPS argument's dtype and shape. */
struct NativeArgSpec {
  uint8_t code = 0;
  uint8_t bits = 0;
  std::vector<int64_t> shape;
};

/*! \brief What a program's native section says: a runnable plan, or why there is none. */
struct NativeProgram {
  bool present = false;      // the program has a native section (format version 6)
  bool runnable = false;     // ... holding a plan
  int64_t layer_index = -1;  // not runnable: the layer that needs Python (-1: the program)
  std::string layer;         // its name
  std::string reason;        // why
  int64_t n_inputs = 0;
  std::vector<NativeArgSpec> args;   // DPS arguments: inputs, then outputs
  std::vector<int64_t> plan_args;    // per argument of the plan: its DPS argument index
  tvm::ffi::Function plan;           // f(*plan arguments)
  const char* blob = nullptr;        // the program's constant blob (held by `keep`)
  uint64_t blob_len = 0;
  uint32_t blob_crc = 0;
  tvm::ffi::Any keep;
  std::shared_ptr<std::atomic<bool>> blob_checked = std::make_shared<std::atomic<bool>>(false);

  /*! \brief Check the blob's CRC-32 once (throws ValueError if it does not match). */
  void CheckBlob() const;
};

/*!
 * \brief The native section of the spinn program [data, data + size) (magic checked by the
 *        caller), decoded and validated, its plan created over constants read in place (`keep`
 *        holds the program's memory alive as long as the plan). A program of another version
 *        has none (present = false).
 * \throws tvm::ffi::Error (ValueError) "native section: <field>: <defect>".
 */
NativeProgram DecodeNativeProgram(const char* data, size_t size, tvm::ffi::Any keep);

/*! \brief CRC-32 (zlib's polynomial) of [data, data + size). */
uint32_t Crc32(const void* data, size_t size);

}  // namespace tvm_spinn

#endif  // TVM_SPINN_NATIVE_SECTION_H_
