// tvm_spinn.sim.plan_create: a run of a program's layers as one instruction list, executed in
// one FFI call per region call.
//
// A small model's region call spent most of its time crossing from Python into each layer's
// kernel (3-10 us per layer, against 1-2 us of arithmetic). The simulator's plan
// (python/tvm_spinn/runtime/simulator.py) therefore hands runs of consecutive layers whose
// operator family can describe them (program/ops/native.py) to this interpreter: the same
// kernels as the per-layer entry points (kernels.h), called on raw buffers, so the bits are
// those of the per-layer path operation for operation.
//
// Buffers are "slots", each one contiguous block: constants (captured at creation), the call's
// arguments (the run's inputs, then the values it hands back) and temporaries (one arena per
// call: concurrent calls share nothing). Every instruction is validated against the slots'
// sizes when the plan is created, so a call can only read and write inside its buffers.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "native_schema.h"
#include "sim_plan.h"
#include "tensor_check.h"

namespace tvm_spinn {
namespace {

namespace ffi = tvm::ffi;

constexpr const char* kFunc = "tvm_spinn.sim.plan_create";

// Instruction codes, word counts and kinds: src/native_schema.h, generated from the one schema
// (python/tvm_spinn/program/native_schema.py) that the Python writers use too.
using namespace schema;  // NOLINT: the schema's names are this interpreter's vocabulary

// The im2col and depthwise instructions carry their geometry as these structs' 15 fields in order.
static_assert(sizeof(Im2ColShape) == 15 * sizeof(int64_t), "Im2ColShape: 15 int64 fields");
static_assert(sizeof(DepthwiseShape) == 15 * sizeof(int64_t), "DepthwiseShape: 15 int64 fields");
static_assert(sizeof(PoolGradShape) == 11 * sizeof(int64_t), "PoolGradShape: 11 int64 fields");

constexpr size_t kAlign = 64;
constexpr size_t kKeepArena = size_t{64} << 20;  // larger temporaries are not kept between calls

/*!
 * \brief A geometry struct of int64 fields (Im2ColShape, DepthwiseShape) read from consecutive
 *        instruction words, which the encoder writes in the struct's field order.
 */
template <typename S>
S Words(const std::vector<int64_t>& w, size_t first) {
  static_assert(std::is_trivially_copyable<S>::value && sizeof(S) % sizeof(int64_t) == 0, "int64 fields only");
  S s;
  std::memcpy(&s, w.data() + first, sizeof(S));
  return s;
}

float BitsToFloat(int64_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits);
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/*! \brief The M4F's default NaN 0x7FC00000 (an invalid operation's result on numbers). */
float M4fDefaultNaN() { return BitsToFloat(0x7FC00000); }

/*! \brief One instruction: its words (code first). */
struct Instr {
  std::vector<int64_t> w;
  int64_t operator[](size_t i) const { return w[i]; }
};

/*! \brief One row of WhereLess: operand q read at [i] where bit q of M is set, else at [0]; both
 *         candidates loaded and selected by a mask (vectorizable). */
template <int M>
void WhereRow(const float* a, const float* b, const uint32_t* c, const uint32_t* d, uint32_t* o,
                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = a[(M & 1) ? i : 0], y = b[(M & 2) ? i : 0];
    const uint32_t u = c[(M & 4) ? i : 0], v = d[(M & 8) ? i : 0];
    const uint32_t m = 0u - static_cast<uint32_t>(x < y);
    o[i] = (u & m) | (v & ~m);
  }
}
using WhereRowFn = void (*)(const float*, const float*, const uint32_t*, const uint32_t*, uint32_t*, int64_t);
template <int... M>
constexpr std::array<WhereRowFn, sizeof...(M)> WhereRows(std::integer_sequence<int, M...>) {
  return {&WhereRow<M>...};
}
constexpr std::array<WhereRowFn, 16> kWhereRows = WhereRows(std::make_integer_sequence<int, 16>{});

class Plan {
 public:
  Plan(const ffi::Array<int64_t>& code, const ffi::Array<ffi::Tensor>& consts,
       const ffi::Array<int64_t>& arg_bytes, const ffi::Array<int64_t>& temp_bytes)
      : consts_(consts.begin(), consts.end()) {
    for (const ffi::Tensor& t : consts_) {
      const DLTensor* d = t.GetDLTensorPtr();
      if (d->device.device_type != kDLCPU || !t.IsContiguous()) {
        TVM_FFI_THROW(ValueError) << kFunc << ": constants must be contiguous host tensors";
      }
      bytes_.push_back(static_cast<int64_t>(ffi::GetDataSize(static_cast<size_t>(t.numel()), d->dtype)));
    }
    n_args_ = static_cast<int64_t>(arg_bytes.size());
    for (int64_t b : arg_bytes) bytes_.push_back(CheckBytes(b));
    arena_ = 0;
    for (int64_t b : temp_bytes) {
      offsets_.push_back(arena_);
      bytes_.push_back(CheckBytes(b));
      arena_ += (static_cast<size_t>(b) + kAlign - 1) / kAlign * kAlign;
    }
    Decode(code);
  }

  void Run(ffi::PackedArgs args) const {
    if (args.size() != n_args_) {
      TVM_FFI_THROW(ValueError) << "tvm_spinn.sim plan: expected " << n_args_ << " arguments, got "
                                << args.size();
    }
    const size_t n_consts = consts_.size();
    std::vector<char*> base(bytes_.size());
    for (size_t i = 0; i < n_consts; ++i) {
      const DLTensor* d = consts_[i].GetDLTensorPtr();
      base[i] = static_cast<char*>(d->data) + d->byte_offset;
    }
    for (int64_t i = 0; i < n_args_; ++i) {
      ffi::TensorView t = args[i].cast<ffi::TensorView>();
      const int64_t want = bytes_[n_consts + i];
      const int64_t got = static_cast<int64_t>(ffi::GetDataSize(static_cast<size_t>(t.numel()), t.dtype()));
      if (t.device().device_type != kDLCPU || !t.IsContiguous() || got != want ||
          (want > 0 && t.data_ptr() == nullptr)) {
        TVM_FFI_THROW(ValueError) << "tvm_spinn.sim plan: argument " << i << " must be a contiguous "
                                  << "host tensor of " << want << " bytes, got " << got;
      }
      base[n_consts + i] = DataPtr<char>(t);
    }
    std::unique_ptr<char, decltype(&std::free)> own(nullptr, &std::free);
    char* arena = nullptr;
    if (arena_ > kKeepArena) {
      own.reset(static_cast<char*>(std::aligned_alloc(kAlign, arena_)));
      if (!own) TVM_FFI_THROW(RuntimeError) << "tvm_spinn.sim plan: out of memory (" << arena_ << " bytes)";
      arena = own.get();
    } else if (arena_ > 0) {
      arena = KeptArena(arena_);
    }
    const size_t first_temp = n_consts + static_cast<size_t>(n_args_);
    for (size_t i = 0; i < offsets_.size(); ++i) base[first_temp + i] = arena + offsets_[i];
    for (const Instr& in : code_) Execute(in, base);
  }

 private:
  /*!
   * \brief The calling thread's temporaries, `bytes` (a multiple of 64) of 64-byte aligned
   *        memory, reused by its next call of any plan (a plan never calls another, and each
   *        thread has its own).
   *
   * A fresh allocation per call cost more than the arithmetic on small models: glibc maps a block
   * of a megabyte anew each time and every page faults again on first touch (~100 us per call of
   * MobileNetV2 at 64x64, against ~650 us of kernels). Arenas above kKeepArena are still
   * allocated per call so that one large model does not pin its peak on every thread.
   */
  static char* KeptArena(size_t bytes) {
    thread_local std::unique_ptr<char, decltype(&std::free)> kept{nullptr, &std::free};
    thread_local size_t size = 0;
    if (size < bytes) {
      kept.reset();
      size = 0;
      kept.reset(static_cast<char*>(std::aligned_alloc(kAlign, bytes)));
      if (!kept) TVM_FFI_THROW(RuntimeError) << "tvm_spinn.sim plan: out of memory (" << bytes << " bytes)";
      size = bytes;
    }
    return kept.get();
  }

