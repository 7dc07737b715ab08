/* vLLM's reshape_and_cache as code in the wild writes it against XLA's legacy ABI (api_version
 * 3, the CPU's signature with opaque): the sizes come in `opaque` as five int64s (num_tokens,
 * num_kv_heads, head_size, num_blocks, block_size), the caches are written in place (each
 * output aliases its input cache). Inputs: key, value [num_tokens, num_kv_heads, head_size]
 * f32, key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_size] f32,
 * slot_mapping [num_tokens] int64 (negative: skip). Outputs: the two caches (a tuple). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct XlaCustomCallStatus_ XlaCustomCallStatus;
void XlaCustomCallStatusSetFailure(XlaCustomCallStatus* status, const char* message,
                                   size_t message_len);

static void fail(XlaCustomCallStatus* status, const char* message) {
  XlaCustomCallStatusSetFailure(status, message, strlen(message));
}

void LegacyReshapeAndCache(void* out, const void** in, const char* opaque, size_t opaque_len,
                           XlaCustomCallStatus* status) {
  int64_t sizes[5];
  if (opaque_len != sizeof(sizes)) {
    fail(status, "LegacyReshapeAndCache: opaque must hold five int64 sizes");
    return;
  }
  memcpy(sizes, opaque, sizeof(sizes));
  const int64_t num_tokens = sizes[0], row = sizes[1] * sizes[2];
  const int64_t num_slots = sizes[3] * sizes[4];
  const float* key = (const float*)in[0];
  const float* value = (const float*)in[1];
  const int64_t* slots = (const int64_t*)in[4];
  float* key_cache = (float*)((void**)out)[0];
  float* value_cache = (float*)((void**)out)[1];
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] >= num_slots) {
      char message[128];
      snprintf(message, sizeof(message),
               "LegacyReshapeAndCache: slot_mapping[%lld] = %lld is not below %lld slots",
               (long long)t, (long long)slots[t], (long long)num_slots);
      fail(status, message);
      return;
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    memcpy(key_cache + slots[t] * row, key + t * row, row * sizeof(float));
    memcpy(value_cache + slots[t] * row, value + t * row, row * sizeof(float));
  }
}
