// xla_ext.add_rms_norm: a decoder layer's residual add and the RMSNorm after it, in one pass
// over the rows (what XLA runs as two fusions, each a launch that mostly waits).
//   x         [num_tokens, hidden]  f32, f16 or bf16 (a sublayer's output)
//   residual  [num_tokens, hidden]  x's dtype (the residual stream)
//   weight    [hidden]              x's dtype (the norm's scale)
//   eps       attribute (f32)
//   results   sum = residual + x, rounded to the dtype; normed = weight * (sum * rsqrt(mean(
//             sum^2) + eps)) as transformers' LlamaRMSNorm computes it: sum in f32, the
//             normalised row rounded to the dtype, then the product with weight rounded.
#ifndef XLA_EXT_KERNELS_ADD_RMS_NORM_ADD_RMS_NORM_H_
#define XLA_EXT_KERNELS_ADD_RMS_NORM_ADD_RMS_NORM_H_

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/common/contract.h"
#include "kernels/common/errors.h"

namespace xla_ext::add_rms_norm {

inline constexpr char kTarget[] = "xla_ext.add_rms_norm";

inline constexpr XlaExtSupportedValues kSupported[] = {
    contract::Supported("dtype", "x", kFloatDTypes),
};

struct Shapes {
  int64_t num_tokens;
  int64_t hidden;
};

inline ffi::Error Check(const ffi::AnyBuffer& x, const ffi::AnyBuffer& residual,
                        const ffi::AnyBuffer& weight, const ffi::AnyBuffer& sum,
                        const ffi::AnyBuffer& normed, float eps, Shapes& shapes) {
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "x", x, 2));
  XLA_EXT_RETURN_IF_ERROR(CheckFloatType(kTarget, "x", x));
  const ffi::DataType dtype = x.element_type();
  XLA_EXT_RETURN_IF_ERROR(CheckSameShape(kTarget, "residual", residual, "x", x));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "residual", residual, dtype));
  const auto d = x.dimensions();
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "weight", weight, dtype));
  if (weight.dimensions().size() != 1 || weight.dimensions()[0] != d[1]) {
    return ArgumentError(kTarget, "weight", "shape [" + std::to_string(d[1]) + "] (hidden of x)",
                         "shape " + ShapeString(weight.dimensions()));
  }
  if (!(eps >= 0)) {
    return ArgumentError(kTarget, "eps", ">= 0", std::to_string(eps));
  }
  for (const auto& [name, out] : {std::pair<const char*, const ffi::AnyBuffer*>{"sum", &sum},
                                  {"normed", &normed}}) {
    XLA_EXT_RETURN_IF_ERROR(CheckSameShape(kTarget, name, *out, "x", x));
    XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, name, *out, dtype));
  }
  if (d[0] > INT32_MAX || d[1] > INT32_MAX) {
    return ArgumentError(kTarget, "x", "fewer than 2^31 tokens and hidden",
                         "shape " + ShapeString(d));
  }
  shapes = Shapes{d[0], d[1]};
  return ffi::Error::Success();
}

template <typename Binding>
auto Bind(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // residual
      .template Arg<ffi::AnyBuffer>()  // weight
      .template Ret<ffi::AnyBuffer>()  // sum
      .template Ret<ffi::AnyBuffer>()  // normed
      .template Attr<float>("eps");
}

}  // namespace xla_ext::add_rms_norm

#endif  // XLA_EXT_KERNELS_ADD_RMS_NORM_ADD_RMS_NORM_H_