  static int64_t CheckBytes(int64_t b) {
    if (b < 0) TVM_FFI_THROW(ValueError) << kFunc << ": negative buffer size " << b;
    return b;
  }

  /*! \brief Slot `s` must exist and hold at least `need` bytes (`kNone` allowed if `optional`). */
  void Need(int64_t s, int64_t need, bool optional = false) const {
    if (optional && s == kNone) return;
    if (s < 0 || s >= static_cast<int64_t>(bytes_.size())) {
      TVM_FFI_THROW(ValueError) << kFunc << ": slot " << s << " does not exist";
    }
    if (need < 0 || bytes_[s] < need) {
      TVM_FFI_THROW(ValueError) << kFunc << ": slot " << s << " holds " << bytes_[s]
                                << " bytes, an instruction needs " << need;
    }
  }

  static void Positive(std::initializer_list<int64_t> values) {
    for (int64_t v : values) {
      if (v < 0) TVM_FFI_THROW(ValueError) << kFunc << ": negative extent " << v;
    }
  }

  /*! \brief An im2col instruction's geometry (fp32 or int8): extents >= 0, the kernel, groups,
   *         strides and dilations >= 1. */
  static void CheckIm2Col(const Instr& in) {
    Positive({in[3], in[5], in[6], in[7], in[10], in[11], in[16], in[17]});
    if (in[4] < 1 || in[8] < 1 || in[9] < 1 || in[12] < 1 || in[13] < 1 || in[14] < 1 || in[15] < 1) {
      TVM_FFI_THROW(ValueError) << kFunc << ": bad im2col geometry";
    }
  }

  /*! \brief The const slot `s` as int64 indices, each in [0, count). */
  void CheckIndex(int64_t s, int64_t batch, int64_t count) const {
    Need(s, batch * 8);
    if (s >= static_cast<int64_t>(consts_.size()) || !SameDType(consts_[s].dtype(), DLDataType{kDLInt, 64, 1})) {
      TVM_FFI_THROW(ValueError) << kFunc << ": batch index slot " << s << " must be an int64 constant";
    }
    const int64_t* idx = reinterpret_cast<const int64_t*>(static_cast<const char*>(consts_[s].data_ptr()) +
                                                          consts_[s].byte_offset());
    for (int64_t i = 0; i < batch; ++i) {
      if (idx[i] < 0 || idx[i] >= count) {
        TVM_FFI_THROW(ValueError) << kFunc << ": batch index " << idx[i] << " out of [0, " << count << ")";
      }
    }
  }

  /*! \brief Bytes spanned by a strided view: elements [off + sum i_d * stride_d]. */
  static void Span(const int64_t* shape, const int64_t* strides, int ndim, int64_t off, int64_t* lo,
                   int64_t* hi) {
    *lo = *hi = off;
    for (int d = 0; d < ndim; ++d) {
      if (shape[d] == 0) {
        *hi = *lo - 1;  // empty
        return;
      }
      const int64_t step = (shape[d] - 1) * strides[d];
      (step < 0 ? *lo : *hi) += step;
    }
  }

  /*! \brief Words of instruction `op` (a valid code) without its ranked arrays. */
  static size_t Fixed(int64_t op) { return static_cast<size_t>(kWords[op]); }

