// Zeroes ints in XLA's scratch memory before a kernel that counts in them, as a kernel launched
// programmatically: unlike cudaMemsetAsync (a copy-engine memset of 512 bytes left the next
// kernel 2.3 us behind it on the H100, bench/results/h100-combine-wave-ab.txt) it launches while
// the previous kernel drains.
#ifndef XLA_EXT_KERNELS_COMMON_ZERO_FILL_CUH_
#define XLA_EXT_KERNELS_COMMON_ZERO_FILL_CUH_

#include <algorithm>
#include <cstdint>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"

namespace xla_ext::cuda {

// A template, so that every user of the header may instantiate it.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) ZeroFillKernel(int* data, int64_t count) {
  // The memory may be the previous kernel's scratch: it must be done with it.
  sm90::WaitForPrerequisiteGrid();
  sm90::LaunchDependents();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    data[i] = 0;
  }
}

// The kernel behind it must wait for it before it reads `data`: a programmatic launch that
// waits for its previous grid (sm90::WaitForPrerequisiteGrid), or an ordinary launch.
inline void LaunchZeroFill(int* data, int64_t count, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int ctas = static_cast<int>(std::clamp<int64_t>(CeilDiv(count, kThreads), 1, 64));
  LaunchProgrammatic(ZeroFillKernel<kThreads>, dim3(ctas), dim3(kThreads), 0, stream, data,
                     count);
}

}  // namespace xla_ext::cuda

#endif  // XLA_EXT_KERNELS_COMMON_ZERO_FILL_CUH_
