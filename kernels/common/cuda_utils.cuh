// What CUDA handlers share: the element types of our float dtypes, and turning a launch
// failure into an ffi::Error that names the op.
#ifndef XLA_EXT_KERNELS_COMMON_CUDA_UTILS_CUH_
#define XLA_EXT_KERNELS_COMMON_CUDA_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

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

// Whether the current device takes programmatic dependent launches (Hopper and newer); cached
// per device, as the handlers ask at every call.
inline bool ProgrammaticLaunchSupported() {
  static std::atomic<int8_t> known[64];  // 0: not asked yet, 1: no, 2: yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return false;
  if (const int8_t answer = known[device].load(std::memory_order_relaxed); answer != 0) {
    return answer == 2;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return false;
  }
  known[device].store(major >= 9 ? 2 : 1, std::memory_order_relaxed);
  return major >= 9;
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), as a programmatic dependent launch
// where the device supports it: the kernel may start while the previous kernel on the stream
// drains, hiding launch latency, so it must wait (sm90::WaitForPrerequisiteGrid) before it
// touches memory; launch errors surface through LastLaunchError.
template <typename... Params, typename... Args>
void LaunchProgrammatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                        cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  const bool programmatic = ProgrammaticLaunchSupported();
  config.attrs = programmatic ? &attribute : nullptr;
  config.numAttrs = programmatic ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace xla_ext::cuda

#endif  // XLA_EXT_KERNELS_COMMON_CUDA_UTILS_CUH_
