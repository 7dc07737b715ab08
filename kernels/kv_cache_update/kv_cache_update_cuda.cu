// CUDA xla_ext.kv_cache_update, xla_ext.kv_cache_update_slices and
// xla_ext.rotary_kv_cache_update: one CTA per token (or slice) copies (or rotates) its rows
// with 16-byte words where every address allows, else narrower ones. The launch reads nothing
// on the host but the static shapes, so a call costs the same whatever the data, and fits
// XLA's command buffers.
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

// Token `blockIdx.x`'s q and k heads rotated (rotate-half, kv_cache_update.h) into its q rows
// and its slot's combined heads 2h, its v heads copied to 2h + 1. A thread takes kVec
// elements of a head's first half and the kVec at the same place in its second half, or kVec
// elements of a v row; a skipped slot (negative, or out of range: see the header) writes no
// cache row, but the q rows still.
// A token's rows are a few hundred such pieces of work: a CTA of kRotaryThreads takes them in
// one round (the 1B model's 32 + 8 + 8 heads of 64: 224), so that a step's call costs one
// memory round trip; its tokens are its CTAs.
constexpr int kRotaryThreads = 256;

template <typename T, int kVec>
__global__ void __launch_bounds__(kRotaryThreads)
    RotaryWriteKernel(const T* __restrict__ qkv, const T* __restrict__ cos,
                      const T* __restrict__ sin, T* __restrict__ q_out, T* __restrict__ cache,
                      const int32_t* __restrict__ slot_mapping, int64_t num_slots,
                      int num_q_heads, int num_kv_heads, int head_size) {
  // Aligned to its size: one 16-byte access where kVec * sizeof(T) is 16 (the launch checks
  // the addresses), not a copy element by element.
  struct alignas(sizeof(T) * kVec) Vec {
    T v[kVec];
  };
  const auto load = [](const T* p) { return *reinterpret_cast<const Vec*>(p); };
  const auto store = [](T* p, const Vec& x) { *reinterpret_cast<Vec*>(p) = x; };
  const int64_t token = blockIdx.x;
  const int half = head_size / 2;
  const int pair_vecs = half / kVec;  // per head
  const int64_t slot = slot_mapping[token];
  const bool writes = slot >= 0 && slot < num_slots;
  const T* row = qkv + token * (num_q_heads + 2 * num_kv_heads) * head_size;
  const T* cos_row = cos + token * head_size;
  const T* sin_row = sin + token * head_size;
  T* dst = cache + (writes ? slot : 0) * 2 * num_kv_heads * head_size;
  const int rotated = (num_q_heads + num_kv_heads) * pair_vecs;
  const int copied = num_kv_heads * 2 * pair_vecs;
  const auto to = [](float x) { return cuda::ToFloat(cuda::FromFloat<T>(x)); };
  const auto mul = [](float a, float b) { return __fmul_rn(a, b); };
  const auto add = [](float a, float b) { return __fadd_rn(a, b); };
  for (int i = threadIdx.x; i < rotated + copied; i += kRotaryThreads) {
    if (i < rotated) {
      const int head = i / pair_vecs;  // q heads, then k heads
      const int j = (i - head * pair_vecs) * kVec;
      const Vec x1 = load(row + head * head_size + j), x2 = load(row + head * head_size + half + j);
      const Vec c1 = load(cos_row + j), c2 = load(cos_row + half + j);
      const Vec s1 = load(sin_row + j), s2 = load(sin_row + half + j);
      Vec y1, y2;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        float out1, out2;
        RotatePair(cuda::ToFloat(x1.v[e]), cuda::ToFloat(x2.v[e]), cuda::ToFloat(c1.v[e]),
                   cuda::ToFloat(c2.v[e]), cuda::ToFloat(s1.v[e]), cuda::ToFloat(s2.v[e]), to,
                   mul, add, out1, out2);
        y1.v[e] = cuda::FromFloat<T>(out1);
        y2.v[e] = cuda::FromFloat<T>(out2);
      }
      T* out = head < num_q_heads ? q_out + (token * num_q_heads + head) * head_size
               : writes           ? dst + 2 * (head - num_q_heads) * head_size
                                  : nullptr;
      if (out != nullptr) {
        store(out + j, y1);
        store(out + half + j, y2);
      }
    } else if (writes) {
      const int v = i - rotated;
      const int head = v / (2 * pair_vecs);
      const int j = (v - head * 2 * pair_vecs) * kVec;
      store(dst + (2 * head + 1) * head_size + j,
            load(row + (num_q_heads + num_kv_heads + head) * head_size + j));
    }
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

template <typename T>
void LaunchRotary(const RotaryShapes& s, const ffi::AnyBuffer& qkv, const ffi::AnyBuffer& cos,
                  const ffi::AnyBuffer& sin, ffi::AnyBuffer& q_out, ffi::AnyBuffer& kv_cache_out,
                  const ffi::AnyBuffer& slot_mapping, cudaStream_t stream) {
  // 16 bytes per thread where the half row and every buffer allow it, else one element.
  constexpr int kWide = 16 / sizeof(T);
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(qkv.untyped_data()) |
                              reinterpret_cast<uintptr_t>(cos.untyped_data()) |
                              reinterpret_cast<uintptr_t>(sin.untyped_data()) |
                              reinterpret_cast<uintptr_t>(q_out.untyped_data()) |
                              reinterpret_cast<uintptr_t>(kv_cache_out.untyped_data());
  const bool wide = addresses % 16 == 0 && (s.head_size / 2) % kWide == 0;
  const auto launch = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(s.num_tokens), kRotaryThreads, 0, stream>>>(
        static_cast<const T*>(qkv.untyped_data()), static_cast<const T*>(cos.untyped_data()),
        static_cast<const T*>(sin.untyped_data()), static_cast<T*>(q_out.untyped_data()),
        static_cast<T*>(kv_cache_out.untyped_data()),
        static_cast<const int32_t*>(slot_mapping.untyped_data()), s.num_slots,
        static_cast<int>(s.num_q_heads), static_cast<int>(s.num_kv_heads),
        static_cast<int>(s.head_size));
  };
  if (wide) {
    launch(&RotaryWriteKernel<T, kWide>);
  } else {
    launch(&RotaryWriteKernel<T, 1>);
  }
}

