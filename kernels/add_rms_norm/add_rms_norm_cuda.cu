// CUDA xla_ext.add_rms_norm: a CTA per row adds, stores the sum and sums its squares, then
// scales the row; the second pass reads the sum back from where the first stored it (the
// CTA's own writes, in L1 or L2).
#include <cstdint>
#include <iterator>

#include "kernels/add_rms_norm/add_rms_norm.h"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"
#include "xla_ext/registry.h"

namespace xla_ext::add_rms_norm {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    AddRmsNormKernel(const T* __restrict__ x, const T* __restrict__ residual,
                     const T* __restrict__ weight, T* sum, T* __restrict__ normed, int hidden,
                     float eps) {
  cuda::sm90::WaitForPrerequisiteGrid();  // launched programmatically (see AddRmsNormCuda)
  cuda::sm90::LaunchDependents();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * hidden;
  float squares = 0;
  for (int i = threadIdx.x; i < hidden; i += kThreads) {
    const T value = cuda::FromFloat<T>(cuda::ToFloat(residual[row + i]) + cuda::ToFloat(x[row + i]));
    sum[row + i] = value;
    const float f = cuda::ToFloat(value);
    squares += f * f;
  }
  squares = cuda::WarpReduce(squares, [](float a, float b) { return a + b; });
  __shared__ float warp_squares[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_squares[threadIdx.x / 32] = squares;
  __syncthreads();
  float total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += warp_squares[w];
  const float scale = rsqrtf(total / static_cast<float>(hidden) + eps);
  for (int i = threadIdx.x; i < hidden; i += kThreads) {
    const float unit = cuda::ToFloat(cuda::FromFloat<T>(cuda::ToFloat(sum[row + i]) * scale));
    normed[row + i] = cuda::FromFloat<T>(cuda::ToFloat(weight[i]) * unit);
  }
}

ffi::Error AddRmsNormCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                          ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> sum,
                          ffi::Result<ffi::AnyBuffer> normed, float eps) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(Check(x, residual, weight, *sum, *normed, eps, s));
  if (s.num_tokens == 0 || s.hidden == 0) return ffi::Error::Success();
  constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;  // grid.x
  if (s.num_tokens > kMaxRows) {
    return ArgumentError(kTarget, "x", "fewer than 2^31 rows", ShapeString(x.dimensions()));
  }
  XLA_EXT_RETURN_IF_ERROR(cuda::DispatchFloat(kTarget, x.element_type(), [&](auto zero) {
    using T = decltype(zero);
    // A programmatic launch: on Hopper it overlaps the previous kernel's tail, which for a
    // decode step's few rows is most of the op's time.
    cuda::LaunchProgrammatic(AddRmsNormKernel<T>, dim3(static_cast<unsigned>(s.num_tokens)),
                             dim3(kThreads), 0, stream, static_cast<const T*>(x.untyped_data()),
                             static_cast<const T*>(residual.untyped_data()),
                             static_cast<const T*>(weight.untyped_data()),
                             static_cast<T*>(sum->untyped_data()),
                             static_cast<T*>(normed->untyped_data()),
                             static_cast<int>(s.hidden), eps);
  }));
  return cuda::LastLaunchError(kTarget);
}

XLA_FFI_DEFINE_HANDLER(kAddRmsNormCuda, AddRmsNormCuda,
                       Bind(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kAddRmsNormCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, nullptr});

}  // namespace xla_ext::add_rms_norm