  void Decode(const ffi::Array<int64_t>& code) {
    std::vector<int64_t> words(code.begin(), code.end());
    size_t p = 0;
    auto take = [&](size_t n) {
      if (p + n > words.size()) TVM_FFI_THROW(ValueError) << kFunc << ": truncated instruction";
      Instr in;
      in.w.assign(words.begin() + p, words.begin() + p + n);
      p += n;
      return in;
    };
    // binary and copy: the rank at word `rank_at`, then shape, and two strides, of `rank` words each
    auto take_ranked = [&](int64_t op) {
      if (p + Fixed(op) > words.size()) TVM_FFI_THROW(ValueError) << kFunc << ": truncated instruction";
      const int64_t ndim = words[p + static_cast<size_t>(kRankAt[op])];
      if (ndim < 0 || ndim > kMaxDims) TVM_FFI_THROW(ValueError) << kFunc << ": rank " << ndim;
      Instr in = take(Fixed(op) + static_cast<size_t>(kPerDim[op] * ndim));
      for (int64_t d = 0; d < ndim; ++d) Positive({in.w[7 + d]});
      return std::make_pair(in, static_cast<int>(ndim));
    };
    // slot `s`, read or written through a view (shape, strides in elements, offset), must hold
    // every element the view touches
    auto need_view = [&](int64_t s, const Instr& in, int ndim, int which, int64_t off, int64_t eb) {
      int64_t lo, hi;
      Span(&in.w[7], &in.w[7 + (1 + which) * ndim], ndim, off, &lo, &hi);
      if (hi < lo) return;  // empty
      if (lo < 0) TVM_FFI_THROW(ValueError) << kFunc << ": a view reads before its buffer";
      Need(s, (hi + 1) * eb);
    };
    while (p < words.size()) {
      const int64_t op = words[p];
      if (op < 0 || op >= kNumOps) TVM_FFI_THROW(ValueError) << kFunc << ": unknown instruction " << op;
      Instr in;
      switch (op) {
        case kGemm: {
          in = take(Fixed(op));
          const int64_t a = in[1], b = in[2], c = in[3], batch = in[4], m = in[5], k = in[6], n = in[7];
          if (batch < 1 || m < 1 || k < 1 || n < 1) {
            TVM_FFI_THROW(ValueError) << kFunc << ": GEMM extents must be >= 1";
          }
          Need(a, m * k * 4);
          Need(b, k * n * 4);
          Need(c, batch * m * n * 4);
          CheckIndex(in[8], batch, bytes_[a] / (m * k * 4));
          CheckIndex(in[9], batch, bytes_[b] / (k * n * 4));
          const int64_t rows = in[17], cols = in[18];
          Positive({in[16], rows, cols});
          if (in[16] * rows * cols != batch * m * n) {
            TVM_FFI_THROW(ValueError) << kFunc << ": epilogue view does not cover the GEMM output";
          }
          Need(in[10], (in[11] ? rows : cols) * 4, true);
          break;
        }
        case kIm2col:
        case kIm2col8: {  // fp32 or int8 elements (the int8 one carries its zero point too)
          in = take(Fixed(op));
          CheckIm2Col(in);
          const int64_t e = op == kIm2col ? 4 : 1;
          const int64_t n = in[3], groups = in[4], cg = in[5], h = in[6], w = in[7], kh = in[8],
                        kw = in[9], oh = in[10], ow = in[11];
          Need(in[1], n * groups * cg * h * w * e);
          Need(in[2], n * groups * cg * kh * kw * oh * ow * e);
          break;
        }
        case kDepthwise: {
          in = take(Fixed(op));
          const int64_t n = in[4], groups = in[5], mult = in[6], h = in[7], w = in[8], kh = in[9],
                        kw = in[10], oh = in[11], ow = in[12];
          Positive({n, h, w, oh, ow, in[17], in[18]});
          if (groups < 1 || mult < 1 || kh < 1 || kw < 1 || in[13] < 1 || in[14] < 1 || in[15] < 1 ||
              in[16] < 1) {
            TVM_FFI_THROW(ValueError) << kFunc << ": bad depthwise geometry";
          }
          Need(in[1], n * groups * h * w * 4);
          Need(in[2], groups * mult * kh * kw * 4);
          Need(in[3], n * groups * mult * oh * ow * 4);
          Need(in[19], groups * mult * 4, true);
          break;
        }
        case kSoftmax:
        case kMean: {
          in = take(Fixed(op));
          Positive({in[3], in[4]});
          Need(in[1], in[3] * in[4] * 4);
          Need(in[2], (op == kMean ? in[3] : in[3] * in[4]) * 4);
          break;
        }
        case kLayerNorm: {
          in = take(Fixed(op));
          Positive({in[6], in[7]});
          Need(in[1], in[6] * in[7] * 4);
          Need(in[2], in[7] * 4, true);
          Need(in[3], in[7] * 4, true);
          Need(in[5], in[6] * in[7] * 4);
          break;
        }
        case kRmsNorm: {
          in = take(Fixed(op));
          Positive({in[5], in[6]});
          Need(in[1], in[5] * in[6] * 4);
          Need(in[2], in[6] * 4, true);
          Need(in[4], in[5] * in[6] * 4);
          break;
        }
        case kUnary: {
          in = take(Fixed(op));
          Positive({in[3]});
          if (in[4] < kUnaryRelu || in[4] > kUnarySigmoid) TVM_FFI_THROW(ValueError) << kFunc << ": unary kind " << in[4];
          Need(in[1], in[3] * 4);
          Need(in[2], in[3] * 4);
          break;
        }
        case kBinary: {
          int ndim;
          std::tie(in, ndim) = take_ranked(op);
          if (in[4] < kBinaryAdd || in[4] > kBinaryDivide) TVM_FFI_THROW(ValueError) << kFunc << ": binary kind " << in[4];
          int64_t numel = 1;
          for (int d = 0; d < ndim; ++d) {
            Positive({in.w[7 + ndim + d], in.w[7 + 2 * ndim + d]});  // broadcast strides: >= 0
            numel *= in.w[7 + d];
          }
          Need(in[3], numel * 4);
          need_view(in[1], in, ndim, 0, 0, 4);
          need_view(in[2], in, ndim, 1, 0, 4);
          break;
        }
        case kCopy: {
          int ndim;
          std::tie(in, ndim) = take_ranked(op);
          const int64_t eb = in[3];
          if (eb != 1 && eb != 2 && eb != 4 && eb != 8) TVM_FFI_THROW(ValueError) << kFunc << ": element size " << eb;
          need_view(in[1], in, ndim, 0, in[5], eb);
          need_view(in[2], in, ndim, 1, in[6], eb);
          break;
        }
        case kPool: {
          in = take(Fixed(op));
          const int64_t planes = in[3], h = in[4], w = in[5], oh = in[6], ow = in[7];
          Positive({planes, h, w, oh, ow, in[14], in[15]});
          if (in[8] < 1 || in[9] < 1 || in[10] < 1 || in[11] < 1 || in[12] < 1 || in[13] < 1) {
            TVM_FFI_THROW(ValueError) << kFunc << ": bad pool geometry";
          }
          Need(in[1], planes * h * w * 4);
          Need(in[2], planes * oh * ow * 4);
          break;
        }
        case kGather: {
          in = take(Fixed(op));
          const int64_t eb = in[4], outer = in[5], extent = in[6], inner = in[7], count = in[8];
          if (eb != 1 && eb != 2 && eb != 4 && eb != 8) TVM_FFI_THROW(ValueError) << kFunc << ": element size " << eb;
          Positive({outer, extent, inner, count});
          if (in[9] < 0 || in[9] > 2) TVM_FFI_THROW(ValueError) << kFunc << ": gather mode " << in[9];
          Need(in[1], outer * extent * inner * eb);
          Need(in[2], count * 4);
          Need(in[3], outer * count * inner * eb);
          break;
        }
        case kQgemm: {
          in = take(Fixed(op));
          const int64_t a = in[1], b = in[2], batch = in[5], m = in[6], k = in[7], n = in[8];
          if (batch < 1 || m < 1 || k < 1 || n < 1) {
            TVM_FFI_THROW(ValueError) << kFunc << ": GEMM extents must be >= 1";
          }
          if (in[11] < 1 || in[12] < 2 || in[12] > 32) {
            TVM_FFI_THROW(ValueError) << kFunc << ": bad k-chunk " << in[11] << " or acc_bits " << in[12];
          }
          const int64_t groups = in[19], kind = in[21];
          if (groups < 1 || kind < kQoutF32 || kind > kQoutI32 || in[28] < 0 || in[28] > 1) {
            TVM_FFI_THROW(ValueError) << kFunc << ": bad int8 GEMM epilogue";
          }
          Need(a, m * k);
          Need(b, k * n);
          Need(in[3], batch * m * n * (kind == kQoutF32 || kind == kQoutI32 ? 4 : 1));
          Need(in[4], batch * m * n * 4);
          const int64_t a_count = bytes_[a] / (m * k), b_count = bytes_[b] / (k * n);
          CheckIndex(in[9], batch, a_count);
          CheckIndex(in[10], batch, b_count);
          const int64_t channels = in[20] ? groups * m : n;
          Need(in[14], groups * m * 4, true);
          Need(in[16], n * 4, true);
          Need(in[17], a_count * m * 8, true);
          Need(in[18], b_count * n * 8, true);
          if (kind == kQoutF32) {
            Need(in[22], channels * 4);
            Need(in[23], channels * 4, true);
          } else if (kind != kQoutI32) {
            Need(in[24], channels * 4);
            Need(in[25], channels * 4);
            Need(in[26], channels * 4);
          }
          break;
        }
        case kFlip8: {
          in = take(Fixed(op));
          Positive({in[3]});
          Need(in[1], in[3]);
          Need(in[2], in[3]);
          break;
        }
        case kQuantize:
        case kDequantize: {
          in = take(Fixed(op));
          const int64_t n = in[3], inner = in[4], channels = in[5], kind = in[8];
          Positive({n});
          if (inner < 1 || channels < 1 || kind < kQuantI8 || kind > (op == kQuantize ? kQuantU8 : kQuantI32)) {
            TVM_FFI_THROW(ValueError) << kFunc << ": bad quantize/dequantize geometry";
          }
          const int64_t qb = kind == kQuantI32 ? 4 : 1;
          Need(in[1], n * (op == kQuantize ? 4 : qb));
          Need(in[2], n * (op == kQuantize ? qb : 4));
          Need(in[6], channels * 4);
          Need(in[7], channels * 4);
          break;
        }
        case kFill: {
          in = take(Fixed(op));
          const int64_t eb = in[2];
          if (eb != 1 && eb != 2 && eb != 4 && eb != 8) TVM_FFI_THROW(ValueError) << kFunc << ": element size " << eb;
          Positive({in[3]});
          Need(in[1], in[3] * eb);
          break;
        }
        case kWhereLess: {  // four operands, each read through a broadcast view of the output's shape
          if (p + Fixed(op) > words.size()) TVM_FFI_THROW(ValueError) << kFunc << ": truncated instruction";
          const int64_t rank = words[p + static_cast<size_t>(kRankAt[op])];
          if (rank < 0 || rank > kMaxDims) TVM_FFI_THROW(ValueError) << kFunc << ": rank " << rank;
          const int ndim = static_cast<int>(rank);
          in = take(Fixed(op) + static_cast<size_t>(kPerDim[op]) * static_cast<size_t>(ndim));
          int64_t numel = 1;
          for (int d = 0; d < ndim; ++d) {
            Positive({in.w[7 + d]});
            for (int k = 1; k <= 4; ++k) Positive({in.w[7 + k * ndim + d]});  // broadcast strides: >= 0
            numel *= in.w[7 + d];
          }
          Need(in[5], numel * 4);
          for (int k = 0; k < 4; ++k) need_view(in[1 + k], in, ndim, k, 0, 4);
          break;
        }
        case kRope: {  // x and out contiguous, cos and sin read through broadcast views of x's shape
          int ndim;
          std::tie(in, ndim) = take_ranked(op);
          if (ndim < 1) TVM_FFI_THROW(ValueError) << kFunc << ": rope of rank 0";
          int64_t numel = 1;
          for (int d = 0; d < ndim; ++d) {
            Positive({in.w[7 + d], in.w[7 + ndim + d], in.w[7 + 2 * ndim + d]});  // broadcast strides: >= 0
            numel *= in.w[7 + d];
          }
          if (in[5] < 1 || 2 * in[5] != in.w[7 + ndim - 1]) {
            TVM_FFI_THROW(ValueError) << kFunc << ": rope rows of " << in.w[7 + ndim - 1] << " are not two halves of "
                                      << in[5];
          }
          Need(in[1], numel * 4);
          Need(in[4], numel * 4);
          need_view(in[2], in, ndim, 0, 0, 4);
          need_view(in[3], in, ndim, 1, 0, 4);
          break;
        }
        case kCrossEntropy:
        case kCrossEntropyGrad: {
          in = take(Fixed(op));
          const int64_t rows = in[4], cols = in[5];
          Positive({rows, cols});
          if (rows < 1 || cols < 1) TVM_FFI_THROW(ValueError) << kFunc << ": cross-entropy extents must be >= 1";
          Need(in[1], rows * cols * 4);
          Need(in[2], rows * 4);
          Need(in[3], (op == kCrossEntropy ? rows : rows * cols) * 4);
          break;
        }
        case kPoolGrad: {
          in = take(Fixed(op));
          const PoolGradShape g = Words<PoolGradShape>(in.w, 4);
          Positive({g.planes, g.h, g.w, g.oh, g.ow, g.pt, g.pl});
          if (g.kh < 1 || g.kw < 1 || g.sh < 1 || g.sw < 1) {
            TVM_FFI_THROW(ValueError) << kFunc << ": bad max_pool2d_backward geometry";
          }
          Need(in[1], g.planes * g.oh * g.ow * 4);
          Need(in[2], g.planes * g.h * g.w * 4);
          Need(in[3], g.planes * g.h * g.w * 4);
          break;
        }
        default:
          TVM_FFI_THROW(ValueError) << kFunc << ": unknown instruction " << op;
      }
      code_.push_back(std::move(in));
    }
  }

