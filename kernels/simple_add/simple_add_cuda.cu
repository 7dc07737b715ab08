// CUDA XlaGpuSimpleAdd: a grid-stride loop over 16-byte vectors, so each thread moves full
// sectors, plus a scalar tail; runs at memory bandwidth for large tensors.
#include <algorithm>
#include <cstdint>
#include <iterator>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/simple_add/simple_add.h"
#include "xla_ext/registry.h"

namespace xla_ext::simple_add {
namespace {

template <typename T>
__global__ void AddKernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                          int64_t n, bool aligned) {
  cuda::sm90::WaitForPrerequisiteGrid();  // launched programmatically (see SimpleAddCuda)
  cuda::sm90::LaunchDependents();
  constexpr int kVec = 16 / sizeof(T);
  const int64_t num_vecs = aligned ? n / kVec : 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = first; v < num_vecs; v += stride) {
    const uint4 va = reinterpret_cast<const uint4*>(a)[v];
    const uint4 vb = reinterpret_cast<const uint4*>(b)[v];
    uint4 vo;
    const T* xa = reinterpret_cast<const T*>(&va);
    const T* xb = reinterpret_cast<const T*>(&vb);
    T* xo = reinterpret_cast<T*>(&vo);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      xo[k] = cuda::FromFloat<T>(cuda::ToFloat(xa[k]) + cuda::ToFloat(xb[k]));
    }
    reinterpret_cast<uint4*>(out)[v] = vo;
  }
  for (int64_t i = num_vecs * kVec + first; i < n; i += stride) {
    out[i] = cuda::FromFloat<T>(cuda::ToFloat(a[i]) + cuda::ToFloat(b[i]));
  }
}

ffi::Error SimpleAddCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                         ffi::Result<ffi::AnyBuffer> out) {
  XLA_EXT_RETURN_IF_ERROR(Check(a, b, *out));
  const int64_t n = static_cast<int64_t>(a.element_count());
  if (n == 0) return ffi::Error::Success();
  constexpr int kThreads = 256;
  // XLA's buffers are 16-byte aligned; a torch tensor view may not be, and then every
  // element takes the scalar path.
  const bool aligned = ((reinterpret_cast<uintptr_t>(a.untyped_data()) |
                         reinterpret_cast<uintptr_t>(b.untyped_data()) |
                         reinterpret_cast<uintptr_t>(out->untyped_data())) % 16) == 0;
  XLA_EXT_RETURN_IF_ERROR(cuda::DispatchFloat(kTarget, a.element_type(), [&](auto zero) {
    using T = decltype(zero);
    // Threads with a vector, or the scalar tail's first elements, whichever is more.
    constexpr int64_t kVec = 16 / sizeof(T);
    const int64_t work = aligned ? std::max(n / kVec, n % kVec) : n;
    // The grid-stride loop covers whatever a capped grid leaves.
    const int blocks = std::min(cuda::CeilDiv(work, kThreads), 1 << 20);
    // A programmatic dependent launch: on Hopper, the kernel's launch overlaps the previous
    // kernel's tail, which for small tensors is most of the op's time.
    cuda::LaunchProgrammatic(AddKernel<T>, dim3(blocks), dim3(kThreads), 0, stream,
                             static_cast<const T*>(a.untyped_data()),
                             static_cast<const T*>(b.untyped_data()),
                             static_cast<T*>(out->untyped_data()), n, aligned);
  }));
  return cuda::LastLaunchError(kTarget);
}

XLA_FFI_DEFINE_HANDLER(kSimpleAddCuda, SimpleAddCuda,
                       Bind(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kSimpleAddCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, nullptr});

}  // namespace xla_ext::simple_add
