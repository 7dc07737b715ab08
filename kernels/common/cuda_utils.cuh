// What CUDA handlers share: the element types of our float dtypes, and turning a launch
// failure into an ffi::Error that names the op.
#ifndef XLA_EXT_KERNELS_COMMON_CUDA_UTILS_CUH_
#define XLA_EXT_KERNELS_COMMON_CUDA_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "kernels/common/errors.h"
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

// op folded over the warp's 32 values of `value`, the result in every lane (butterfly
// shuffles: the same order in every lane).
template <typename Op>
__device__ __forceinline__ float WarpReduce(float value, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// 2^x on the special-function unit (ex2.approx.ftz: about 2 ulp, denormal results flushed to 0,
// 2^-inf = 0): softmax weights with the logits kept in log2 units cost one instruction each.
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Calls fn(T{}) with T the CUDA element type of a float dtype (f32, f16 or bf16); any other
// dtype is an error naming `op` (Check() rejects those first: reaching it is a bug).
template <typename Fn>
::xla::ffi::Error DispatchFloat(std::string_view op, ::xla::ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ::xla::ffi::DataType::F32: fn(float{}); break;
    case ::xla::ffi::DataType::F16: fn(__half{}); break;
    case ::xla::ffi::DataType::BF16: fn(__nv_bfloat16{}); break;
    default: return NoKernelError(op, "dtype", DTypeName(dtype));
  }
  return ::xla::ffi::Error::Success();
}

// For an op that writes into a buffer in place (a KV cache): when XLA gave the result a
// buffer of its own instead of aliasing it to the input, the result starts as a copy.
inline ::xla::ffi::Error CopyUnlessAliased(std::string_view op,
                                           const ::xla::ffi::AnyBuffer& input,
                                           ::xla::ffi::AnyBuffer& result, cudaStream_t stream) {
  if (result.untyped_data() == input.untyped_data() || input.size_bytes() == 0) {
    return ::xla::ffi::Error::Success();
  }
  if (cudaMemcpyAsync(result.untyped_data(), input.untyped_data(), input.size_bytes(),
                      cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
    return LastLaunchError(op);
  }
  return ::xla::ffi::Error::Success();
}

// Split-KV partial results: for `slots` (row, partition) pairs, the unnormalised outputs
// [slots, head_size], then the maxima and the sums [slots] each, in one buffer (TakePartials).
struct PartialResults {
  float* out = nullptr;
  float* max = nullptr;
  float* sum = nullptr;
};

// A call's scratch, carved out of one buffer its caller sized: the op's workspace result,
// which XLA allocates with the call's other buffers, so that a command buffer (CUDA graph)
// can record the call and replay it (scratch from the ScratchAllocator would be another
// allocation at every call). Or, made by Measuring(), no buffer: Take returns null and only
// counts, which is how a front end learns the size (the handler's own planning, run without
// its launches). Slices are 256-byte aligned.
class Workspace {
 public:
  Workspace(void* data, size_t size) : data_(static_cast<char*>(data)), size_(size) {}
  static Workspace Measuring() { return Workspace(); }

  template <typename T>
  T* Take(int64_t count) {
    const size_t offset = used_;
    used_ += (static_cast<size_t>(count) * sizeof(T) + kAlignment - 1) / kAlignment * kAlignment;
    return measuring_ ? nullptr : reinterpret_cast<T*>(data_ + offset);
  }
  bool measuring() const { return measuring_; }
  size_t used() const { return used_; }

  // Before the first launch: whether what was taken fits, else an error naming `op`'s
  // `argument` (pointers past the end are never used then).
  ::xla::ffi::Error CheckFits(std::string_view op, std::string_view argument) const {
    if (used_ <= size_) return ::xla::ffi::Error::Success();
    return ArgumentError(op, argument, "at least " + std::to_string(used_) + " bytes",
                         std::to_string(size_) + " bytes");
  }

 private:
  static constexpr size_t kAlignment = 256;
  Workspace() : measuring_(true) {}

  char* data_ = nullptr;
  size_t size_ = 0;
  size_t used_ = 0;
  bool measuring_ = false;
};

// The partial results of `slots` pairs, taken from `workspace` (all null while it measures).
inline PartialResults TakePartials(Workspace& workspace, int64_t slots, int64_t head_size) {
  float* buffer = workspace.Take<float>(slots * (2 + head_size));
  if (buffer == nullptr) return {};
  return {buffer, buffer + slots * head_size, buffer + slots * (head_size + 1)};
}

inline int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// The current device's fixed properties the handlers plan with, asked of the runtime once
// per device (handlers run at every call); nullopt if the runtime cannot say.
struct DeviceInfo {
  int id = 0;
  int sms = 0;
  int major = 0;              // compute capability
  int max_shared_bytes = 0;  // per CTA, opted in
};

inline std::optional<DeviceInfo> DeviceInfoOf(int device) {
  constexpr int kMaxDevices = 64;
  static std::once_flag asked[kMaxDevices];
  static std::optional<DeviceInfo> answers[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) return std::nullopt;
  std::call_once(asked[device], [device] {
    DeviceInfo d;
    d.id = device;
    if (cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device) ==
            cudaSuccess &&
        cudaDeviceGetAttribute(&d.max_shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                               device) == cudaSuccess) {
      answers[device] = d;
    }
  });
  return answers[device];
}

