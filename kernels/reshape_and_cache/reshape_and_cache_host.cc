// Host (CPU) xla_ext.reshape_and_cache: checks every slot first, so a bad slot_mapping
// leaves the caches untouched, then copies each token's rows into its slot.
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/reshape_and_cache/reshape_and_cache.h"
#include "xla_ext/registry.h"

namespace xla_ext::reshape_and_cache {
namespace {

ffi::Error ReshapeAndCacheHost(ffi::AnyBuffer key, ffi::AnyBuffer value, ffi::AnyBuffer key_cache,
                               ffi::AnyBuffer value_cache, ffi::AnyBuffer slot_mapping,
                               ffi::Result<ffi::AnyBuffer> key_cache_out,
                               ffi::Result<ffi::AnyBuffer> value_cache_out) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(Check(key, value, key_cache, value_cache, slot_mapping, *key_cache_out,
                                *value_cache_out, s));
  const auto* slots = static_cast<const int64_t*>(slot_mapping.untyped_data());
  XLA_EXT_RETURN_IF_ERROR(FirstViolation(SlotMappingChecks{slots, s.num_tokens, s.num_slots}));

  const size_t row_bytes = s.row_elements * ffi::ByteWidth(key.element_type());
  auto write = [&](const ffi::AnyBuffer& rows, const ffi::AnyBuffer& cache,
                   ffi::AnyBuffer& cache_out) {
    char* dst = static_cast<char*>(cache_out.untyped_data());
    if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
    const char* src = static_cast<const char*>(rows.untyped_data());
    for (int64_t i = 0; i < s.num_tokens; ++i) {
      if (slots[i] >= 0) std::memcpy(dst + slots[i] * row_bytes, src + i * row_bytes, row_bytes);
    }
  };
  write(key, key_cache, *key_cache_out);
  write(value, value_cache, *value_cache_out);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kReshapeAndCacheHost, ReshapeAndCacheHost, Bind(ffi::Ffi::Bind()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "Host", kReshapeAndCacheHost, XLA_EXT_NO_TRAITS);

}  // namespace xla_ext::reshape_and_cache
