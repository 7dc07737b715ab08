// The user's first kernel for the GPU, as the guides write it: XLA's legacy custom-call ABI,
// built with `nvcc --shared -Xcompiler -fPIC -DAPI_VERSION=N` (N = 1, 2 or 3). Buffers are
// the inputs then the output; the size is hard-coded to 3, as the user's is.
// XlaGpuSimpleAddChecked (api_version 2) fails through XLA's status when an input holds a NaN
// (it looks at the inputs on the host, which a real kernel would not).
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstring>

struct XlaCustomCallStatus_;
extern "C" void XlaCustomCallStatusSetFailure(XlaCustomCallStatus_* status, const char* message,
                                              size_t message_len);

__global__ void AddKernel(const float* a, const float* b, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

static void Add3(cudaStream_t stream, void** buffers) {
  AddKernel<<<1, 32, 0, stream>>>(static_cast<const float*>(buffers[0]),
                                  static_cast<const float*>(buffers[1]),
                                  static_cast<float*>(buffers[2]), 3);
}

#if API_VERSION == 1
extern "C" void XlaGpuSimpleAdd(cudaStream_t stream, void** buffers, const char* opaque,
                                size_t opaque_len) {
  Add3(stream, buffers);
}
#elif API_VERSION == 2 || API_VERSION == 3
extern "C" void XlaGpuSimpleAdd(cudaStream_t stream, void** buffers, const char* opaque,
                                size_t opaque_len, XlaCustomCallStatus_* status) {
  Add3(stream, buffers);
}
#else
#error "build with -DAPI_VERSION=1, 2 or 3"
#endif

extern "C" void XlaGpuSimpleAddChecked(cudaStream_t stream, void** buffers, const char* opaque,
                                       size_t opaque_len, XlaCustomCallStatus_* status) {
  float host[2][3];
  for (int k = 0; k < 2; ++k) {
    cudaMemcpyAsync(host[k], buffers[k], sizeof(host[k]), cudaMemcpyDeviceToHost, stream);
  }
  cudaStreamSynchronize(stream);
  for (int k = 0; k < 2; ++k) {
    for (int i = 0; i < 3; ++i) {
      if (std::isnan(host[k][i])) {
        static const char message[] = "XlaGpuSimpleAddChecked: an input holds a NaN";
        XlaCustomCallStatusSetFailure(status, message, std::strlen(message));
        return;
      }
    }
  }
  Add3(stream, buffers);
}