inline std::optional<DeviceInfo> CurrentDeviceInfo() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return std::nullopt;
  return DeviceInfoOf(device);
}

// Makes `device` current for its lifetime (the occupancy queries ask of the current device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    ok_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  bool ok() const { return ok_; }

 private:
  int previous_ = -1;
  bool ok_ = false;
};

// For an op's workspace size query (its contract's workspace_bytes, kernel_table.h): the
// bytes `plan(device_info, workspace)` takes, with a measuring workspace and nothing launched,
// on CUDA device `device`, or with device -1 the most it takes on any visible device; 0 where
// no device is visible or the plan fails (the handler reports that itself).
template <typename PlanFn>
int64_t WorkspaceBytes(int device, PlanFn&& plan) {
  const auto on = [&](int d) -> int64_t {
    const DeviceGuard guard(d);
    const std::optional<DeviceInfo> info = DeviceInfoOf(d);
    if (!guard.ok() || !info.has_value()) return 0;
    Workspace measuring = Workspace::Measuring();
    return plan(info, measuring).failure() ? 0 : static_cast<int64_t>(measuring.used());
  };
  if (device >= 0) return on(device);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: nothing needs a workspace
    return 0;
  }
  int64_t most = 0;
  for (int d = 0; d < devices; ++d) most = std::max(most, on(d));
  return most;
}

// CTAs of `kernel` an SM holds with `shared_bytes` of dynamic shared memory (0 if the runtime
// cannot say). The first call per (kernel, device) also opts the kernel in to the device's
// largest shared memory (less its static shared memory: the runtime refuses more). Answers are
// kept: these driver calls cost microseconds, and a decode step calls a handler once per layer.
inline int CtasPerSm(const void* kernel, const DeviceInfo& device, int threads, int shared_bytes) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, int>, int> answers;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(kernel, device.id, threads, shared_bytes);
  if (auto it = answers.find(key); it != answers.end()) return it->second;
  int ctas = 0;
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           device.max_shared_bytes -
                               static_cast<int>(attributes.sharedSizeBytes)) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, shared_bytes) !=
          cudaSuccess) {
    cudaGetLastError();  // not left behind for the launch check to report
    return 0;
  }
  answers.emplace(key, ctas);
  return ctas;
}

// The grid of a kernel (`threads` threads, no dynamic shared memory) whose CTAs stride over
// `wanted` CTAs' work: at most that many, and no more than the GPU holds at once (one per SM
// where the runtime cannot say).
inline int64_t OneWaveCtas(const void* kernel, const DeviceInfo& device, int threads,
                           int64_t wanted) {
  const int per_sm = std::max(1, CtasPerSm(kernel, device, threads, 0));
  return std::min<int64_t>(wanted, int64_t{device.sms} * per_sm);
}

// Whether the environment variable `name` is set to `value` (callers keep the answer: it is
// how tests and benchmarks pick a kernel where the handler would choose another).
inline bool EnvIs(const char* name, std::string_view value) {
  const char* set = std::getenv(name);
  return set != nullptr && value == set;
}

// Whether the current device takes programmatic dependent launches (Hopper and newer).
inline bool ProgrammaticLaunchSupported() {
  const std::optional<DeviceInfo> device = CurrentDeviceInfo();
  return device.has_value() && device->major >= 9;
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
