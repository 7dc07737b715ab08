// A typed XLA FFI handler a user registers by capsule (api_version 4), as
// jax.ffi.register_ffi_target takes it: out = a + b, f32, any size; on the CPU ("Host") or,
// built with nvcc -DUSER_FFI_CUDA, on CUDA. Exported by name (XLA_FFI_DEFINE_HANDLER_SYMBOL).
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#ifdef USER_FFI_CUDA
#include <cuda_runtime.h>

__global__ void AddKernel(const float* a, const float* b, float* out, int64_t n) {
  int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

static ffi::Error Add(cudaStream_t stream, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                      ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = static_cast<int64_t>(a.element_count());
  AddKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      a.typed_data(), b.typed_data(), out->typed_data(), n);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(UserFfiAdd, Add,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#else
static ffi::Error Add(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                      ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = static_cast<int64_t>(a.element_count());
  for (int64_t i = 0; i < n; ++i) out->typed_data()[i] = a.typed_data()[i] + b.typed_data()[i];
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(UserFfiAdd, Add,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#endif