  static EpilogueF32 Epilogue(const std::vector<char*>& base, int64_t bias, bool on_rows, int64_t relu,
                              int64_t clip, int64_t lo, int64_t hi) {
    EpilogueF32 e;
    e.bias = bias == kNone ? nullptr : reinterpret_cast<const float*>(base[bias]);
    e.bias_on_rows = on_rows;
    e.relu = relu != 0;
    e.clip = clip != 0;
    e.lo = BitsToFloat(lo);
    e.hi = BitsToFloat(hi);
    return e;
  }

  static void RunUnary(const float* x, float* out, int64_t n, int64_t kind, float lo, float hi, bool relu) {
    switch (kind) {
      case kUnaryRelu:
        for (int64_t i = 0; i < n; ++i) out[i] = (x[i] > 0.0f || x[i] != x[i]) ? x[i] : 0.0f;
        break;
      case kUnaryClip:  // TVM's max(min(x, hi), lo) as compare-and-select, NaN kept: clip(NaN) = NaN
        for (int64_t i = 0; i < n; ++i) {
          const float y = (x[i] < hi || x[i] != x[i]) ? x[i] : hi;
          out[i] = (y > lo || y != y) ? y : lo;
        }
        break;
      case kUnaryNegative:
        for (int64_t i = 0; i < n; ++i) out[i] = -x[i];
        break;
      case kUnarySqrt:  // VSQRT of a negative number: the M4F's default NaN (x86's is 0xFFC00000)
        for (int64_t i = 0; i < n; ++i) out[i] = x[i] < 0.0f ? M4fDefaultNaN() : std::sqrt(x[i]);
        break;
      case kUnaryRsqrt:
        for (int64_t i = 0; i < n; ++i) out[i] = 1.0f / (x[i] < 0.0f ? M4fDefaultNaN() : std::sqrt(x[i]));
        break;
      case kUnarySquare:
        for (int64_t i = 0; i < n; ++i) out[i] = x[i] * x[i];
        break;
      case kUnaryCube:
        for (int64_t i = 0; i < n; ++i) {
          const float s = x[i] * x[i];
          out[i] = s * x[i];
        }
        break;
      case kUnaryTanh:
        TanhF32(x, out, n);
        break;
      case kUnaryGelu:
        ActivationF32(x, out, n, Activation::kGelu);
        break;
      case kUnaryGeluTanh:
        ActivationF32(x, out, n, Activation::kGeluTanh);
        break;
      default:
        ActivationF32(x, out, n, Activation::kSigmoid);
        break;
    }
    if (relu) {
      for (int64_t i = 0; i < n; ++i) out[i] = (out[i] > 0.0f || out[i] != out[i]) ? out[i] : 0.0f;
    }
  }

  /*!
   * \brief The M4F's NaN rule for a binary result (FPSCR.DN = 0, FPProcessNaNs in the v7-M
   *        ARM): a signalling NaN operand first (the first operand's if both are), else a quiet
   *        one (the first operand's if both are), returned quieted; an invalid operation on
   *        numbers (inf - inf, 0 * inf, 0 / 0) gives the default NaN 0x7FC00000. The host computes `r` with
   *        either operand order (the compiler may commute), so the order is restored here.
   */
  static bool Signalling(float v) {
    if (v == v) return false;
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return (u & 0x00400000u) == 0;
  }

  static float FirstNaN(float r, float x, float y) {
    if (r == r) return r;
    if (x == x && y == y) {  // an invalid operation: the M4F's default NaN (x86 gives -NaN)
      const uint32_t d = 0x7FC00000u;
      float q;
      std::memcpy(&q, &d, sizeof q);
      return q;
    }
    const float nan = Signalling(x) ? x : Signalling(y) ? y : x != x ? x : y;
    uint32_t u;
    std::memcpy(&u, &nan, sizeof u);
    u |= 0x00400000u;
    float q;
    std::memcpy(&q, &u, sizeof q);
    return x != x || y != y ? q : r;
  }

  template <typename F>
  static void Broadcast(const float* a, const float* b, float* out, const int64_t* shape,
                        const int64_t* sa, const int64_t* sb, int ndim, bool relu, F f) {
    int64_t numel = 1;
    for (int d = 0; d < ndim; ++d) numel *= shape[d];
    if (numel == 0) return;
    if (ndim == 0) {
      out[0] = f(a[0], b[0]);
      if (relu) out[0] = (out[0] > 0.0f || out[0] != out[0]) ? out[0] : 0.0f;
      return;
    }
    // the innermost axis as a loop, the outer ones as a counter
    const int64_t inner = shape[ndim - 1], ia = sa[ndim - 1], ib = sb[ndim - 1];
    int64_t idx[kMaxDims] = {0};
    int64_t oa = 0, ob = 0;
    for (int64_t row = 0, rows = numel / inner; row < rows; ++row) {
      float* o = out + row * inner;
      const float* pa = a + oa;
      const float* pb = b + ob;
      if (ia == 1 && ib == 1) {
        for (int64_t i = 0; i < inner; ++i) o[i] = f(pa[i], pb[i]);
      } else if (ia == 1 && ib == 0) {
        const float y = pb[0];
        for (int64_t i = 0; i < inner; ++i) o[i] = f(pa[i], y);
      } else if (ia == 0 && ib == 1) {
        const float x = pa[0];
        for (int64_t i = 0; i < inner; ++i) o[i] = f(x, pb[i]);
      } else {
        for (int64_t i = 0; i < inner; ++i) o[i] = f(pa[i * ia], pb[i * ib]);
      }
      if (relu) {
        for (int64_t i = 0; i < inner; ++i) o[i] = (o[i] > 0.0f || o[i] != o[i]) ? o[i] : 0.0f;
      }
      for (int d = ndim - 2; d >= 0; --d) {  // advance the outer counter
        ++idx[d];
        oa += sa[d];
        ob += sb[d];
        if (idx[d] < shape[d]) break;
        oa -= sa[d] * shape[d];
        ob -= sb[d] * shape[d];
        idx[d] = 0;
      }
    }
  }

