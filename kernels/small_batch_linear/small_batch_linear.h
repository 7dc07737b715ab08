// xla_ext.small_batch_linear: a linear layer over a few rows (the tokens of a decode batch),
// where the time is the weight's bytes: one pass over the weight, its neighbours fused in.
//   x          [num_tokens, in_features]  f16 or bf16
//   weight     [weight_rows, in_features] x's dtype, torch's Linear layout (a row per output)
//   residual   [num_tokens, out_features] x's dtype, added to the product; or an empty
//              operand (no element, any dtype): none
//   silu_gate  attribute (s32): 0, out_features = weight_rows and
//                out = x @ weight^T (+ residual);
//              1, weight is a SwiGLU's gate rows then its up rows (weight_rows = 2 *
//                out_features), out = silu(x @ gate^T) * (x @ up^T); no residual
//   result     [num_tokens, out_features] x's dtype
// Products accumulate in f32; each value torch's eager ops would round is rounded to the dtype
// as they round it: the product, then the sum with the residual; or the gate and up products,
// silu of the gate, and the final product.
#ifndef XLA_EXT_KERNELS_SMALL_BATCH_LINEAR_SMALL_BATCH_LINEAR_H_
#define XLA_EXT_KERNELS_SMALL_BATCH_LINEAR_SMALL_BATCH_LINEAR_H_

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/common/contract.h"
#include "kernels/common/errors.h"

namespace xla_ext::small_batch_linear {

inline constexpr char kTarget[] = "xla_ext.small_batch_linear";

// The op's dtypes: the 16-bit floats the tensor cores multiply.
inline constexpr int64_t kDTypes[] = {XLA_FFI_DataType_F16, XLA_FFI_DataType_BF16};
inline constexpr XlaExtSupportedValues kSupported[] = {
    contract::Supported("dtype", "x", kDTypes),
};

struct Shapes {
  int64_t num_tokens;
  int64_t in_features;
  int64_t out_features;
  bool residual;
  bool silu_gate;
};

inline ffi::Error Check(const ffi::AnyBuffer& x, const ffi::AnyBuffer& weight,
                        const ffi::AnyBuffer& residual, const ffi::AnyBuffer& out,
                        int32_t silu_gate, Shapes& shapes) {
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "x", x, 2));
  const ffi::DataType dtype = x.element_type();
  if (!contract::Contains(kDTypes, static_cast<int64_t>(dtype))) {
    return ArgumentError(kTarget, "x", "dtype f16 or bf16",
                         std::string("dtype ") + DTypeName(dtype));
  }
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "weight", weight, 2));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "weight", weight, dtype));
  const auto xd = x.dimensions();
  const auto wd = weight.dimensions();
  if (wd[1] != xd[1]) {
    return ArgumentError(kTarget, "weight",
                         "shape [weight_rows, " + std::to_string(xd[1]) + "] (in_features of x)",
                         "shape " + ShapeString(wd));
  }
  if (silu_gate != 0 && silu_gate != 1) {
    return ArgumentError(kTarget, "silu_gate", "0 or 1", std::to_string(silu_gate));
  }
  if (silu_gate == 1 && wd[0] % 2 != 0) {
    return ArgumentError(kTarget, "weight",
                         "an even number of rows with silu_gate (gate rows, then up rows)",
                         "shape " + ShapeString(wd));
  }
  const int64_t out_features = silu_gate == 1 ? wd[0] / 2 : wd[0];
  // residual and out: x's dtype, one row of out_features per token.
  const auto check_rows = [&](const char* name, const ffi::AnyBuffer& rows) -> ffi::Error {
    XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, name, rows, dtype));
    const auto rd = rows.dimensions();
    if (rd.size() != 2 || rd[0] != xd[0] || rd[1] != out_features) {
      return ArgumentError(kTarget, name,
                           "shape [" + std::to_string(xd[0]) + ", " +
                               std::to_string(out_features) + "] (num_tokens, out_features)",
                           "shape " + ShapeString(rd));
    }
    return ffi::Error::Success();
  };
  const bool has_residual = residual.element_count() > 0;
  if (has_residual) {
    if (silu_gate == 1) {
      return ArgumentError(kTarget, "residual", "none with silu_gate",
                           "shape " + ShapeString(residual.dimensions()));
    }
    XLA_EXT_RETURN_IF_ERROR(check_rows("residual", residual));
  }
  XLA_EXT_RETURN_IF_ERROR(check_rows("out", out));
  if (xd[0] > INT32_MAX || wd[0] > INT32_MAX || xd[1] > INT32_MAX) {
    return ArgumentError(kTarget, "weight", "fewer than 2^31 rows, tokens and in_features",
                         "shape " + ShapeString(wd) + " with x " + ShapeString(xd));
  }
  shapes = Shapes{xd[0], xd[1], out_features, has_residual, silu_gate == 1};
  return ffi::Error::Success();
}

// Both platforms bind the same signature.
template <typename Binding>
auto Bind(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // weight
      .template Arg<ffi::AnyBuffer>()  // residual
      .template Ret<ffi::AnyBuffer>()  // out
      .template Attr<int32_t>("silu_gate");
}

}  // namespace xla_ext::small_batch_linear

#endif  // XLA_EXT_KERNELS_SMALL_BATCH_LINEAR_SMALL_BATCH_LINEAR_H_
