// CUDA xla_ext.kv_cache_update and xla_ext.kv_cache_update_slices: one CTA per token (or
// slice) copies its rows with 16-byte words where every address allows, else narrower ones.
// The launch reads nothing on the host but the static shapes, so a call costs the same
// whatever the data, and fits XLA's command buffers.
#include <cstdint>
#include <iterator>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/debug_checks.cuh"
#include "kernels/kv_cache_update/kv_cache_update.h"
#include "xla_ext/registry.h"

namespace xla_ext::kv_cache_update {
namespace {

constexpr int kThreads = 128;

// Copies token `blockIdx.x`'s key and value rows into combined heads 2h and 2h + 1 of its slot.
template <typename Word>
__global__ void __launch_bounds__(kThreads)
    WriteSlotsKernel(const Word* __restrict__ key, const Word* __restrict__ value,
                     Word* __restrict__ cache, const int32_t* __restrict__ slot_mapping,
                     int64_t num_slots, int64_t num_kv_heads, int64_t row_words) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;  // skipped, or out of range (see the header)
  const int64_t token_words = num_kv_heads * row_words;
  Word* dst = cache + slot * 2 * token_words;
  for (int64_t i = threadIdx.x; i < token_words; i += kThreads) {
    const int64_t head = i / row_words;
    const int64_t within = i - head * row_words;
    dst[(2 * head) * row_words + within] = key[token * token_words + i];
    dst[(2 * head + 1) * row_words + within] = value[token * token_words + i];
  }
}

// Copies slice `blockIdx.x` (a column of `slices`) when it is in use and fits both buffers.
template <typename Word>
__global__ void __launch_bounds__(kThreads)
    WriteSlicesKernel(const Word* __restrict__ kv, Word* __restrict__ cache,
                      const int32_t* __restrict__ slices, const int32_t* __restrict__ num_slices,
                      int64_t max_slices, int64_t num_new_rows, int64_t num_cache_rows,
                      int64_t row_words) {
  const int64_t i = blockIdx.x;
  const int64_t count = *num_slices;
  if (count < 0 || count > max_slices || i >= count) return;
  const int64_t cache_start = slices[i];
  const int64_t new_start = slices[max_slices + i];
  const int64_t length = slices[2 * max_slices + i];
  if (length <= 0 || cache_start < 0 || new_start < 0 || cache_start + length > num_cache_rows ||
      new_start + length > num_new_rows) {
    return;
  }
  const int64_t words = length * row_words;
  for (int64_t w = threadIdx.x; w < words; w += kThreads) {
    cache[cache_start * row_words + w] = kv[new_start * row_words + w];
  }
}

// The widest word (16, 4 or 2 bytes, or 1 for fp8 rows) that divides every address and row.
int WordBytes(uintptr_t addresses) {
  for (int bytes : {16, 4, 2}) {
    if (addresses % bytes == 0) return bytes;
  }
  return 1;
}

template <typename Launch>
ffi::Error DispatchWord(int bytes, Launch&& launch) {
  switch (bytes) {
    case 16: launch(uint4{}); break;
    case 4: launch(uint32_t{}); break;
    case 2: launch(uint16_t{}); break;
    case 1: launch(uint8_t{}); break;
    default:
      return ffi::Error::Internal(std::string(kTarget) + ": no copy kernel for " +
                                  std::to_string(bytes) + "-byte words");
  }
  return ffi::Error::Success();
}

ffi::Error KvCacheUpdateCuda(cudaStream_t stream, ffi::AnyBuffer key, ffi::AnyBuffer value,
                             ffi::AnyBuffer kv_cache, ffi::AnyBuffer slot_mapping,
                             ffi::Result<ffi::AnyBuffer> kv_cache_out) {
  SlotShapes s;
  XLA_EXT_RETURN_IF_ERROR(CheckSlots(key, value, kv_cache, slot_mapping, *kv_cache_out, s));
  if (cuda::DebugChecksEnabled()) {
    XLA_EXT_RETURN_IF_ERROR(cuda::DebugCheck(
        kTarget, stream,
        SlotMappingChecks{static_cast<const int32_t*>(slot_mapping.untyped_data()),
                          s.num_tokens, s.num_slots}));
  }
  XLA_EXT_RETURN_IF_ERROR(cuda::CopyUnlessAliased(kTarget, kv_cache, *kv_cache_out, stream));
  if (s.num_tokens == 0 || s.row_bytes == 0 || s.num_kv_heads == 0) {
    return ffi::Error::Success();
  }
  if (s.num_tokens > INT32_MAX) {
    return ArgumentError(kTarget, "key", "fewer than 2^31 tokens",
                         "shape " + ShapeString(key.dimensions()));
  }
  const int bytes = WordBytes(reinterpret_cast<uintptr_t>(key.untyped_data()) |
                              reinterpret_cast<uintptr_t>(value.untyped_data()) |
                              reinterpret_cast<uintptr_t>(kv_cache_out->untyped_data()) |
                              static_cast<uintptr_t>(s.row_bytes));
  XLA_EXT_RETURN_IF_ERROR(DispatchWord(bytes, [&](auto word) {
    using Word = decltype(word);
    WriteSlotsKernel<Word><<<static_cast<unsigned>(s.num_tokens), kThreads, 0, stream>>>(
        static_cast<const Word*>(key.untyped_data()),
        static_cast<const Word*>(value.untyped_data()),
        static_cast<Word*>(kv_cache_out->untyped_data()),
        static_cast<const int32_t*>(slot_mapping.untyped_data()), s.num_slots, s.num_kv_heads,
        s.row_bytes / static_cast<int64_t>(sizeof(Word)));
  }));
  return cuda::LastLaunchError(kTarget);
}

ffi::Error KvCacheUpdateSlicesCuda(cudaStream_t stream, ffi::AnyBuffer kv, ffi::AnyBuffer slices,
                                   ffi::AnyBuffer kv_cache, ffi::AnyBuffer num_slices,
                                   int64_t num_slices_per_block, int64_t page_size,
                                   ffi::Result<ffi::AnyBuffer> kv_cache_out) {
  SliceShapes s;
  XLA_EXT_RETURN_IF_ERROR(CheckSlices(kv, slices, kv_cache, num_slices, page_size,
                                      num_slices_per_block, *kv_cache_out, s));
  if (cuda::DebugChecksEnabled()) {
    XLA_EXT_RETURN_IF_ERROR(cuda::DebugCheck(
        kSlicesTarget, stream,
        SliceChecks{static_cast<const int32_t*>(slices.untyped_data()),
                    static_cast<const int32_t*>(num_slices.untyped_data()), s.max_slices,
                    s.num_new_rows, s.num_cache_rows}));
  }
  XLA_EXT_RETURN_IF_ERROR(
      cuda::CopyUnlessAliased(kSlicesTarget, kv_cache, *kv_cache_out, stream));
  if (s.max_slices == 0 || s.row_bytes == 0) return ffi::Error::Success();
  if (s.max_slices > INT32_MAX) {
    return ArgumentError(kSlicesTarget, "slot_mapping", "fewer than 2^31 columns",
                         "shape " + ShapeString(slices.dimensions()));
  }
  const int bytes = WordBytes(reinterpret_cast<uintptr_t>(kv.untyped_data()) |
                              reinterpret_cast<uintptr_t>(kv_cache_out->untyped_data()) |
                              static_cast<uintptr_t>(s.row_bytes));
  XLA_EXT_RETURN_IF_ERROR(DispatchWord(bytes, [&](auto word) {
    using Word = decltype(word);
    WriteSlicesKernel<Word><<<static_cast<unsigned>(s.max_slices), kThreads, 0, stream>>>(
        static_cast<const Word*>(kv.untyped_data()),
        static_cast<Word*>(kv_cache_out->untyped_data()),
        static_cast<const int32_t*>(slices.untyped_data()),
        static_cast<const int32_t*>(num_slices.untyped_data()), s.max_slices, s.num_new_rows,
        s.num_cache_rows, s.row_bytes / static_cast<int64_t>(sizeof(Word)));
  }));
  return cuda::LastLaunchError(kSlicesTarget);
}

// Command-buffer compatible: what the launches depend on besides the shapes (whether XLA
// aliased the cache, the buffers' alignment) is the buffers' addresses, and XLA records a
// custom call into a command buffer again when they change.
XLA_FFI_DEFINE_HANDLER(kKvCacheUpdateCuda, KvCacheUpdateCuda,
                       BindSlots(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kKvCacheUpdateSlicesCuda, KvCacheUpdateSlicesCuda,
                       BindSlices(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kKvCacheUpdateCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_KERNEL(kSlicesTarget, "CUDA", kKvCacheUpdateSlicesCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, nullptr});
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kSlicesTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, nullptr});

}  // namespace xla_ext::kv_cache_update