ffi::Error RotaryKvCacheUpdateCuda(cudaStream_t stream, ffi::AnyBuffer qkv, ffi::AnyBuffer cos,
                                   ffi::AnyBuffer sin, ffi::AnyBuffer kv_cache,
                                   ffi::AnyBuffer slot_mapping, ffi::Result<ffi::AnyBuffer> q_out,
                                   ffi::Result<ffi::AnyBuffer> kv_cache_out) {
  RotaryShapes s;
  XLA_EXT_RETURN_IF_ERROR(
      CheckRotary(qkv, cos, sin, kv_cache, slot_mapping, *q_out, *kv_cache_out, s));
  if (cuda::DebugChecksEnabled()) {
    XLA_EXT_RETURN_IF_ERROR(cuda::DebugCheck(
        kRotaryTarget, stream,
        RotarySlotMappingChecks{static_cast<const int32_t*>(slot_mapping.untyped_data()),
                                s.num_tokens, s.num_slots}));
  }
  XLA_EXT_RETURN_IF_ERROR(cuda::CopyUnlessAliased(kRotaryTarget, kv_cache, *kv_cache_out, stream));
  if (s.num_tokens == 0) return ffi::Error::Success();
  XLA_EXT_RETURN_IF_ERROR(cuda::DispatchFloat(kRotaryTarget, qkv.element_type(), [&](auto zero) {
    LaunchRotary<decltype(zero)>(s, qkv, cos, sin, *q_out, *kv_cache_out, slot_mapping, stream);
  }));
  return cuda::LastLaunchError(kRotaryTarget);
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
XLA_FFI_DEFINE_HANDLER(kRotaryKvCacheUpdateCuda, RotaryKvCacheUpdateCuda,
                       BindRotary(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kKvCacheUpdateCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_KERNEL(kSlicesTarget, "CUDA", kKvCacheUpdateSlicesCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, nullptr});
XLA_EXT_REGISTER_KERNEL(kRotaryTarget, "CUDA", kRotaryKvCacheUpdateCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kSlicesTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, nullptr});
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{0, kRotaryTarget,
                                         static_cast<uint32_t>(std::size(kRotarySupported)),
                                         kRotarySupported, nullptr});

}  // namespace xla_ext::kv_cache_update
