// Host (CPU) XlaGpuSimpleAdd: adds in f32 and rounds once, as PyTorch does on the CPU.
#include <cstdint>

#include "kernels/common/host_float.h"
#include "kernels/simple_add/simple_add.h"
#include "xla_ext/registry.h"

namespace xla_ext::simple_add {
namespace {

ffi::Error SimpleAddHost(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out) {
  XLA_EXT_RETURN_IF_ERROR(Check(a, b, *out));
  const int64_t n = static_cast<int64_t>(a.element_count());
  return host::DispatchFloat(kTarget, a.element_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* x = static_cast<const T*>(a.untyped_data());
    const T* y = static_cast<const T*>(b.untyped_data());
    T* z = static_cast<T*>(out->untyped_data());
    for (int64_t i = 0; i < n; ++i) {
      z[i] = host::FromFloat<T>(host::ToFloat(x[i]) + host::ToFloat(y[i]));
    }
  });
}

XLA_FFI_DEFINE_HANDLER(kSimpleAddHost, SimpleAddHost, Bind(ffi::Ffi::Bind()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "Host", kSimpleAddHost, XLA_EXT_NO_TRAITS);

}  // namespace xla_ext::simple_add