  /*!
   * \brief 2-D pooling as the pool family computes it: taps in row-major window order over the
   *        padded plane (padding reads the lowest float32 for max, +0.0 for average); max keeps
   *        `acc > v ? acc : v` from the lowest float32, the first NaN of the window kept; average sums from the first tap, then
   *        divides by the window size or the count of taps inside the input.
   */
  static void Pool(const float* x, float* out, const Instr& in) {
    const int64_t planes = in[3], h = in[4], w = in[5], oh = in[6], ow = in[7], kh = in[8],
                  kw = in[9], sh = in[10], sw = in[11], dh = in[12], dw = in[13], pt = in[14],
                  pl = in[15];
    const bool is_max = in[16] != 0, include_pad = in[17] != 0;
    const float lowest = -3.4028234663852886e38f;
    const float fill = is_max ? lowest : 0.0f;
    for (int64_t p = 0; p < planes; ++p) {
      const float* xp = x + p * h * w;
      float* op = out + p * oh * ow;
      for (int64_t oy = 0; oy < oh; ++oy) {
        for (int64_t ox = 0; ox < ow; ++ox) {
          float acc = lowest;
          int64_t count = 0;
          for (int64_t i = 0; i < kh; ++i) {
            const int64_t r = oy * sh + i * dh - pt;
            for (int64_t j = 0; j < kw; ++j) {
              const int64_t c = ox * sw + j * dw - pl;
              const bool inside = r >= 0 && r < h && c >= 0 && c < w;
              const float v = inside ? xp[r * w + c] : fill;
              count += inside;
              if (is_max) {
                acc = (acc > v || acc != acc) ? acc : v;
              } else {
                acc = (i == 0 && j == 0) ? v : FirstNaN(acc + v, acc, v);
              }
            }
          }
          if (!is_max) acc = acc / static_cast<float>(include_pad ? kh * kw : count);
          op[oy * ow + ox] = acc;
        }
      }
    }
  }

