// Host (CPU) xla_ext.small_batch_linear: the reference, one f32 dot product per output.
#include <cmath>
#include <cstdint>

#include "kernels/common/host_float.h"
#include "kernels/small_batch_linear/small_batch_linear.h"
#include "xla_ext/registry.h"

namespace xla_ext::small_batch_linear {
namespace {

ffi::Error SmallBatchLinearHost(ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer residual,
                                ffi::Result<ffi::AnyBuffer> out, int32_t silu_gate) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(Check(x, weight, residual, *out, silu_gate, s));
  return host::DispatchFloat(kTarget, x.element_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xs = static_cast<const T*>(x.untyped_data());
    const T* w = static_cast<const T*>(weight.untyped_data());
    const T* r = static_cast<const T*>(residual.untyped_data());
    T* o = static_cast<T*>(out->untyped_data());
    const int64_t k_size = s.in_features;
    const auto rounded = [](float v) { return host::ToFloat(host::FromFloat<T>(v)); };
    const auto product = [&](int64_t token, int64_t row) {
      float acc = 0;
      for (int64_t k = 0; k < k_size; ++k) {
        acc += host::ToFloat(xs[token * k_size + k]) * host::ToFloat(w[row * k_size + k]);
      }
      return rounded(acc);
    };
    for (int64_t token = 0; token < s.num_tokens; ++token) {
      for (int64_t j = 0; j < s.out_features; ++j) {
        float value = product(token, j);
        if (s.silu_gate) {
          const float up = product(token, j + s.out_features);
          value = rounded(value / (1.0f + std::exp(-value))) * up;
        } else if (s.residual) {
          value += host::ToFloat(r[token * s.out_features + j]);
        }
        o[token * s.out_features + j] = host::FromFloat<T>(value);
      }
    }
  });
}

XLA_FFI_DEFINE_HANDLER(kSmallBatchLinearHost, SmallBatchLinearHost, Bind(ffi::Ffi::Bind()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "Host", kSmallBatchLinearHost, XLA_EXT_NO_TRAITS);

}  // namespace xla_ext::small_batch_linear
