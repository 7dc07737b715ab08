// A user's kernel library that declares no check (as every library built before checks did):
// its calls are checked by its handler when the step runs. out = -x, f32, any shape.
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "xla_ext/registry.h"

namespace ffi = xla::ffi;

static ffi::Error Negate(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  if (out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("user.negate: argument 'out': expected as many elements "
                                       "as 'x'");
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  for (int64_t i = 0; i < n; ++i) out->typed_data()[i] = -x.typed_data()[i];
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kNegate, Negate,
                       ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_EXT_REGISTER_KERNEL("user.negate", "Host", kNegate, XLA_EXT_NO_TRAITS);
