// Global functions tvm_spinn.sim.epilogue_f32, depthwise_conv2d_f32, exp_f32 and tanh_f32: validated
// entry points of the fused fp32 epilogue, the direct depthwise convolution and the exp/log unit's models.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/reflection/registry.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels.h"
#include "tensor_check.h"

namespace tvm_spinn {
namespace {

using tvm::ffi::TensorView;

constexpr DLDataType kF32{kDLFloat, 32, 1};

/*! \brief The epilogue; `bias` with no elements means none, else it must have `count`. */
EpilogueF32 MakeEpilogue(const char* func, const TensorView& bias, int64_t count,
                         bool bias_on_rows, bool relu, bool clip, double lo, double hi) {
  CheckTensor(func, "bias", bias, 1, kF32);
  EpilogueF32 e;
  if (bias.numel() > 0) {
    CheckDim(func, "bias.shape[0]", bias.shape()[0], count, "bias " + ShapeStr(bias));
    e.bias = DataPtr<const float>(bias);
  }
  e.bias_on_rows = bias_on_rows;
  e.relu = relu;
  e.clip = clip;
  e.lo = static_cast<float>(lo);
  e.hi = static_cast<float>(hi);
  return e;
}

void SimEpilogueF32(TensorView c, TensorView bias, bool bias_on_rows, bool relu, bool clip,
                    double lo, double hi, int64_t threads) {
  const char* func = "tvm_spinn.sim.epilogue_f32";
  CheckTensor(func, "C", c, 3, kF32);
  const int64_t outer = c.shape()[0], rows = c.shape()[1], cols = c.shape()[2];
  const EpilogueF32 e =
      MakeEpilogue(func, bias, bias_on_rows ? rows : cols, bias_on_rows, relu, clip, lo, hi);
  CheckNoOverlap(func, "C", c, "bias", bias);
  ApplyEpilogueF32(DataPtr<float>(c), outer, rows, cols, e, ThreadsArg(func, threads, c.numel() * 4));
}

/*!
 * \brief X [n, groups, h, w], W [groups * mult, kh, kw], out [n, groups * mult, oh, ow]: out +=
 *        the depthwise conv, then the epilogue (bias per output channel). `geometry` = (stride_h,
 *        stride_w, dil_h, dil_w, pad_top, pad_left).
 */
void SimDepthwiseConv2dF32(TensorView x, TensorView w, TensorView out, TensorView bias,
                           tvm::ffi::Array<int64_t> geometry, bool relu, bool clip, double lo,
                           double hi, int64_t threads) {
  const char* func = "tvm_spinn.sim.depthwise_conv2d_f32";
  CheckTensor(func, "X", x, 4, kF32);
  CheckTensor(func, "W", w, 3, kF32);
  CheckTensor(func, "out", out, 4, kF32);
  if (geometry.size() != 6) {
    TVM_FFI_THROW(ValueError) << func << ": geometry must be (stride_h, stride_w, dil_h, dil_w, "
                              << "pad_top, pad_left), got " << geometry.size() << " values";
  }
  DepthwiseShape s;
  s.n = x.shape()[0];
  s.groups = x.shape()[1];
  s.h = x.shape()[2];
  s.w = x.shape()[3];
  s.kh = w.shape()[1];
  s.kw = w.shape()[2];
  s.oh = out.shape()[2];
  s.ow = out.shape()[3];
  s.stride_h = geometry[0];
  s.stride_w = geometry[1];
  s.dil_h = geometry[2];
  s.dil_w = geometry[3];
  s.pad_top = geometry[4];
  s.pad_left = geometry[5];
  const std::string detail = "X " + ShapeStr(x) + ", W " + ShapeStr(w) + ", out " + ShapeStr(out);
  if (s.groups <= 0 || w.shape()[0] % s.groups != 0 || s.stride_h < 1 || s.stride_w < 1 ||
      s.dil_h < 1 || s.dil_w < 1 || s.pad_top < 0 || s.pad_left < 0 || s.kh < 1 || s.kw < 1) {
    TVM_FFI_THROW(ValueError) << func << ": bad geometry (strides and dilations >= 1, padding "
                              << ">= 0, W.shape[0] a multiple of the groups): " << detail;
  }
  s.mult = w.shape()[0] / s.groups;
  CheckDim(func, "out.shape[0]", out.shape()[0], s.n, detail);
  CheckDim(func, "out.shape[1]", out.shape()[1], s.groups * s.mult, detail);
  // every tap must read inside the padded input: rows up to (oh-1)*sh + (kh-1)*dh - pad_top
  // (below that, the padding), likewise for columns; reads past the input are the padding
  const EpilogueF32 e = MakeEpilogue(func, bias, s.groups * s.mult, true, relu, clip, lo, hi);
  CheckNoOverlap(func, "out", out, "X", x);
  CheckNoOverlap(func, "out", out, "W", w);
  CheckNoOverlap(func, "out", out, "bias", bias);
  DepthwiseConvF32(DataPtr<const float>(x), DataPtr<const float>(w), DataPtr<float>(out), s, e,
                   ThreadsArg(func, threads, out.numel() * s.kh * s.kw));
}

/*! \brief out = f(x) element-wise for the float32 models of the exp/log unit. */
template <void (*F)(const float*, float*, int64_t)>
void SimUnaryF32(const char* func, TensorView x, TensorView out) {
  CheckTensor(func, "X", x, x.ndim(), kF32);
  CheckTensor(func, "out", out, out.ndim(), kF32);
  CheckDim(func, "out.numel()", out.numel(), x.numel(), "X " + ShapeStr(x) + ", out " + ShapeStr(out));
  CheckNoOverlap(func, "out", out, "X", x);
  F(DataPtr<const float>(x), DataPtr<float>(out), x.numel());
}

void SimActivationF32(TensorView x, TensorView out, int64_t kind) {
  const char* func = "tvm_spinn.sim.activation_f32";
  if (kind < 0 || kind > 2) {
    TVM_FFI_THROW(ValueError) << func << ": kind must be 0 (gelu), 1 (gelu_tanh) or 2 (sigmoid), got " << kind;
  }
  CheckTensor(func, "X", x, x.ndim(), kF32);
  CheckTensor(func, "out", out, out.ndim(), kF32);
  CheckDim(func, "out.numel()", out.numel(), x.numel(), "X " + ShapeStr(x) + ", out " + ShapeStr(out));
  CheckNoOverlap(func, "out", out, "X", x);
  ActivationF32(DataPtr<const float>(x), DataPtr<float>(out), x.numel(), static_cast<Activation>(kind));
}

void SimExpF32(TensorView x, TensorView out) { SimUnaryF32<ExpF32>("tvm_spinn.sim.exp_f32", x, out); }
void SimTanhF32(TensorView x, TensorView out) { SimUnaryF32<TanhF32>("tvm_spinn.sim.tanh_f32", x, out); }

// The checks of a row kernel's X and out: float32 [rows, cols] each, the same shape, not
// overlapping. Returns the shapes as the detail of later messages.
std::string CheckRows(const char* func, const TensorView& x, const TensorView& out) {
  CheckTensor(func, "X", x, 2, kF32);
  CheckTensor(func, "out", out, 2, kF32);
  const std::string detail = "X " + ShapeStr(x) + ", out " + ShapeStr(out);
  CheckDim(func, "out.shape[0]", out.shape()[0], x.shape()[0], detail);
  CheckDim(func, "out.shape[1]", out.shape()[1], x.shape()[1], detail);
  CheckNoOverlap(func, "out", out, "X", x);
  return detail;
}

void SimSoftmaxF32(TensorView x, TensorView out, int64_t threads) {
  const char* func = "tvm_spinn.sim.softmax_f32";
  CheckRows(func, x, out);
  SoftmaxRowsF32(DataPtr<const float>(x), DataPtr<float>(out), x.shape()[0], x.shape()[1],
                 ThreadsArg(func, threads, x.numel() * 8));
}

void SimLayerNormF32(TensorView x, TensorView gamma, TensorView beta, double eps, TensorView out,
                     int64_t threads) {
  const char* func = "tvm_spinn.sim.layer_norm_f32";
  const std::string detail = CheckRows(func, x, out);
  CheckTensor(func, "gamma", gamma, 1, kF32);
  CheckTensor(func, "beta", beta, 1, kF32);
  for (const TensorView* t : {&gamma, &beta}) {
    if (t->numel() > 0) {
      CheckDim(func, t == &gamma ? "gamma.shape[0]" : "beta.shape[0]", t->shape()[0], x.shape()[1],
               detail);
    }
  }
  CheckNoOverlap(func, "out", out, "gamma", gamma);
  CheckNoOverlap(func, "out", out, "beta", beta);
  LayerNormRowsF32(DataPtr<const float>(x), gamma.numel() ? DataPtr<const float>(gamma) : nullptr,
                   beta.numel() ? DataPtr<const float>(beta) : nullptr, static_cast<float>(eps),
                   DataPtr<float>(out), x.shape()[0], x.shape()[1],
                   ThreadsArg(func, threads, x.numel() * 8));
}

void SimRmsNormF32(TensorView x, TensorView weight, double eps, TensorView out, int64_t threads) {
  const char* func = "tvm_spinn.sim.rms_norm_f32";
  const std::string detail = CheckRows(func, x, out);
  CheckTensor(func, "weight", weight, 1, kF32);
  if (weight.numel() > 0) CheckDim(func, "weight.shape[0]", weight.shape()[0], x.shape()[1], detail);
  CheckNoOverlap(func, "out", out, "weight", weight);
  RmsNormRowsF32(DataPtr<const float>(x), weight.numel() ? DataPtr<const float>(weight) : nullptr,
                 static_cast<float>(eps), DataPtr<float>(out), x.shape()[0], x.shape()[1],
                 ThreadsArg(func, threads, x.numel() * 4));
}

void SimLogF32(TensorView x, TensorView out) { SimUnaryF32<LogF32>("tvm_spinn.sim.log_f32", x, out); }

// The checks of a cross-entropy kernel's logits Z [rows, cols] float32 and labels [rows] int32:
// every label in [0, cols), or equal to `ignore` where `allow_ignore`.
void CheckCrossEntropy(const char* func, const TensorView& z, const TensorView& labels, bool allow_ignore,
                       int64_t ignore) {
  CheckTensor(func, "Z", z, 2, kF32);
  CheckTensor(func, "labels", labels, 1, DLDataType{kDLInt, 32, 1});
  CheckDim(func, "labels.shape[0]", labels.shape()[0], z.shape()[0],
           "Z " + ShapeStr(z) + ", labels " + ShapeStr(labels));
  const int32_t* t = DataPtr<const int32_t>(labels);
  const int64_t cols = z.shape()[1];
  for (int64_t r = 0; r < labels.shape()[0]; ++r) {
    if (allow_ignore && t[r] == ignore) continue;
    if (t[r] < 0 || t[r] >= cols) {
      TVM_FFI_THROW(ValueError) << func << ": label " << t[r] << " of row " << r
                                << " is out of range for " << cols << " classes";
    }
  }
}

void SimCrossEntropyF32(TensorView z, TensorView labels, int64_t ignore_index, TensorView out,
                        int64_t threads) {
  const char* func = "tvm_spinn.sim.cross_entropy_f32";
  CheckCrossEntropy(func, z, labels, true, ignore_index);
  CheckTensor(func, "out", out, 1, kF32);
  CheckDim(func, "out.shape[0]", out.shape()[0], z.shape()[0], "Z " + ShapeStr(z) + ", out " + ShapeStr(out));
  CheckNoOverlap(func, "out", out, "Z", z);
  CrossEntropyRowsF32(DataPtr<const float>(z), DataPtr<const int32_t>(labels), DataPtr<float>(out),
                      z.shape()[0], z.shape()[1], ignore_index, ThreadsArg(func, threads, z.numel() * 8));
}

void SimCrossEntropyGradF32(TensorView z, TensorView labels, double divisor, TensorView out,
                            int64_t threads) {
  const char* func = "tvm_spinn.sim.cross_entropy_grad_f32";
  CheckCrossEntropy(func, z, labels, false, 0);
  CheckRows(func, z, out);
  CrossEntropyGradRowsF32(DataPtr<const float>(z), DataPtr<const int32_t>(labels), DataPtr<float>(out),
                          z.shape()[0], z.shape()[1], static_cast<float>(divisor),
                          ThreadsArg(func, threads, z.numel() * 8));
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_spinn.sim.epilogue_f32", SimEpilogueF32,
           "C[o, r, c] = clip(relu(C + bias[r or c])) in place, float32, each step optional "
           "(bias with no elements: none).")
      .def("tvm_spinn.sim.exp_f32", SimExpF32,
           "out = exp(X) element-wise: the exp/log unit's model (Cephes expf, fixed float32 "
           "operations: the same bits on every host).")
      .def("tvm_spinn.sim.tanh_f32", SimTanhF32,
           "out = tanh(X) element-wise from the same exp model (Cephes tanhf).")
      .def("tvm_spinn.sim.activation_f32", SimActivationF32,
           "out = GELU (kind 0), GELU-tanh (1) or sigmoid (2) of X on the exp model.")
      .def("tvm_spinn.sim.log_f32", SimLogF32, "The exp/log unit's natural log model (Cephes logf).")
      .def("tvm_spinn.sim.cross_entropy_f32", SimCrossEntropyF32,
           "Per-row cross-entropy of logits Z [rows, cols] with int32 labels, the exp/log models.")
      .def("tvm_spinn.sim.cross_entropy_grad_f32", SimCrossEntropyGradF32,
           "(softmax(Z) - one_hot(labels)) / divisor, row by row.")
      .def("tvm_spinn.sim.softmax_f32", SimSoftmaxF32,
           "Softmax of each row of X [rows, cols] with the exp model, sums sequential fp32.")
      .def("tvm_spinn.sim.layer_norm_f32", SimLayerNormF32,
           "Layer norm of each row of X [rows, cols] (gamma/beta with no elements: none), "
           "sums in blocks of 32 (block sums added in order), every operation one rounding.")
      .def("tvm_spinn.sim.rms_norm_f32", SimRmsNormF32,
           "RMS norm of each row of X [rows, cols] (weight with no elements: none): x * (1 / "
           "sqrt(sum(x * x) / d + eps)) * weight, the sum in blocks of 32 (block sums added in "
           "order), every operation one rounding.")
      .def("tvm_spinn.sim.depthwise_conv2d_f32", SimDepthwiseConv2dF32,
           "out += depthwise conv (one input channel per group, taps in im2col order, padding "
           "+0.0), then bias per output channel, ReLU and clip.");
}

}  // namespace tvm_spinn
