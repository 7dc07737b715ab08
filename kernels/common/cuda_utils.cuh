// What CUDA handlers share: the element types of our float dtypes, and turning a launch
// failure into an ffi::Error that names the op.
#ifndef XLA_EXT_KERNELS_COMMON_CUDA_UTILS_CUH_
#define XLA_EXT_KERNELS_COMMON_CUDA_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace xla_ext::cuda {

inline ::xla::ffi::Error LastLaunchError(std::string_view op) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return ::xla::ffi::Error::Success();
  return ::xla::ffi::Error::Internal(std::string(op) + ": CUDA launch failed: " +
                                     cudaGetErrorString(status));
}

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Calls fn(T{}) with T the CUDA element type of a float dtype (f32, f16 or bf16).
template <typename Fn>
auto DispatchFloat(::xla::ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ::xla::ffi::DataType::F16: return fn(__half{});
    case ::xla::ffi::DataType::BF16: return fn(__nv_bfloat16{});
    default: return fn(float{});
  }
}

inline int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace xla_ext::cuda

#endif  // XLA_EXT_KERNELS_COMMON_CUDA_UTILS_CUH_
