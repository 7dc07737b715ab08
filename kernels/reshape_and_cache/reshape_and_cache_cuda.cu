// CUDA xla_ext.reshape_and_cache: one CTA per token copies its key and value rows (contiguous
// in both the input and the cache slot) with 16-byte loads and stores where aligned.
#include <cstdint>
#include <iterator>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/debug_checks.cuh"
#include "kernels/reshape_and_cache/reshape_and_cache.h"
#include "xla_ext/registry.h"

namespace xla_ext::reshape_and_cache {
namespace {

constexpr int kThreads = 128;

// Word is uint4 when every row starts 16-byte aligned, else the element type's width.
template <typename Word>
__global__ void __launch_bounds__(kThreads)
    WriteRowsKernel(const Word* __restrict__ key, const Word* __restrict__ value,
                    Word* __restrict__ key_cache, Word* __restrict__ value_cache,
                    const int64_t* __restrict__ slot_mapping, int64_t num_slots,
                    int64_t row_words) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // skipped, or out of range (see the header)
  for (int64_t i = threadIdx.x; i < row_words; i += kThreads) {
    key_cache[slot * row_words + i] = key[token * row_words + i];
    value_cache[slot * row_words + i] = value[token * row_words + i];
  }
}

template <typename Word>
void Launch(const Shapes& s, size_t row_bytes, const void* key, const void* value,
            void* key_cache, void* value_cache, const int64_t* slots, cudaStream_t stream) {
  WriteRowsKernel<Word><<<static_cast<unsigned>(s.num_tokens), kThreads, 0, stream>>>(
      static_cast<const Word*>(key), static_cast<const Word*>(value),
      static_cast<Word*>(key_cache), static_cast<Word*>(value_cache), slots, s.num_slots,
      static_cast<int64_t>(row_bytes / sizeof(Word)));
}

ffi::Error ReshapeAndCacheCuda(cudaStream_t stream, ffi::AnyBuffer key, ffi::AnyBuffer value,
                               ffi::AnyBuffer key_cache, ffi::AnyBuffer value_cache,
                               ffi::AnyBuffer slot_mapping,
                               ffi::Result<ffi::AnyBuffer> key_cache_out,
                               ffi::Result<ffi::AnyBuffer> value_cache_out) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(Check(key, value, key_cache, value_cache, slot_mapping, *key_cache_out,
                                *value_cache_out, s));
  if (cuda::DebugChecksEnabled()) {
    XLA_EXT_RETURN_IF_ERROR(cuda::DebugCheck(
        kTarget, stream,
        SlotMappingChecks{static_cast<const int64_t*>(slot_mapping.untyped_data()),
                          s.num_tokens, s.num_slots}));
  }
  XLA_EXT_RETURN_IF_ERROR(cuda::CopyUnlessAliased(kTarget, key_cache, *key_cache_out, stream));
  XLA_EXT_RETURN_IF_ERROR(
      cuda::CopyUnlessAliased(kTarget, value_cache, *value_cache_out, stream));
  if (s.num_tokens == 0 || s.row_elements == 0) return ffi::Error::Success();
  if (s.num_tokens > INT32_MAX) {
    return ArgumentError(kTarget, "key", "fewer than 2^31 tokens",
                         "shape " + ShapeString(key.dimensions()));
  }

  const size_t row_bytes = s.row_elements * ffi::ByteWidth(key.element_type());
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(key.untyped_data()) |
                              reinterpret_cast<uintptr_t>(value.untyped_data()) |
                              reinterpret_cast<uintptr_t>(key_cache_out->untyped_data()) |
                              reinterpret_cast<uintptr_t>(value_cache_out->untyped_data()) |
                              row_bytes;
  const auto* slots = static_cast<const int64_t*>(slot_mapping.untyped_data());
  const void* k = key.untyped_data();
  const void* v = value.untyped_data();
  void* kc = key_cache_out->untyped_data();
  void* vc = value_cache_out->untyped_data();
  if (addresses % 16 == 0) {
    Launch<uint4>(s, row_bytes, k, v, kc, vc, slots, stream);
  } else if (addresses % 4 == 0) {
    Launch<uint32_t>(s, row_bytes, k, v, kc, vc, slots, stream);
  } else {
    Launch<uint16_t>(s, row_bytes, k, v, kc, vc, slots, stream);
  }
  return cuda::LastLaunchError(kTarget);
}

// Not marked command-buffer compatible: whether the caches are copied first depends on
// whether XLA aliased the buffers, and recording that choice is untested.
XLA_FFI_DEFINE_HANDLER(kReshapeAndCacheCuda, ReshapeAndCacheCuda,
                       Bind(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kReshapeAndCacheCuda, XLA_EXT_NO_TRAITS);
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, nullptr});

}  // namespace xla_ext::reshape_and_cache