  /*!
   * \brief take(table, indices, axis): out[o, i, r] = table[o, idx(i), r] for table [outer,
   *        extent, inner]; idx clamped (clip), taken modulo the extent (wrap) or required in
   *        range (fast: an IndexError naming the layer's index, as the Python path names it).
   */
  static void Gather(const char* table, const int32_t* idx, char* out, const Instr& in) {
    const int64_t eb = in[4], outer = in[5], extent = in[6], inner = in[7], count = in[8], mode = in[9];
    const size_t row = static_cast<size_t>(inner * eb);
    for (int64_t i = 0; i < count; ++i) {
      int64_t k = idx[i];
      if (mode == 1) {
        k = std::min<int64_t>(std::max<int64_t>(k, 0), extent - 1);
      } else if (mode == 2) {
        k = ((k % extent) + extent) % extent;
      } else if (k < 0 || k >= extent) {
        TVM_FFI_THROW(IndexError) << "tvm_spinn.sim plan: layer " << in[10] << ": take index " << k
                                  << " is out of range for axis " << in[11] << " of extent " << extent;
      }
    }
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t i = 0; i < count; ++i) {
        int64_t k = idx[i];
        if (mode == 1) k = std::min<int64_t>(std::max<int64_t>(k, 0), extent - 1);
        if (mode == 2) k = ((k % extent) + extent) % extent;
        std::memcpy(out + (o * count + i) * row, table + (o * extent + k) * row, row);
      }
    }
  }

  /*! \brief n elements of the value whose bits are the low bytes of `bits` (a float's bits as
   *         they are: -0.0 stays -0.0). */
  template <typename T>
  static void FillTyped(char* dst, int64_t n, int64_t bits) {
    const T v = static_cast<T>(static_cast<uint64_t>(bits));
    std::fill(reinterpret_cast<T*>(dst), reinterpret_cast<T*>(dst) + n, v);
  }

  /*!
   * \brief out = a < b ? c : d element by element over `shape`, each operand read through its
   *        element strides (0 on broadcast axes): one VCMP.F32 and a conditional move, the
   *        selected operand's bits copied (NaN payloads and -0.0 kept); a NaN a or b compares
   *        false and selects d. `strides` holds the four operands' strides, ndim each.
   */
  static void WhereLess(const float* a, const float* b, const uint32_t* c, const uint32_t* d, uint32_t* out,
                        int ndim, const int64_t* shape_in, const int64_t* strides) {
    // axes merged where every operand steps over them as over one (row-major runs, broadcasts)
    int64_t shape[kMaxDims], st[4][kMaxDims];
    int n = 0;
    for (int k = 0; k < ndim; ++k) {
      if (shape_in[k] == 1) continue;
      bool merge = n > 0;
      for (int q = 0; q < 4 && merge; ++q) merge = st[q][n - 1] == strides[q * ndim + k] * shape_in[k];
      if (merge) {
        shape[n - 1] *= shape_in[k];
        for (int q = 0; q < 4; ++q) st[q][n - 1] = strides[q * ndim + k];
        continue;
      }
      shape[n] = shape_in[k];
      for (int q = 0; q < 4; ++q) st[q][n] = strides[q * ndim + k];
      ++n;
    }
    int64_t numel = 1;
    for (int k = 0; k < n; ++k) numel *= shape[k];
    if (numel == 0) return;
    if (n == 0) {  // one element
      out[0] = a[0] < b[0] ? c[0] : d[0];
      return;
    }
    const int last = n - 1;
    const int64_t inner = shape[last];
    bool unit = true;  // the innermost axis steps by 1 or 0 (a broadcast) in every operand
    int pattern = 0;
    for (int q = 0; q < 4; ++q) {
      unit &= st[q][last] == 0 || st[q][last] == 1;
      pattern |= (st[q][last] == 1) << q;
    }
    int64_t idx[kMaxDims] = {0};
    int64_t off[4] = {0, 0, 0, 0};
    for (int64_t row = 0, rows = numel / inner; row < rows; ++row) {
      uint32_t* o = out + row * inner;
      if (unit) {
        kWhereRows[pattern](a + off[0], b + off[1], c + off[2], d + off[3], o, inner);
      } else {
        for (int64_t i = 0; i < inner; ++i) {
          o[i] = a[off[0] + i * st[0][last]] < b[off[1] + i * st[1][last]] ? c[off[2] + i * st[2][last]]
                                                                             : d[off[3] + i * st[3][last]];
        }
      }
      for (int k = last - 1; k >= 0; --k) {  // advance the outer counter
        ++idx[k];
        for (int q = 0; q < 4; ++q) off[q] += st[q][k];
        if (idx[k] < shape[k]) break;
        for (int q = 0; q < 4; ++q) off[q] -= st[q][k] * shape[k];
        idx[k] = 0;
      }
    }
  }

  /*!
   * \brief Rotary embedding over rows of `2 half` elements: per element `r = j < half ? -x[e + half]
   *        : x[e - half]` (the sign bit flipped), then `x * cos`, `r * sin` and their sum, each
   *        rounded once in that order with the M4F's NaN rule (the imported graph's multiply,
   *        multiply, add). `x` and `out` are contiguous of `shape`; `cos` and `sin` are read
   *        through their strides (0 on broadcast axes), `ndim` each after the shape.
   */
  static void Rope(const float* x, const float* c, const float* s, float* out, int64_t half, int ndim,
                   const int64_t* shape) {
    const int64_t* sc = shape + ndim;
    const int64_t* ss = sc + ndim;
    const int64_t d = 2 * half, stc = sc[ndim - 1], sts = ss[ndim - 1];
    int64_t numel = 1;
    for (int k = 0; k < ndim; ++k) numel *= shape[k];
    int64_t idx[kMaxDims] = {0};
    int64_t oc = 0, os = 0;
    for (int64_t e = 0; e < numel; e += d) {
      const float* xr = x + e;
      for (int64_t j = 0; j < d; ++j) {
        const float xv = xr[j];
        const float r = j < half ? -xr[j + half] : xr[j - half];
        const float cv = c[oc + j * stc], sv = s[os + j * sts];
        const float p = FirstNaN(xv * cv, xv, cv);
        const float q = FirstNaN(r * sv, r, sv);
        out[e + j] = FirstNaN(p + q, p, q);
      }
      for (int k = ndim - 2; k >= 0; --k) {  // advance the rows' counter
        ++idx[k];
        oc += sc[k];
        os += ss[k];
        if (idx[k] < shape[k]) break;
        oc -= sc[k] * shape[k];
        os -= ss[k] * shape[k];
        idx[k] = 0;
      }
    }
  }

  template <typename T>
  static void CopyTyped(const char* src, char* dst, int ndim, const int64_t* shape, int64_t so,
                        const int64_t* ss, int64_t dof, const int64_t* ds) {
    const T* s = reinterpret_cast<const T*>(src) + so;
    T* d = reinterpret_cast<T*>(dst) + dof;
    int64_t numel = 1;
    for (int i = 0; i < ndim; ++i) numel *= shape[i];
    if (numel == 0) return;
    if (ndim == 0) {
      d[0] = s[0];
      return;
    }
    const int64_t inner = shape[ndim - 1], is = ss[ndim - 1], id = ds[ndim - 1];
    int64_t idx[kMaxDims] = {0};
    int64_t os = 0, od = 0;
    for (int64_t row = 0, rows = numel / inner; row < rows; ++row) {
      if (is == 1 && id == 1) {
        std::memcpy(d + od, s + os, static_cast<size_t>(inner) * sizeof(T));
      } else {
        for (int64_t i = 0; i < inner; ++i) d[od + i * id] = s[os + i * is];
      }
      for (int k = ndim - 2; k >= 0; --k) {
        ++idx[k];
        os += ss[k];
        od += ds[k];
        if (idx[k] < shape[k]) break;
        os -= ss[k] * shape[k];
        od -= ds[k] * shape[k];
        idx[k] = 0;
      }
    }
  }

  /*!
   * \brief An int8 GEMM layer as program/ops/gemm.py's _qgemm_whole computes it: the MAC
   *        array's chunked acc_bits sums (GemmI8Batched), then per output the M4F's zero-point
   *        terms `- zb sum_k a - za sum_k b + K za zb` wrapped to 32 bits, then the epilogue:
   *        dequantize `fl(acc) * scale [+ bias]` (VMUL, VADD: the M4F's NaNs), ReLU as numpy's maximum(y, 0) (NaN kept, -0 ->
   *        +0), the 32-bit sums themselves (an int32 output), or requantize (quant.py's requantize / requantize_tflite) into int8 / uint8.
   *        Channel c of the per-channel vectors is the column, or with on_rows the row's
   *        channel (b % groups) * m + r (conv2d). Sums over k come from int64 constants when
   *        given, else from the operands.
   */
  /*! \brief A GEMM instruction's batch, m, k, n at word `at` and its operands' batch index slots
   *         after them (fp32 and int8 GEMMs alike). */
  static BatchedGemm GemmGeometry(const Instr& in, size_t at, const std::vector<char*>& base) {
    BatchedGemm s;
    s.batch = in[at];
    s.m = in[at + 1];
    s.k = in[at + 2];
    s.n = in[at + 3];
    s.a_index = reinterpret_cast<const int64_t*>(base[in[at + 4]]);
    s.b_index = reinterpret_cast<const int64_t*>(base[in[at + 5]]);
    return s;
  }

  static void QGemm(const Instr& in, const std::vector<char*>& base) {
    const auto slot = [&](int64_t s) { return s == kNone ? nullptr : base[s]; };
    const int8_t* a = reinterpret_cast<const int8_t*>(base[in[1]]);
    const int8_t* b = reinterpret_cast<const int8_t*>(base[in[2]]);
    int32_t* acc = reinterpret_cast<int32_t*>(base[in[4]]);
    BatchedGemm s = GemmGeometry(in, 5, base);
    const int64_t batch = s.batch, m = s.m, k = s.k, n = s.n;
    std::memset(acc, 0, static_cast<size_t>(batch * m * n) * 4);
    GemmI8Batched(a, b, acc, s, in[11], static_cast<int>(in[12]), SimThreads(batch * m * n * k));
    const int64_t za = in[13], zb = in[15], groups = in[19];
    const int32_t* za_vec = reinterpret_cast<const int32_t*>(slot(in[14]));
    const int32_t* zb_vec = reinterpret_cast<const int32_t*>(slot(in[16]));
    const int64_t* a_sum_c = reinterpret_cast<const int64_t*>(slot(in[17]));
    const int64_t* b_sum_c = reinterpret_cast<const int64_t*>(slot(in[18]));
    const bool on_rows = in[20] != 0, relu = in[27] != 0, tflite = in[28] != 0;
    const int64_t kind = in[21], y_zero = in[29], y_min = in[30], y_max = in[31];
    const float* scale = reinterpret_cast<const float*>(slot(in[22]));
    const float* bias = reinterpret_cast<const float*>(slot(in[23]));
    const int32_t* bias_q = reinterpret_cast<const int32_t*>(slot(in[24]));
    const int32_t* mult = reinterpret_cast<const int32_t*>(slot(in[25]));
    const int32_t* shift = reinterpret_cast<const int32_t*>(slot(in[26]));
    bool any_zb = zb != 0, any_za = za != 0;
    for (int64_t c = 0; zb_vec && c < n; ++c) any_zb |= zb_vec[c] != 0;
    for (int64_t c = 0; za_vec && c < groups * m; ++c) any_za |= za_vec[c] != 0;
    std::vector<int64_t> a_sum(any_zb ? m : 0), b_sum(any_za ? n : 0);
    float* out_f = reinterpret_cast<float*>(base[in[3]]);
    int8_t* out_q = reinterpret_cast<int8_t*>(base[in[3]]);
    int32_t* out_i = reinterpret_cast<int32_t*>(base[in[3]]);
    for (int64_t bi = 0; bi < batch; ++bi) {
      const int64_t ia = s.a_index[bi], ib = s.b_index[bi];
      if (any_zb) {
        for (int64_t r = 0; r < m; ++r) {
          if (a_sum_c) {
            a_sum[r] = a_sum_c[ia * m + r];
            continue;
          }
          const int8_t* row = a + (ia * m + r) * k;
          int64_t t = 0;
          for (int64_t j = 0; j < k; ++j) t += row[j];
          a_sum[r] = t;
        }
      }
      if (any_za) {
        if (b_sum_c) {
          for (int64_t c = 0; c < n; ++c) b_sum[c] = b_sum_c[ib * n + c];
        } else {
          std::fill(b_sum.begin(), b_sum.end(), 0);
          const int8_t* bm = b + ib * k * n;
          for (int64_t j = 0; j < k; ++j) {
            for (int64_t c = 0; c < n; ++c) b_sum[c] += bm[j * n + c];
          }
        }
      }
      for (int64_t r = 0; r < m; ++r) {
        const int64_t row_ch = (bi % groups) * m + r;
        const int64_t zar = za_vec ? za_vec[row_ch] : za;
        const int64_t o = (bi * m + r) * n;
        for (int64_t c = 0; c < n; ++c) {
          const int64_t zbc = zb_vec ? zb_vec[c] : zb;
          int64_t v = acc[o + c];
          if (zbc != 0) v -= zbc * a_sum[r];
          if (zar != 0) v -= zar * b_sum[c];
          v += k * zar * zbc;
          v = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(v)));  // 32-bit registers
          if (kind == kQoutI32) {  // the raw 32-bit sums: no epilogue
            out_i[o + c] = static_cast<int32_t>(v);
            continue;
          }
          const int64_t ch = on_rows ? row_ch : c;
          if (kind == kQoutF32) {
            const float f = static_cast<float>(v);
            float y = f * scale[ch];
            if (y != y) y = M4fNaNOf(f, scale[ch]);  // VMUL's NaN: 0 * inf, a NaN scale
            if (bias) {
              const float s = bias[ch] + y;
              y = s == s ? s : M4fNaNOf(bias[ch], y);  // the PE code's VADD(bias, y): inf - inf, NaNs
            }
            if (relu) y = (y > 0.0f || y != y) ? y : 0.0f;
            out_f[o + c] = y;
            continue;
          }
          const int64_t q = (tflite ? RequantTflite : RequantHalfUp)(v + bias_q[ch], mult[ch], shift[ch]) + y_zero;
          const int64_t y = std::min(std::max(q, y_min), y_max);
          out_q[o + c] = static_cast<int8_t>(static_cast<uint8_t>(y));
        }
      }
    }
  }

  /*! \brief quant.py's requantize without the clamp: (v * m0 + 2**(shift-1)) >> shift, int64 wrapping. */
  static int64_t RequantHalfUp(int64_t v, int64_t m0, int64_t shift) {
    const uint64_t prod = static_cast<uint64_t>(v) * static_cast<uint64_t>(m0);
    const int64_t sum = static_cast<int64_t>(prod + (uint64_t{1} << (shift - 1)));
    return sum >> shift;  // arithmetic shift (as numpy's >> on int64)
  }

  /*! \brief quant.py's requantize_tflite without the clamp (TFLite's MultiplyByQuantizedMultiplier). */
  static int64_t RequantTflite(int64_t v, int64_t m0, int64_t shift) {
    const int64_t exp = 31 - shift;
    const int64_t left = exp > 0 ? exp : 0, right = exp < 0 ? -exp : 0;
    const int64_t x = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(v) << left));
    const int64_t ab = x * m0;
    const int64_t t = ab + (ab >= 0 ? (int64_t{1} << 30) : (1 - (int64_t{1} << 30)));
    const int64_t high = t >= 0 ? (t >> 31) : -((-t) >> 31);
    const int64_t mask = (int64_t{1} << right) - 1;
    const int64_t threshold = (mask >> 1) + (high < 0 ? 1 : 0);
    return (high >> right) + ((high & mask) > threshold ? 1 : 0);
  }

  /*!
   * \brief program/ops/qdq.py's quantize: clamp(rint(fl(x / s)) + fl(z), lo, hi) in fp32 (round
   *        half to even), a NaN giving 0 (VCVT's conversion of NaN); dequantize: fl(q - z) * s
   *        with q - z in 32-bit (wrapping) arithmetic. Channel (i / inner) % channels.
   */
  static void QuantizeRun(const Instr& in, const std::vector<char*>& base) {
    const float* x = reinterpret_cast<const float*>(base[in[1]]);
    const int64_t n = in[3], inner = in[4], channels = in[5], kind = in[8];
    const float* scale = reinterpret_cast<const float*>(base[in[6]]);
    const int32_t* zero = reinterpret_cast<const int32_t*>(base[in[7]]);
    const float lo = kind == kQuantU8 ? 0.0f : -128.0f, hi = kind == kQuantU8 ? 255.0f : 127.0f;
    uint8_t* out = reinterpret_cast<uint8_t*>(base[in[2]]);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = channels == 1 ? 0 : (i / inner) % channels;
      float q = std::nearbyint(x[i] / scale[c]) + static_cast<float>(zero[c]);
      q = q != q ? 0.0f : (q < lo ? lo : (q > hi ? hi : q));
      const int v = static_cast<int>(q);
      out[i] = static_cast<uint8_t>(v);
    }
  }

  static void DequantizeRun(const Instr& in, const std::vector<char*>& base) {
    const int64_t n = in[3], inner = in[4], channels = in[5], kind = in[8];
    const float* scale = reinterpret_cast<const float*>(base[in[6]]);
    const int32_t* zero = reinterpret_cast<const int32_t*>(base[in[7]]);
    float* out = reinterpret_cast<float*>(base[in[2]]);
    const char* x = base[in[1]];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = channels == 1 ? 0 : (i / inner) % channels;
      uint32_t q;
      if (kind == kQuantI8) {
        q = static_cast<uint32_t>(static_cast<int32_t>(reinterpret_cast<const int8_t*>(x)[i]));
      } else if (kind == kQuantU8) {
        q = reinterpret_cast<const uint8_t*>(x)[i];
      } else {
        q = static_cast<uint32_t>(reinterpret_cast<const int32_t*>(x)[i]);
      }
      const int32_t d = static_cast<int32_t>(q - static_cast<uint32_t>(zero[c]));
      out[i] = static_cast<float>(d) * scale[c];
    }
  }

  void Execute(const Instr& in, const std::vector<char*>& base) const {
    auto f32 = [&](int64_t s) { return reinterpret_cast<float*>(base[s]); };
    switch (in[0]) {
      case kGemm: {
        BatchedGemm s = GemmGeometry(in, 4, base);
        float* c = f32(in[3]);
        const int64_t count = s.batch * s.m * s.n;
        s.zero_c = true;
        const bool has_epilogue = in[10] != kNone || in[12] || in[13];
        const EpilogueF32 e = Epilogue(base, in[10], in[11] != 0, in[12], in[13], in[14], in[15]);
        // in the GEMM's stores when its [outer, rows, cols] view is the GEMM's [batch, m, n]
        // (a bias then indexed by the GEMM's row or column); else a pass of its own after
        const bool fused = has_epilogue && in[16] == s.batch && in[17] == s.m && in[18] == s.n;
        if (fused) s.epilogue = &e;
        GemmF32Batched(f32(in[1]), f32(in[2]), c, s, SimThreads(count * s.k));
        if (has_epilogue && !fused) ApplyEpilogueF32(c, in[16], in[17], in[18], e, SimThreads(count * 4));
        break;
      }
      case kIm2col: {
        const Im2ColShape s = Words<Im2ColShape>(in.w, 3);
        const float zero = 0.0f;
        const int64_t count = s.n * s.groups * s.cg * s.kh * s.kw * s.oh * s.ow;
        Im2Col(base[in[1]], base[in[2]], s, 4, &zero, SimThreads(count / 8));
        break;
      }
      case kDepthwise: {
        const DepthwiseShape s = Words<DepthwiseShape>(in.w, 4);
        float* out = f32(in[3]);
        const int64_t count = s.n * s.groups * s.mult * s.oh * s.ow;
        const EpilogueF32 e = Epilogue(base, in[19], true, in[20], in[21], in[22], in[23]);
        DepthwiseConvF32(f32(in[1]), f32(in[2]), out, s, e, SimThreads(count * s.kh * s.kw), /*zero_out=*/true);
        break;
      }
      case kSoftmax:
        SoftmaxRowsF32(f32(in[1]), f32(in[2]), in[3], in[4], SimThreads(in[3] * in[4] * 8));
        break;
      case kMean: {
        float* out = f32(in[2]);
        RowSumF32(f32(in[1]), out, in[3], in[4]);
        const float d = static_cast<float>(in[4]);
        for (int64_t r = 0; r < in[3]; ++r) out[r] = out[r] / d;
        break;
      }
      case kLayerNorm:
        LayerNormRowsF32(f32(in[1]), in[2] == kNone ? nullptr : f32(in[2]),
                         in[3] == kNone ? nullptr : f32(in[3]), BitsToFloat(in[4]), f32(in[5]), in[6],
                         in[7], SimThreads(in[6] * in[7] * 8));
        break;
      case kRmsNorm:
        RmsNormRowsF32(f32(in[1]), in[2] == kNone ? nullptr : f32(in[2]), BitsToFloat(in[3]), f32(in[4]),
                       in[5], in[6], SimThreads(in[5] * in[6] * 4));
        break;
      case kUnary:
        RunUnary(f32(in[1]), f32(in[2]), in[3], in[4], BitsToFloat(in[5]), BitsToFloat(in[6]), in[7] != 0);
        break;
      case kBinary: {
        const int ndim = static_cast<int>(in[6]);
        const int64_t* shape = &in.w[7];
        const int64_t* sa = shape + ndim;
        const int64_t* sb = sa + ndim;
        const bool relu = in[5] != 0;
        const float* a = f32(in[1]);
        const float* b = f32(in[2]);
        float* o = f32(in[3]);
        switch (in[4]) {
          case kBinaryAdd:
            Broadcast(a, b, o, shape, sa, sb, ndim, relu, [](float x, float y) { return FirstNaN(x + y, x, y); });
            break;
          case kBinarySubtract:
            Broadcast(a, b, o, shape, sa, sb, ndim, relu, [](float x, float y) { return FirstNaN(x - y, x, y); });
            break;
          case kBinaryMultiply:
            Broadcast(a, b, o, shape, sa, sb, ndim, relu, [](float x, float y) { return FirstNaN(x * y, x, y); });
            break;
          default:
            Broadcast(a, b, o, shape, sa, sb, ndim, relu, [](float x, float y) { return FirstNaN(x / y, x, y); });
            break;
        }
        break;
      }
      case kCopy: {
        const int ndim = static_cast<int>(in[4]);
        const int64_t* shape = &in.w[7];
        const int64_t* ss = shape + ndim;
        const int64_t* ds = ss + ndim;
        switch (in[3]) {
          case 1:
            CopyTyped<uint8_t>(base[in[1]], base[in[2]], ndim, shape, in[5], ss, in[6], ds);
            break;
          case 2:
            CopyTyped<uint16_t>(base[in[1]], base[in[2]], ndim, shape, in[5], ss, in[6], ds);
            break;
          case 4:
            CopyTyped<uint32_t>(base[in[1]], base[in[2]], ndim, shape, in[5], ss, in[6], ds);
            break;
          default:
            CopyTyped<uint64_t>(base[in[1]], base[in[2]], ndim, shape, in[5], ss, in[6], ds);
            break;
        }
        break;
      }
      case kPool:
        Pool(f32(in[1]), f32(in[2]), in);
        break;
      case kGather:
        Gather(base[in[1]], reinterpret_cast<const int32_t*>(base[in[2]]), base[in[3]], in);
        break;
      case kQgemm:
        QGemm(in, base);
        break;
      case kFlip8: {
        const uint8_t* src = reinterpret_cast<const uint8_t*>(base[in[1]]);
        uint8_t* dst = reinterpret_cast<uint8_t*>(base[in[2]]);
        for (int64_t i = 0; i < in[3]; ++i) dst[i] = src[i] ^ 0x80u;
        break;
      }
      case kQuantize:
        QuantizeRun(in, base);
        break;
      case kDequantize:
        DequantizeRun(in, base);
        break;
      case kIm2col8: {
        const Im2ColShape s = Words<Im2ColShape>(in.w, 3);
        const uint8_t fill = static_cast<uint8_t>(in[18]);
        const int64_t count = s.n * s.groups * s.cg * s.kh * s.kw * s.oh * s.ow;
        Im2Col(base[in[1]], base[in[2]], s, 1, &fill, SimThreads(count / 8));
        break;
      }
      case kFill:
        switch (in[2]) {
          case 1:
            FillTyped<uint8_t>(base[in[1]], in[3], in[4]);
            break;
          case 2:
            FillTyped<uint16_t>(base[in[1]], in[3], in[4]);
            break;
          case 4:
            FillTyped<uint32_t>(base[in[1]], in[3], in[4]);
            break;
          default:
            FillTyped<uint64_t>(base[in[1]], in[3], in[4]);
            break;
        }
        break;
      case kWhereLess: {
        const int ndim = static_cast<int>(in[6]);
        const int64_t* shape = &in.w[7];
        WhereLess(f32(in[1]), f32(in[2]), reinterpret_cast<const uint32_t*>(base[in[3]]),
                  reinterpret_cast<const uint32_t*>(base[in[4]]), reinterpret_cast<uint32_t*>(base[in[5]]),
                  ndim, shape, shape + ndim);
        break;
      }
      case kRope:
        Rope(f32(in[1]), f32(in[2]), f32(in[3]), f32(in[4]), in[5], static_cast<int>(in[6]), &in.w[7]);
        break;
      case kCrossEntropy:
      case kCrossEntropyGrad: {
        const int64_t rows = in[4], cols = in[5];
        const int32_t* labels = reinterpret_cast<const int32_t*>(base[in[2]]);
        const bool forward = in[0] == kCrossEntropy;
        for (int64_t r = 0; r < rows; ++r) {  // a label outside the row would read past it
          if (forward && labels[r] == in[6]) continue;
          if (labels[r] < 0 || labels[r] >= cols) {
            TVM_FFI_THROW(ValueError) << "tvm_spinn.sim.cross_entropy" << (forward ? "" : "_grad")
                                      << ": label " << labels[r] << " of row " << r << " is out of range for "
                                      << cols << " classes";
          }
        }
        if (forward) {
          CrossEntropyRowsF32(f32(in[1]), labels, f32(in[3]), rows, cols, in[6], SimThreads(rows * cols * 8));
        } else {
          CrossEntropyGradRowsF32(f32(in[1]), labels, f32(in[3]), rows, cols, BitsToFloat(in[6]),
                                  SimThreads(rows * cols * 8));
        }
        break;
      }
      case kPoolGrad: {
        const PoolGradShape g = Words<PoolGradShape>(in.w, 4);
        MaxPool2dBackwardF32(f32(in[1]), f32(in[2]), f32(in[3]), g,
                             SimThreads(g.planes * (g.oh * g.ow * g.kh * g.kw + g.h * g.w * 4)));
        break;
      }
      default:
        break;  // unreachable: Decode rejected it
    }
  }

  std::vector<ffi::Tensor> consts_;
  int64_t n_args_ = 0;
  std::vector<int64_t> bytes_;    // per slot: constants, arguments, temporaries
  std::vector<size_t> offsets_;   // per temporary: its offset in the arena
  size_t arena_ = 0;
  std::vector<Instr> code_;
};

