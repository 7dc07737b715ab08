// xla_ext.reshape_and_cache: writes new K/V rows into paged caches, as vLLM's
// reshape_and_cache_flash (NHD layout).
//
//   key, value              [num_tokens, num_kv_heads, head_size]        f32, f16 or bf16
//   key_cache, value_cache  [num_blocks, block_size, num_kv_heads, head_size], dtype of key
//   slot_mapping            [num_tokens] s64: slot = block * block_size + offset; < 0 skips
//   results                 key_cache_out, value_cache_out (shapes and dtype of the caches)
//
// Callers alias result 0 to argument 2 and result 1 to argument 3, so the caches are
// updated in place; when XLA gives distinct result buffers the caches are copied into them
// first. Token i's rows (num_kv_heads * head_size contiguous elements in both key and the
// cache) go to slot slot_mapping[i].
//
// A slot >= num_blocks * block_size: Host returns InvalidArgument naming slot_mapping; CUDA
// cannot report it without synchronising and skips that token (never writes out of bounds),
// unless XLA_EXT_DEBUG_CHECKS is set: then it checks every slot on the device first and returns
// the Host handler's error, the caches unchanged (kernels/common/debug_checks.cuh).
#ifndef XLA_EXT_KERNELS_RESHAPE_AND_CACHE_RESHAPE_AND_CACHE_H_
#define XLA_EXT_KERNELS_RESHAPE_AND_CACHE_RESHAPE_AND_CACHE_H_

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/common/contract.h"
#include "kernels/common/data_checks.h"
#include "kernels/common/errors.h"

namespace xla_ext::reshape_and_cache {

inline constexpr char kTarget[] = "xla_ext.reshape_and_cache";

// The op's contract (kernels/common/contract.h): the dtypes Check accepts (the caches and
// value take key's).
inline constexpr XlaExtSupportedValues kSupported[] = {
    contract::Supported("dtype", "key", kFloatDTypes),
};

// Every slot below num_blocks * block_size, or negative (data_checks.h).
struct SlotNames {
  static constexpr const char* kOp = kTarget;
  static constexpr const char* kNumSlots = "num_blocks * block_size";
};
using SlotMappingChecks = SlotChecks<int64_t, SlotNames>;

struct Shapes {
  int64_t num_tokens;
  int64_t num_slots;     // num_blocks * block_size
  int64_t row_elements;  // num_kv_heads * head_size: one token's elements
};

inline ffi::Error Check(const ffi::AnyBuffer& key, const ffi::AnyBuffer& value,
                        const ffi::AnyBuffer& key_cache, const ffi::AnyBuffer& value_cache,
                        const ffi::AnyBuffer& slot_mapping, const ffi::AnyBuffer& key_cache_out,
                        const ffi::AnyBuffer& value_cache_out, Shapes& shapes) {
  const ffi::DataType dtype = key.element_type();
  XLA_EXT_RETURN_IF_ERROR(CheckFloatType(kTarget, "key", key));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "key", key, 3));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "value", value, dtype));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "key_cache", key_cache, dtype));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "key_cache", key_cache, 4));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "value_cache", value_cache, dtype));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "slot_mapping", slot_mapping, ffi::DataType::S64));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "slot_mapping", slot_mapping, 1));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "key_cache_out", key_cache_out, dtype));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "value_cache_out", value_cache_out, dtype));

  const auto k = key.dimensions();
  const auto kc = key_cache.dimensions();
  XLA_EXT_RETURN_IF_ERROR(CheckSameShape(kTarget, "value", value, "key", key));
  if (kc[2] != k[1] || kc[3] != k[2]) {
    return ArgumentError(kTarget, "key_cache",
                         "shape [num_blocks, block_size, " + std::to_string(k[1]) + ", " +
                             std::to_string(k[2]) + "] (num_kv_heads, head_size of key)",
                         "shape " + ShapeString(kc));
  }
  XLA_EXT_RETURN_IF_ERROR(
      CheckSameShape(kTarget, "value_cache", value_cache, "key_cache", key_cache));
  if (slot_mapping.dimensions()[0] != k[0]) {
    return ArgumentError(kTarget, "slot_mapping", "shape [" + std::to_string(k[0]) + "]",
                         "shape " + ShapeString(slot_mapping.dimensions()));
  }
  XLA_EXT_RETURN_IF_ERROR(
      CheckSameShape(kTarget, "key_cache_out", key_cache_out, "key_cache", key_cache));
  XLA_EXT_RETURN_IF_ERROR(
      CheckSameShape(kTarget, "value_cache_out", value_cache_out, "key_cache", key_cache));
  shapes = Shapes{k[0], kc[0] * kc[1], k[1] * k[2]};
  return ffi::Error::Success();
}

// Both platforms bind the same arguments and results, after their contexts.
template <typename Binding>
auto Bind(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // key
      .template Arg<ffi::AnyBuffer>()  // value
      .template Arg<ffi::AnyBuffer>()  // key_cache
      .template Arg<ffi::AnyBuffer>()  // value_cache
      .template Arg<ffi::AnyBuffer>()  // slot_mapping
      .template Ret<ffi::AnyBuffer>()  // key_cache_out
      .template Ret<ffi::AnyBuffer>();  // value_cache_out
}

}  // namespace xla_ext::reshape_and_cache

#endif  // XLA_EXT_KERNELS_RESHAPE_AND_CACHE_RESHAPE_AND_CACHE_H_
