// Host (CPU) xla_ext.kv_cache_update, xla_ext.kv_cache_update_slices and
// xla_ext.rotary_kv_cache_update: every slot or slice is checked first, so a bad one leaves the
// cache untouched; then rows are copied (or rotated).
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/common/host_float.h"
#include "kernels/kv_cache_update/kv_cache_update.h"
#include "xla_ext/registry.h"

namespace xla_ext::kv_cache_update {
namespace {

// The result starts as the cache (a no-op when XLA aliased them).
char* StartFromCache(const ffi::AnyBuffer& kv_cache, ffi::AnyBuffer& kv_cache_out) {
  char* dst = static_cast<char*>(kv_cache_out.untyped_data());
  if (dst != kv_cache.untyped_data() && kv_cache.size_bytes() > 0) {
    std::memcpy(dst, kv_cache.untyped_data(), kv_cache.size_bytes());
  }
  return dst;
}

ffi::Error KvCacheUpdateHost(ffi::AnyBuffer key, ffi::AnyBuffer value, ffi::AnyBuffer kv_cache,
                             ffi::AnyBuffer slot_mapping,
                             ffi::Result<ffi::AnyBuffer> kv_cache_out) {
  SlotShapes s;
  XLA_EXT_RETURN_IF_ERROR(CheckSlots(key, value, kv_cache, slot_mapping, *kv_cache_out, s));
  const auto* slots = static_cast<const int32_t*>(slot_mapping.untyped_data());
  XLA_EXT_RETURN_IF_ERROR(FirstViolation(SlotMappingChecks{slots, s.num_tokens, s.num_slots}));
  char* cache = StartFromCache(kv_cache, *kv_cache_out);
  const auto* k = static_cast<const char*>(key.untyped_data());
  const auto* v = static_cast<const char*>(value.untyped_data());
  const int64_t token_bytes = s.num_kv_heads * s.row_bytes;
  for (int64_t i = 0; i < s.num_tokens; ++i) {
    if (slots[i] < 0) continue;
    char* slot = cache + slots[i] * 2 * token_bytes;  // 2 * num_kv_heads rows per slot
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      std::memcpy(slot + (2 * h) * s.row_bytes, k + i * token_bytes + h * s.row_bytes,
                  s.row_bytes);
      std::memcpy(slot + (2 * h + 1) * s.row_bytes, v + i * token_bytes + h * s.row_bytes,
                  s.row_bytes);
    }
  }
  return ffi::Error::Success();
}

ffi::Error KvCacheUpdateSlicesHost(ffi::AnyBuffer kv, ffi::AnyBuffer slices,
                                   ffi::AnyBuffer kv_cache, ffi::AnyBuffer num_slices,
                                   int64_t num_slices_per_block, int64_t page_size,
                                   ffi::Result<ffi::AnyBuffer> kv_cache_out) {
  SliceShapes s;
  XLA_EXT_RETURN_IF_ERROR(CheckSlices(kv, slices, kv_cache, num_slices, page_size,
                                      num_slices_per_block, *kv_cache_out, s));
  const auto* table = static_cast<const int32_t*>(slices.untyped_data());
  const auto* count_buffer = static_cast<const int32_t*>(num_slices.untyped_data());
  XLA_EXT_RETURN_IF_ERROR(FirstViolation(
      SliceChecks{table, count_buffer, s.max_slices, s.num_new_rows, s.num_cache_rows}));
  const int64_t count = *count_buffer;
  const int32_t* cache_start = table;
  const int32_t* new_start = table + s.max_slices;
  const int32_t* length = table + 2 * s.max_slices;
  char* cache = StartFromCache(kv_cache, *kv_cache_out);
  const auto* rows = static_cast<const char*>(kv.untyped_data());
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(cache + cache_start[i] * s.row_bytes, rows + new_start[i] * s.row_bytes,
                length[i] * s.row_bytes);
  }
  return ffi::Error::Success();
}

