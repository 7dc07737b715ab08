// Writes new K/V rows into the combined paged cache of xla_ext.ragged_paged_attention
// (`kv_pages`: [num_pages, page_size, 2 * num_kv_heads, head_size], K of kv head h at combined
// head 2h, V at 2h + 1), in place. Two targets, one per addressing scheme:
//
// xla_ext.kv_cache_update (by slot, like reshape_and_cache):
//   key, value     [num_tokens, num_kv_heads, head_size]           any dtype, the cache's
//   kv_cache       [num_pages, page_size, 2 * num_kv_heads, head_size]
//   slot_mapping   [num_tokens] s32: slot = page * page_size + offset; < 0 skips the token
//   result         kv_cache_out (aliased to kv_cache by callers)
//
// xla_ext.kv_cache_update_slices (vLLM's `kv_cache_update_op`, with its argument names):
//   kv                    [num_tokens, num_combined_heads, head_size]  K/V already interleaved
//   slot_mapping          [3, max_slices] s32: column i = (cache_start, new_kv_start, length)
//   kv_cache              [num_cache_rows, num_combined_heads, head_size] (pages flattened)
//   num_kv_update_slices  [1] s32: the first num_kv_update_slices[0] columns are used
//   attrs                 page_size, num_slices_per_block (i64; Pallas tiling in vLLM: both
//                         checked > 0, page_size must divide num_cache_rows)
//   result                kv_cache_out (aliased to kv_cache by callers)
//   Slice i copies kv rows [new_kv_start, +length) to cache rows [cache_start, +length).
//
// xla_ext.rotary_kv_cache_update (a decoder layer's rotary embedding and K/V write, one launch):
//   qkv            [num_tokens, num_q_heads + 2 * num_kv_heads, head_size]  f32, f16 or bf16:
//                  each token's q heads, then its k heads, then its v heads (one projection)
//   cos, sin       [num_tokens, head_size] qkv's dtype: each token's rows of the rotary tables
//   kv_cache       [num_pages, page_size, 2 * num_kv_heads, head_size] qkv's dtype
//   slot_mapping   [num_tokens] s32, as kv_cache_update's
//   results        q [num_tokens, num_q_heads, head_size]: the q heads rotated; kv_cache_out
//                  (aliased to kv_cache by callers): the k heads rotated at combined head 2h,
//                  the v heads as they are at 2h + 1
//   The rotation is transformers' Llama one (rotate-half): x * cos + rotate_half(x) * sin with
//   rotate_half(x) = (-x[d/2:], x[:d/2]), each product and the sum rounded to the dtype as
//   torch's eager ops round them. (In the model this replaces XLA's concatenate and slice
//   fusions of the rotation and the K/V write's launch: four kernels per layer, one now.)
//
// The data (slots, slices) is checked on the Host before anything is written: one bad entry
// fails the call with InvalidArgument naming it and leaves the cache unchanged. CUDA cannot
// report it without synchronising: a slot >= num_slots skips its token, a slice reaching out
// of either buffer (or every slice, when num_kv_update_slices exceeds max_slices) is skipped;
// nothing is ever written out of bounds; with XLA_EXT_DEBUG_CHECKS set it runs the Host
// handler's checks (SlotMappingChecks, SliceChecks) on the device first and returns its error,
// the cache unchanged (kernels/common/debug_checks.cuh). When XLA gives the result a buffer of
// its own (no aliasing), the cache is copied into it first.
#ifndef XLA_EXT_KERNELS_KV_CACHE_UPDATE_KV_CACHE_UPDATE_H_
#define XLA_EXT_KERNELS_KV_CACHE_UPDATE_KV_CACHE_UPDATE_H_

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/common/contract.h"
#include "kernels/common/data_checks.h"
#include "kernels/common/errors.h"

