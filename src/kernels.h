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

/*! \brief out[r] = ((0 + x[r,0]) + x[r,1]) + ... in float32, strictly left to right. */
void RowSumF32(const float* x, float* out, int64_t rows, int64_t cols);

}  // namespace tvm_spinn

#endif  // TVM_SPINN_KERNELS_H_