template <typename T>
void RotaryWrite(const RotaryShapes& s, const T* qkv, const T* cos, const T* sin, T* q_out,
                 T* cache, const int32_t* slots) {
  const int64_t d = s.head_size, half = d / 2;
  const int64_t row_heads = s.num_q_heads + 2 * s.num_kv_heads;
  const auto to = [](float x) { return host::ToFloat(host::FromFloat<T>(x)); };
  const auto mul = [](float a, float b) { return a * b; };
  const auto add = [](float a, float b) { return a + b; };
  for (int64_t t = 0; t < s.num_tokens; ++t) {
    const T* row = qkv + t * row_heads * d;
    T* slot = slots[t] >= 0 ? cache + int64_t{slots[t]} * 2 * s.num_kv_heads * d : nullptr;
    for (int64_t h = 0; h < s.num_q_heads + s.num_kv_heads; ++h) {
      T* out = h < s.num_q_heads ? q_out + (t * s.num_q_heads + h) * d
               : slot != nullptr  ? slot + 2 * (h - s.num_q_heads) * d
                                  : nullptr;
      if (out == nullptr) continue;
      for (int64_t j = 0; j < half; ++j) {
        float out1, out2;
        RotatePair(host::ToFloat(row[h * d + j]), host::ToFloat(row[h * d + half + j]),
                   host::ToFloat(cos[t * d + j]), host::ToFloat(cos[t * d + half + j]),
                   host::ToFloat(sin[t * d + j]), host::ToFloat(sin[t * d + half + j]), to, mul,
                   add, out1, out2);
        out[j] = host::FromFloat<T>(out1);
        out[half + j] = host::FromFloat<T>(out2);
      }
    }
    if (slot == nullptr) continue;
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      std::memcpy(slot + (2 * h + 1) * d, row + (s.num_q_heads + s.num_kv_heads + h) * d,
                  d * sizeof(T));
    }
  }
}

ffi::Error RotaryKvCacheUpdateHost(ffi::AnyBuffer qkv, ffi::AnyBuffer cos, ffi::AnyBuffer sin,
                                   ffi::AnyBuffer kv_cache, ffi::AnyBuffer slot_mapping,
                                   ffi::Result<ffi::AnyBuffer> q_out,
                                   ffi::Result<ffi::AnyBuffer> kv_cache_out) {
  RotaryShapes s;
  XLA_EXT_RETURN_IF_ERROR(
      CheckRotary(qkv, cos, sin, kv_cache, slot_mapping, *q_out, *kv_cache_out, s));
  const auto* slots = static_cast<const int32_t*>(slot_mapping.untyped_data());
  XLA_EXT_RETURN_IF_ERROR(
      FirstViolation(RotarySlotMappingChecks{slots, s.num_tokens, s.num_slots}));
  StartFromCache(kv_cache, *kv_cache_out);
  return host::DispatchFloat(kRotaryTarget, qkv.element_type(), [&](auto zero) {
    using T = decltype(zero);
    RotaryWrite<T>(s, static_cast<const T*>(qkv.untyped_data()),
                   static_cast<const T*>(cos.untyped_data()),
                   static_cast<const T*>(sin.untyped_data()), static_cast<T*>(q_out->untyped_data()),
                   static_cast<T*>(kv_cache_out->untyped_data()), slots);
  });
}

XLA_FFI_DEFINE_HANDLER(kKvCacheUpdateHost, KvCacheUpdateHost, BindSlots(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kRotaryKvCacheUpdateHost, RotaryKvCacheUpdateHost,
                       BindRotary(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER(kKvCacheUpdateSlicesHost, KvCacheUpdateSlicesHost,
                       BindSlices(ffi::Ffi::Bind()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "Host", kKvCacheUpdateHost, XLA_EXT_NO_TRAITS);
XLA_EXT_REGISTER_KERNEL(kSlicesTarget, "Host", kKvCacheUpdateSlicesHost, XLA_EXT_NO_TRAITS);
XLA_EXT_REGISTER_KERNEL(kRotaryTarget, "Host", kRotaryKvCacheUpdateHost, XLA_EXT_NO_TRAITS);

}  // namespace xla_ext::kv_cache_update