namespace xla_ext::kv_cache_update {

inline constexpr char kTarget[] = "xla_ext.kv_cache_update";
inline constexpr char kSlicesTarget[] = "xla_ext.kv_cache_update_slices";
inline constexpr char kRotaryTarget[] = "xla_ext.rotary_kv_cache_update";

// Both ops' contract (kernels/common/contract.h): the dtypes a cache may hold (the rows
// written take the cache's). The kernels copy bytes, but a cache of another dtype is no
// cache any attention op reads.
inline constexpr XlaExtSupportedValues kSupported[] = {
    contract::Supported("dtype", "kv_cache", kCacheDTypes),
};

inline ffi::Error CheckCacheDType(const char* op, const ffi::AnyBuffer& kv_cache) {
  const ffi::DataType dtype = kv_cache.element_type();
  if (contract::Contains(kCacheDTypes, static_cast<int64_t>(dtype))) return ffi::Error::Success();
  return ArgumentError(op, "kv_cache", "dtype f32, f16, bf16 or f8e4m3fn",
                       std::string("dtype ") + DTypeName(dtype));
}

// Every slot below num_pages * page_size, or negative (data_checks.h).
struct SlotNames {
  static constexpr const char* kOp = kTarget;
  static constexpr const char* kNumSlots = "num_pages * page_size";
};
using SlotMappingChecks = SlotChecks<int32_t, SlotNames>;
struct RotarySlotNames {
  static constexpr const char* kOp = kRotaryTarget;
  static constexpr const char* kNumSlots = "num_pages * page_size";
};
using RotarySlotMappingChecks = SlotChecks<int32_t, RotarySlotNames>;

// The rotary op's dtypes, qkv's and its tables' and cache's: the float ones (the rotation is
// arithmetic).
inline constexpr XlaExtSupportedValues kRotarySupported[] = {
    contract::Supported("dtype", "qkv", kFloatDTypes),
};

struct SlotShapes {
  int64_t num_tokens;
  int64_t num_slots;        // num_pages * page_size
  int64_t num_kv_heads;
  int64_t row_bytes;        // one head's row: head_size elements
};

inline ffi::Error CheckSlots(const ffi::AnyBuffer& key, const ffi::AnyBuffer& value,
                             const ffi::AnyBuffer& kv_cache, const ffi::AnyBuffer& slot_mapping,
                             const ffi::AnyBuffer& kv_cache_out, SlotShapes& shapes) {
  const ffi::DataType dtype = kv_cache.element_type();
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "kv_cache", kv_cache, 4));
  XLA_EXT_RETURN_IF_ERROR(CheckCacheDType(kTarget, kv_cache));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "key", key, 3));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "key", key, dtype));
  XLA_EXT_RETURN_IF_ERROR(CheckSameShape(kTarget, "value", value, "key", key));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "value", value, dtype));
  const auto k = key.dimensions();
  const auto c = kv_cache.dimensions();
  if (c[2] != 2 * k[1] || c[3] != k[2]) {
    return ArgumentError(kTarget, "kv_cache",
                         "shape [num_pages, page_size, " + std::to_string(2 * k[1]) + ", " +
                             std::to_string(k[2]) + "] (2 * num_kv_heads, head_size of key)",
                         "shape " + ShapeString(c));
  }
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "slot_mapping", slot_mapping, ffi::DataType::S32));
  if (slot_mapping.dimensions().size() != 1 || slot_mapping.dimensions()[0] != k[0]) {
    return ArgumentError(kTarget, "slot_mapping", "shape [" + std::to_string(k[0]) + "]",
                         "shape " + ShapeString(slot_mapping.dimensions()));
  }
  XLA_EXT_RETURN_IF_ERROR(CheckSameShape(kTarget, "kv_cache_out", kv_cache_out, "kv_cache",
                                         kv_cache));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "kv_cache_out", kv_cache_out, dtype));
  shapes = SlotShapes{k[0], c[0] * c[1], k[1],
                      static_cast<int64_t>(k[2] * ffi::ByteWidth(dtype))};
  return ffi::Error::Success();
}

