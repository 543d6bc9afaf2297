// Bit-exact models of the spinn processing element's arithmetic, on raw row-major buffers.
// Every kernel keeps, per output element, the exact operation order of the hardware.
#ifndef TVM_SPINN_KERNELS_H_
#define TVM_SPINN_KERNELS_H_

#include <cstdint>

namespace tvm_spinn {

/*!
 * \brief C[M,N] += A[M,K] * B[K,N] in float32, Cortex-M4F VMLA.F32 semantics: for each output,
 *        k strictly ascending, c = round(c + round(a * b)) (non-fused multiply-accumulate).
 */
void GemmF32(const float* a, const float* b, float* c, int64_t m, int64_t k, int64_t n);

/*!
 * \brief C[M,N] += A[M,K] * B[K,N] with exact products and a signed `acc_bits`-bit two's
 *        complement accumulator: every addition is wrapped, k strictly ascending.
 * \return The number of additions whose exact result did not fit (wrap events).
 * \pre 2 <= acc_bits <= 32 and every C element representable in acc_bits bits.
 */
int64_t GemmI8(const int8_t* a, const int8_t* b, int32_t* c, int64_t m, int64_t k, int64_t n,
               int acc_bits);
/*! \brief As GemmI8, with int16 operands (16-bit mode). */
int64_t GemmI16(const int16_t* a, const int16_t* b, int32_t* c, int64_t m, int64_t k, int64_t n,
                int acc_bits);

/*!
 * \brief Batched operands of the whole-layer kernels: C[b] (+)= A[a_index[b]] @ B[b_index[b]] for
 *        b in [0, batch); A is [a_count, M, K], B is [b_count, K, N], C is [batch, M, N], all
 *        row-major. Conv groups use a_index[b] = b % groups; broadcast matmul batches repeat
 *        an index instead of copying the operand.
 */
struct EpilogueF32;
struct BatchedGemm {
  int64_t batch, m, k, n;
  const int64_t* a_index;  // [batch], each in [0, a_count)
  const int64_t* b_index;  // [batch], each in [0, b_count)
  // fp32 only (GemmF32Batched): C's prior contents ignored, each output starting from +0.0 (as
  // if C were zero-filled), and `epilogue` (null: none) applied to each finished output, a bias
  // on rows indexed by the row in [0, m), on columns by the column: the bits of a zero fill
  // before and ApplyEpilogueF32(c, batch, m, n, *epilogue) after, without their passes over C.
  bool zero_c = false;
  const EpilogueF32* epilogue = nullptr;
};

/*!
 * \brief GemmF32 over a batch (one call per layer), register-blocked and multi-threaded over
 *        output blocks. Each output is computed by one thread, k ascending from its C value, with
 *        a separately rounded multiply and add, so the bits are those of GemmF32 for any
 *        blocking and any thread count.
 */
void GemmF32Batched(const float* a, const float* b, float* c, const BatchedGemm& shape,
                    int threads);

/*!
 * \brief Integer GEMM over a batch with the MAC array's k-chunking: for each output, k is split
 *        into chunks of `chunk` (the last may be shorter); each chunk accumulates from 0 in a
 *        fresh signed `acc_bits`-bit accumulator, every addition wrapped (as GemmI8), and the
 *        chunk result is added to C (the M4F's int32 total, wrapping modulo 2^32).
 * \return The number of wrap events of the acc_bits accumulators.
 */
int64_t GemmI8Batched(const int8_t* a, const int8_t* b, int32_t* c, const BatchedGemm& shape,
                      int64_t chunk, int acc_bits, int threads);
/*! \brief As GemmI8Batched with int16 operands. */
int64_t GemmI16Batched(const int16_t* a, const int16_t* b, int32_t* c, const BatchedGemm& shape,
                       int64_t chunk, int acc_bits, int threads);

/*! \brief Geometry of Im2Col: input [n, groups * cg, h, w] -> out [n * groups, cg*kh*kw, oh*ow]. */
struct Im2ColShape {
  int64_t n, groups, cg, h, w, kh, kw, oh, ow;
  int64_t stride_h, stride_w, dil_h, dil_w, pad_top, pad_left;
};

/*!
 * \brief im2col of an NCHW tensor (pure data movement, what the DMA gathers): row (c, i, j) in
 *        the OIHW weight's order, column oy * ow + ox; positions in the padding read `fill`.
 *        `elem_bytes` is 1, 2 or 4.
 */
void Im2Col(const void* x, void* out, const Im2ColShape& s, int elem_bytes, const void* fill,
            int threads);

/*! \brief Worker threads for a job of `work` multiply-adds: 1 for small jobs, else `threads`. */
int SimThreads(int64_t work);

/*! \brief The M4F's NaN result of `a op b` for a two-operand VADD/VMUL whose host result is NaN
 *         (FPSCR.DN = 0: a signalling operand quieted first, else a quiet one, the first
 *         operand's if both are; an invalid operation on numbers gives 0x7FC00000). */
float M4fNaNOf(float a, float b);

/*! \brief out[r] = ((0 + x[r,0]) + x[r,1]) + ... in float32, strictly left to right; a NaN
 *         sum by the M4F's rule (FPProcessNaNs, default NaN 0x7FC00000). */
void RowSumF32(const float* x, float* out, int64_t rows, int64_t cols);

/*!
 * \brief dst[c, r] = src[r, c] for a C-contiguous src [rows, cols] of `itemsize`-byte elements
 *        (1, 2, 4 or 8): a cache-blocked copy, bands of rows on up to `threads` threads.
 */
void Transpose2D(const void* src, void* dst, int64_t rows, int64_t cols, int itemsize, int threads);

/*!
 * \brief The exp/log unit's exp, modelled by one fixed float32 algorithm (Cephes expf:
 *        Cody-Waite reduction by ln 2, a degree-6 polynomial, exact scaling by 2^n), so the
 *        simulator's bits do not depend on the host's math library or SIMD level.
 *        out[i] = exp(x[i]); NaN stays NaN, overflow gives +inf, underflow +0.
 */
void ExpF32(const float* x, float* out, int64_t n);

/*!
 * \brief tanh from the same exp model (Cephes tanhf): |x| > 0.625: 1 - 2 / (exp(2|x|) + 1)
 *        with x's sign; else an odd degree-11 polynomial.
 */
void TanhF32(const float* x, float* out, int64_t n);

/*! \brief Activations built on the exp model, each a fixed sequence of fp32 operations. */
enum class Activation : int { kGelu = 0, kGeluTanh = 1, kSigmoid = 2 };

/*!
 * \brief out = act(x): GELU 0.5 x (1 + erf(x / sqrt 2)) with the M4F library's erf
 *        (Abramowitz-Stegun 7.1.26: sign(u) (1 - t (c1 + t (c2 + t (c3 + t (c4 + t c5))))
 *        exp(-u u)), t = 1 / (1 + p |u|)); GELU-tanh 0.5 x (1 + tanh(0.79788456 (x + 0.044715
 *        x x x))); sigmoid 1 / (1 + exp(-x)). Operations in the order written, each rounded.
 */
void ActivationF32(const float* x, float* out, int64_t n, Activation act);

/*!
 * \brief Softmax of each row of x [rows, cols]: m = the row's max (its first NaN if any),
 *        e = ExpF32(x - m), out = e / s with s the sequential fp32 sum of e (left to right
 *        from 0). Rows run on up to `threads` threads (rows are independent: same bits).
 */
void SoftmaxRowsF32(const float* x, float* out, int64_t rows, int64_t cols, int threads);

/*!
 * \brief The exp/log unit's natural log, modelled by one fixed float32 algorithm (Cephes logf:
 *        x = m 2^e with m in [sqrt(1/2), sqrt 2), a degree-8 polynomial in m - 1, ln 2 split in
 *        two), as ExpF32 is. NaN stays NaN, log(+0) = -inf, log(+inf) = +inf, x < 0 gives NaN.
 */
void LogF32(const float* x, float* out, int64_t n);

/*!
 * \brief Per-row cross-entropy of logits z [rows, cols] with class labels [rows]: m = the row's
 *        max (its first NaN if any), s = the sequential fp32 sum of ExpF32(z - m) (left to
 *        right from 0, the softmax's), out[r] = LogF32(s) - (z[r, label] - m) (the negated
 *        log-softmax at the label); a row whose label equals `ignore_index` gives +0. Labels
 *        must lie in [0, cols) or equal ignore_index (checked by the caller). Rows run on up
 *        to `threads` threads (independent: same bits).
 */
void CrossEntropyRowsF32(const float* z, const int32_t* labels, float* out, int64_t rows,
                         int64_t cols, int64_t ignore_index, int threads);

/*!
 * \brief The gradient of the mean cross-entropy with respect to the logits: out[r, j] =
 *        (p[r, j] - (j == label[r] ? 1 : 0)) / divisor, p the softmax of the row
 *        (SoftmaxRowsF32's bits), each operation one fp32 rounding. Labels in [0, cols).
 */
void CrossEntropyGradRowsF32(const float* z, const int32_t* labels, float* out, int64_t rows,
                             int64_t cols, float divisor, int threads);

/*!
 * \brief Elements per block of a layer norm's row sums (python: rows.LAYER_NORM_BLOCK).
 */
constexpr int64_t kLayerNormBlock = 32;

/*!
 * \brief Layer norm of each row: mean = sum(x) / d, c = x - mean, var = sum(c * c) / d,
 *        y = c / sqrt(var + eps), then y * gamma and y + beta when given (null: skipped).
 *        Every operation one fp32 rounding. Each sum is blocked: the row's elements in
 *        blocks of kLayerNormBlock from its start, each block summed left to right from 0,
 *        the block sums added left to right from 0 -- an order fixed by the row alone, so
 *        the blocks can be summed on different PEs (a row split over PEs) with these bits.
 */
void LayerNormRowsF32(const float* x, const float* gamma, const float* beta, float eps, float* out,
                      int64_t rows, int64_t cols, int threads);

/*!
 * \brief RMS norm of each row (Llama's RMSNorm, the decomposed graph's operations in order):
 *        q = sum(x * x) blocked as the layer norm's (kLayerNormBlock), m = q / d, v = m + eps,
 *        r = 1 / sqrt(v) (VSQRT then VDIV), h = x * r, then y = weight * h when given (null:
 *        y = h). Every operation one fp32 rounding.
 */
void RmsNormRowsF32(const float* x, const float* weight, float eps, float* out, int64_t rows,
                    int64_t cols, int threads);

/*!
 * \brief What the M4F applies to a finished fp32 accumulator, in this order: `+ bias`, ReLU
 *        (`x > 0 ? x : +0`), then a clip (`x < hi ? x : hi`, then `y > lo ? y : lo`: TVM's
 *        max(min(x, hi), lo), NaN rules included). Each step is optional.
 */
struct EpilogueF32 {
  const float* bias = nullptr;  // indexed by row (bias_on_rows) or by column
  bool bias_on_rows = true;
  bool relu = false;
  bool clip = false;
  float lo = 0.0f, hi = 0.0f;
};

/*! \brief Apply `e` to C [outer, rows, cols] in place (rows: output channels of a conv). */
void ApplyEpilogueF32(float* c, int64_t outer, int64_t rows, int64_t cols, const EpilogueF32& e,
                      int threads);

/*!
 * \brief Depthwise-style conv: input [n, groups, h, w] (one input channel per group), weight
 *        [groups * mult, kh * kw], output [n, groups * mult, oh, ow] (+=, then `e` with the bias
 *        per output channel). Every output reduces its kh * kw products in the im2col order
 *        (i, j ascending), padding reading +0.0: the bits of im2col + GemmF32Batched.
 */
struct DepthwiseShape {
  int64_t n, groups, mult, h, w, kh, kw, oh, ow;
  int64_t stride_h, stride_w, dil_h, dil_w, pad_top, pad_left;
};
/*! `zero_out`: out's prior contents ignored, every output starting from +0.0 (as a zero fill). */
void DepthwiseConvF32(const float* x, const float* w, float* out, const DepthwiseShape& s,
                      const EpilogueF32& e, int threads, bool zero_out = false);

/*! \brief Geometry of MaxPool2dBackwardF32: `planes` NCHW planes of x [h, w] and dy [oh, ow],
 *         the window kh x kw, strides sh, sw, padding pt (top) and pl (left). */
struct PoolGradShape {
  int64_t planes, h, w, oh, ow, kh, kw, sh, sw, pt, pl;
};

/*!
 * \brief The input gradient of a max pooling (no dilation), TVM's topi.nn.pool_grad bit for
 *        bit (program/ops/pool.py's max_pool2d_backward): each window's argmax over x padded
 *        with the lowest float32, in window order, from "nothing taken" with the lowest float32
 *        as the best value, taking a tap unless `best > v || best == v` (a NaN is taken, and
 *        replaces a NaN best); then each input element's gradient is an fp32 sum from +0.0
 *        over the windows that may hold it (window rows, then columns, nearest first), adding
 *        dy where the window's argmax is this element and +0.0 where not. A NaN sum follows the
 *        M4F's VADD with the window's dy as its first operand (FPSCR.DN = 0: a signalling NaN
 *        first, then a quiet one, dy's before the sum's; inf + -inf the default NaN 0x7FC00000),
 *        as the PE code adds. Windows past the last output row or column hold nothing. Planes run on
 *        up to `threads` threads (independent: same bits).
 */
void MaxPool2dBackwardF32(const float* dy, const float* x, float* dx, const PoolGradShape& s,
                          int threads);

}  // namespace tvm_spinn

#endif  // TVM_SPINN_KERNELS_H_
