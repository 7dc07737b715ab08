// A user's own kernel library, built outside kernels/ the way the README shows:
//   g++ -shared -fPIC -std=c++17 $(includes from torch_xla_ext.get_include()) scale_kernel.cc
// out = x * factor, f32, any shape; `factor` is a typed FFI attribute.
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "xla_ext/registry.h"

namespace ffi = xla::ffi;

static ffi::Error Scale(ffi::Buffer<ffi::F32> x, float factor,
                        ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("user.scale: argument 'out': expected as many elements "
                                       "as 'x'");
  }
  for (int64_t i = 0; i < n; ++i) out->typed_data()[i] = x.typed_data()[i] * factor;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kScale, Scale,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Attr<float>("factor")
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_EXT_REGISTER_KERNEL("user.scale", "Host", kScale, XLA_EXT_NO_TRAITS);