struct RotaryShapes {
  int64_t num_tokens;
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t num_slots;  // num_pages * page_size
};

inline ffi::Error CheckRotary(const ffi::AnyBuffer& qkv, const ffi::AnyBuffer& cos,
                              const ffi::AnyBuffer& sin, const ffi::AnyBuffer& kv_cache,
                              const ffi::AnyBuffer& slot_mapping, const ffi::AnyBuffer& q_out,
                              const ffi::AnyBuffer& kv_cache_out, RotaryShapes& shapes) {
  constexpr const char* op = kRotaryTarget;
  XLA_EXT_RETURN_IF_ERROR(CheckRank(op, "qkv", qkv, 3));
  XLA_EXT_RETURN_IF_ERROR(CheckFloatType(op, "qkv", qkv));
  const ffi::DataType dtype = qkv.element_type();
  XLA_EXT_RETURN_IF_ERROR(CheckRank(op, "kv_cache", kv_cache, 4));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(op, "kv_cache", kv_cache, dtype));
  const auto x = qkv.dimensions();
  const auto c = kv_cache.dimensions();
  const int64_t num_kv_heads = c[2] / 2;
  if (c[2] % 2 != 0 || num_kv_heads == 0 || c[3] != x[2] || x[2] % 2 != 0) {
    return ArgumentError(op, "kv_cache",
                         "shape [num_pages, page_size, 2 * num_kv_heads, " + std::to_string(x[2]) +
                             "] (num_kv_heads >= 1; an even head_size, qkv's)",
                         "shape " + ShapeString(c));
  }
  if (x[1] <= 2 * num_kv_heads) {
    return ArgumentError(op, "qkv",
                         "shape [num_tokens, num_q_heads + 2 * num_kv_heads, head_size] with "
                         "num_q_heads >= 1 (num_kv_heads = " + std::to_string(num_kv_heads) +
                             ", kv_cache's)",
                         "shape " + ShapeString(x));
  }
  for (const auto& [name, table] : {std::pair<const char*, const ffi::AnyBuffer*>{"cos", &cos},
                                    {"sin", &sin}}) {
    XLA_EXT_RETURN_IF_ERROR(CheckDType(op, name, *table, dtype));
    const auto t = table->dimensions();
    if (t.size() != 2 || t[0] != x[0] || t[1] != x[2]) {
      return ArgumentError(op, name,
                           "shape [" + std::to_string(x[0]) + ", " + std::to_string(x[2]) +
                               "] (num_tokens, head_size of qkv)",
                           "shape " + ShapeString(t));
    }
  }
  XLA_EXT_RETURN_IF_ERROR(CheckDType(op, "slot_mapping", slot_mapping, ffi::DataType::S32));
  if (slot_mapping.dimensions().size() != 1 || slot_mapping.dimensions()[0] != x[0]) {
    return ArgumentError(op, "slot_mapping", "shape [" + std::to_string(x[0]) + "]",
                         "shape " + ShapeString(slot_mapping.dimensions()));
  }
  const int64_t num_q_heads = x[1] - 2 * num_kv_heads;
  const auto q = q_out.dimensions();
  XLA_EXT_RETURN_IF_ERROR(CheckDType(op, "q", q_out, dtype));
  if (q.size() != 3 || q[0] != x[0] || q[1] != num_q_heads || q[2] != x[2]) {
    return ArgumentError(op, "q",
                         "shape [" + std::to_string(x[0]) + ", " + std::to_string(num_q_heads) +
                             ", " + std::to_string(x[2]) + "]",
                         "shape " + ShapeString(q));
  }
  XLA_EXT_RETURN_IF_ERROR(CheckSameShape(op, "kv_cache_out", kv_cache_out, "kv_cache",
                                         kv_cache));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(op, "kv_cache_out", kv_cache_out, dtype));
  if (x[0] > INT32_MAX || x[1] * x[2] > INT32_MAX) {
    return ArgumentError(op, "qkv", "fewer than 2^31 tokens, and of elements per token",
                         "shape " + ShapeString(x));
  }
  shapes = RotaryShapes{x[0], num_q_heads, num_kv_heads, x[2], c[0] * c[1]};
  return ffi::Error::Success();
}

