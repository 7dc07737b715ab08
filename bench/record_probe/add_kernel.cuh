// The probe's kernel: XlaGpuSimpleAdd's f32 kernel (kernels/simple_add/simple_add_cuda.cu)
// with C linkage, because the record API loads a kernel from a cubin by name.
#ifndef XLA_EXT_BENCH_RECORD_PROBE_ADD_KERNEL_CUH_
#define XLA_EXT_BENCH_RECORD_PROBE_ADD_KERNEL_CUH_

#include <cstdint>

extern "C" __global__ void xla_ext_probe_add(const float* __restrict__ a,
                                             const float* __restrict__ b,
                                             float* __restrict__ out, int64_t n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = first; v < n / 4; v += stride) {
    const float4 x = reinterpret_cast<const float4*>(a)[v];
    const float4 y = reinterpret_cast<const float4*>(b)[v];
    reinterpret_cast<float4*>(out)[v] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
  }
  for (int64_t i = n / 4 * 4 + first; i < n; i += stride) out[i] = a[i] + b[i];
}

#endif  // XLA_EXT_BENCH_RECORD_PROBE_ADD_KERNEL_CUH_
