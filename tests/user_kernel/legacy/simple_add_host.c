/* A user's first kernel as the guides write it for the CPU: XLA's legacy custom-call ABI, in
 * C, built with `gcc -shared -fPIC -DAPI_VERSION=N` (N = 1, 2 or 3, the api_version it is
 * called with; each has its own signature). The size is hard-coded to 3, as the user's is.
 *
 * XlaGpuSimpleAddChecked (api_version 2) fails through XLA's status when an input holds a
 * NaN, so that a failure and the next call can be tested. */
#include <math.h>
#include <stddef.h>
#include <string.h>

typedef struct XlaCustomCallStatus_ XlaCustomCallStatus;
/* Defined by the process that runs XLA (torch_xla_ext provides it). */
void XlaCustomCallStatusSetFailure(XlaCustomCallStatus* status, const char* message,
                                   size_t message_len);

static void add3(float* out, const void** in) {
  const float* a = (const float*)in[0];
  const float* b = (const float*)in[1];
  for (int i = 0; i < 3; ++i) out[i] = a[i] + b[i];
}

#if API_VERSION == 1
void XlaGpuSimpleAdd(void* out, const void** in) { add3((float*)out, in); }
#elif API_VERSION == 2
void XlaGpuSimpleAdd(void* out, const void** in, XlaCustomCallStatus* status) {
  (void)status;
  add3((float*)out, in);
}
#elif API_VERSION == 3
void XlaGpuSimpleAdd(void* out, const void** in, const char* opaque, size_t opaque_len,
                     XlaCustomCallStatus* status) {
  (void)opaque, (void)opaque_len, (void)status;
  add3((float*)out, in);
}
#else
#error "build with -DAPI_VERSION=1, 2 or 3"
#endif

void XlaGpuSimpleAddChecked(void* out, const void** in, XlaCustomCallStatus* status) {
  for (int k = 0; k < 2; ++k) {
    for (int i = 0; i < 3; ++i) {
      if (isnan(((const float*)in[k])[i])) {
        static const char message[] = "XlaGpuSimpleAddChecked: an input holds a NaN";
        XlaCustomCallStatusSetFailure(status, message, strlen(message));
        return;
      }
    }
  }
  add3((float*)out, in);
}