struct SliceShapes {
  int64_t num_new_rows;    // rows of kv
  int64_t num_cache_rows;  // rows of kv_cache
  int64_t max_slices;
  int64_t row_bytes;       // one row: num_combined_heads * head_size elements
};

inline ffi::Error CheckSlices(const ffi::AnyBuffer& kv, const ffi::AnyBuffer& slices,
                              const ffi::AnyBuffer& kv_cache, const ffi::AnyBuffer& num_slices,
                              int64_t page_size, int64_t num_slices_per_block,
                              const ffi::AnyBuffer& kv_cache_out, SliceShapes& shapes) {
  const ffi::DataType dtype = kv_cache.element_type();
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kSlicesTarget, "kv_cache", kv_cache, 3));
  XLA_EXT_RETURN_IF_ERROR(CheckCacheDType(kSlicesTarget, kv_cache));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kSlicesTarget, "kv", kv, 3));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kSlicesTarget, "kv", kv, dtype));
  const auto n = kv.dimensions();
  const auto c = kv_cache.dimensions();
  if (c[1] != n[1] || c[2] != n[2]) {
    return ArgumentError(kSlicesTarget, "kv_cache",
                         "shape [num_cache_rows, " + std::to_string(n[1]) + ", " +
                             std::to_string(n[2]) + "] (num_combined_heads, head_size of kv)",
                         "shape " + ShapeString(c));
  }
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kSlicesTarget, "slot_mapping", slices, ffi::DataType::S32));
  if (slices.dimensions().size() != 2 || slices.dimensions()[0] != 3) {
    return ArgumentError(kSlicesTarget, "slot_mapping",
                         "shape [3, max_slices] (cache_start, new_kv_start, length)",
                         "shape " + ShapeString(slices.dimensions()));
  }
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kSlicesTarget, "num_kv_update_slices", num_slices,
                                     ffi::DataType::S32));
  if (num_slices.element_count() != 1) {
    return ArgumentError(kSlicesTarget, "num_kv_update_slices", "one element",
                         "shape " + ShapeString(num_slices.dimensions()));
  }
  if (page_size <= 0 || c[0] % page_size != 0) {
    return ArgumentError(kSlicesTarget, "page_size",
                         "a positive divisor of num_cache_rows = " + std::to_string(c[0]),
                         std::to_string(page_size));
  }
  if (num_slices_per_block <= 0) {
    return ArgumentError(kSlicesTarget, "num_slices_per_block", "a positive integer",
                         std::to_string(num_slices_per_block));
  }
  XLA_EXT_RETURN_IF_ERROR(CheckSameShape(kSlicesTarget, "kv_cache_out", kv_cache_out,
                                         "kv_cache", kv_cache));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kSlicesTarget, "kv_cache_out", kv_cache_out, dtype));
  shapes = SliceShapes{n[0], c[0], slices.dimensions()[1],
                       static_cast<int64_t>(n[1] * n[2] * ffi::ByteWidth(dtype))};
  return ffi::Error::Success();
}

// The slices in use (data_checks.h): entry 0 is the count num_kv_update_slices[0], within
// [0, max_slices]; entry 1 + i is column i, when it is in use: within both buffers.
struct SliceChecks {
  static constexpr int32_t kCount = 1;  // values: count, max_slices
  static constexpr int32_t kSlice = 2;  // values: column, cache_start, new_kv_start, length,
                                        //         num_new_rows, num_cache_rows

  const int32_t* slices;  // [3, max_slices]
  const int32_t* num_slices;
  int64_t max_slices;
  int64_t num_new_rows;
  int64_t num_cache_rows;

  XLA_EXT_HOST_DEVICE int64_t num_entries() const { return 1 + max_slices; }

