// Host (CPU) xla_ext.add_rms_norm: row by row, in f32 with torch's roundings.
#include <cmath>
#include <cstdint>

#include "kernels/add_rms_norm/add_rms_norm.h"
#include "kernels/common/host_float.h"
#include "xla_ext/registry.h"

namespace xla_ext::add_rms_norm {
namespace {

ffi::Error AddRmsNormHost(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                          ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> normed,
                          float eps) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(Check(x, residual, weight, *sum, *normed, eps, s));
  return host::DispatchFloat(kTarget, x.element_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xs = static_cast<const T*>(x.untyped_data());
    const T* rs = static_cast<const T*>(residual.untyped_data());
    const T* w = static_cast<const T*>(weight.untyped_data());
    T* out_sum = static_cast<T*>(sum->untyped_data());
    T* out_normed = static_cast<T*>(normed->untyped_data());
    for (int64_t t = 0; t < s.num_tokens; ++t) {
      const int64_t row = t * s.hidden;
      float squares = 0;
      for (int64_t i = 0; i < s.hidden; ++i) {
        out_sum[row + i] = host::FromFloat<T>(host::ToFloat(rs[row + i]) + host::ToFloat(xs[row + i]));
        const float v = host::ToFloat(out_sum[row + i]);
        squares += v * v;
      }
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(s.hidden) + eps);
      for (int64_t i = 0; i < s.hidden; ++i) {
        const float v = host::ToFloat(host::FromFloat<T>(host::ToFloat(out_sum[row + i]) * scale));
        out_normed[row + i] = host::FromFloat<T>(host::ToFloat(w[i]) * v);
      }
    }
  });
}

XLA_FFI_DEFINE_HANDLER(kAddRmsNormHost, AddRmsNormHost, Bind(ffi::Ffi::Bind()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "Host", kAddRmsNormHost, XLA_EXT_NO_TRAITS);

}  // namespace xla_ext::add_rms_norm