ffi::Map<ffi::String, int64_t> PlanOps() {
  ffi::Map<ffi::String, int64_t> out;
  for (int op = 0; op < kNumOps; ++op) out.Set(kNames[op], op);
  const std::pair<const char*, int64_t> kinds[] = {
      {"unary.relu", kUnaryRelu},   {"unary.clip", kUnaryClip}, {"unary.negative", kUnaryNegative},
      {"unary.sqrt", kUnarySqrt},   {"unary.rsqrt", kUnaryRsqrt}, {"unary.square", kUnarySquare},
      {"unary.cube", kUnaryCube},   {"unary.tanh", kUnaryTanh}, {"unary.gelu", kUnaryGelu},
      {"unary.gelu_tanh", kUnaryGeluTanh}, {"unary.sigmoid", kUnarySigmoid},
      {"binary.add", kBinaryAdd},    {"binary.subtract", kBinarySubtract}, {"binary.multiply", kBinaryMultiply},
      {"binary.divide", kBinaryDivide}, {"max_dims", kMaxDims}, {"none", kNone},
  };
  for (const auto& kv : kinds) out.Set(kv.first, kv.second);
  return out;
}

}  // namespace

/*!
 * \brief A plan over `consts` (captured), `arg_bytes.size()` call arguments and temporaries of
 *        `temp_bytes`; returns the function running it: f(*args).
 */
ffi::Function PlanCreate(ffi::Array<int64_t> code, ffi::Array<ffi::Tensor> consts,
                         ffi::Array<int64_t> arg_bytes, ffi::Array<int64_t> temp_bytes) {
  auto plan = std::make_shared<const Plan>(code, consts, arg_bytes, temp_bytes);
  return ffi::Function::FromPacked([plan](ffi::PackedArgs args, ffi::Any* rv) { plan->Run(args); });
}

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_spinn.sim.plan_create", PlanCreate,
           "A run of layers as one instruction list: (code, consts, arg_bytes, temp_bytes) -> f(*args).")
      .def("tvm_spinn.sim.plan_ops", PlanOps, "Instruction and kind codes of tvm_spinn.sim.plan_create.");
}

}  // namespace tvm_spinn