  XLA_EXT_HOST_DEVICE Violation Check(int64_t entry) const {
    const int64_t count = *num_slices;
    const bool count_ok = count >= 0 && count <= max_slices;
    if (entry == 0) return count_ok ? Violation{} : Violation{kCount, {count, max_slices}};
    const int64_t i = entry - 1;
    if (!count_ok || i >= count) return Violation{};
    const int64_t cache_start = slices[i];
    const int64_t new_start = slices[max_slices + i];
    const int64_t length = slices[2 * max_slices + i];
    if (length >= 0 && cache_start >= 0 && new_start >= 0 &&
        cache_start + length <= num_cache_rows && new_start + length <= num_new_rows) {
      return Violation{};
    }
    return Violation{kSlice, {i, cache_start, new_start, length, num_new_rows, num_cache_rows}};
  }

  static ffi::Error Describe(const Violation& v) {
    if (v.check == kCount) {
      return ArgumentError(kSlicesTarget, "num_kv_update_slices",
                           "a count in [0, max_slices = " + std::to_string(v.values[1]) + "]",
                           Entry("num_kv_update_slices", 0, v.values[0]));
    }
    const std::string at = "[" + std::to_string(v.values[0]) + "]";
    return ArgumentError(
        kSlicesTarget, "slot_mapping",
        "slices within kv (" + std::to_string(v.values[4]) + " rows) and kv_cache (" +
            std::to_string(v.values[5]) + " rows)",
        "cache_start" + at + " = " + std::to_string(v.values[1]) + ", new_kv_start" + at +
            " = " + std::to_string(v.values[2]) + ", length" + at + " = " +
            std::to_string(v.values[3]));
  }
};

// Both platforms bind the same arguments, attributes and results, after their contexts.
template <typename Binding>
auto BindSlots(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // key
      .template Arg<ffi::AnyBuffer>()  // value
      .template Arg<ffi::AnyBuffer>()  // kv_cache
      .template Arg<ffi::AnyBuffer>()  // slot_mapping
      .template Ret<ffi::AnyBuffer>();  // kv_cache_out
}

template <typename Binding>
auto BindSlices(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // kv
      .template Arg<ffi::AnyBuffer>()  // slot_mapping: the slices
      .template Arg<ffi::AnyBuffer>()  // kv_cache
      .template Arg<ffi::AnyBuffer>()  // num_kv_update_slices
      .template Attr<int64_t>("num_slices_per_block")
      .template Attr<int64_t>("page_size")
      .template Ret<ffi::AnyBuffer>();  // kv_cache_out
}

template <typename Binding>
auto BindRotary(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()   // qkv
      .template Arg<ffi::AnyBuffer>()   // cos
      .template Arg<ffi::AnyBuffer>()   // sin
      .template Arg<ffi::AnyBuffer>()   // kv_cache
      .template Arg<ffi::AnyBuffer>()   // slot_mapping
      .template Ret<ffi::AnyBuffer>()   // q
      .template Ret<ffi::AnyBuffer>();  // kv_cache_out
}

// One rotated pair of elements (j and j + head_size / 2 of a head's row), as torch rounds
// x * cos + rotate_half(x) * sin in eager: each product, then the sum, in the dtype (To), with
// no fused multiply-add (Mul and Add are exact-rounding float operations).
template <typename To, typename Mul, typename Add>
XLA_EXT_HOST_DEVICE inline void RotatePair(float x1, float x2, float cos1, float cos2,
                                           float sin1, float sin2, To to, Mul mul, Add add,
                                           float& out1, float& out2) {
  out1 = to(add(to(mul(x1, cos1)), to(mul(-x2, sin1))));
  out2 = to(add(to(mul(x2, cos2)), to(mul(x1, sin2))));
}

}  // namespace xla_ext::kv_cache_update

#endif  // XLA_EXT_KERNELS_KV_CACHE_UPDATE_KV_CACHE_UPDATE_H_
