// CUDA xla_ext.paged_attention, in the style of vLLM's paged_attention_v2 and FlashInfer's
// decode kernel. Decode attention reads every K and V row once and does little arithmetic
// per byte, so the kernel is built to stream the cache at memory bandwidth:
// - One CTA per (sequence, partition of kPartition tokens, chunk of up to 8 query heads of
//   one kv head): the query heads of a GQA group share each K/V row the CTA loads.
// - A token's row for one kv head (head_size contiguous elements) is read by kLanes threads
//   with 16-byte loads; kUnroll tokens per thread are loaded before any is used, so enough
//   bytes are in flight to cover memory latency.
// - Logits of the partition live in shared memory; softmax; then the V pass, in f32.
// - With one partition the CTA writes the output; otherwise it writes (max, sum, unnormalised
//   output) into scratch and a second kernel combines the partitions.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/paged_attention/paged_attention.h"
#include "xla_ext/registry.h"

namespace xla_ext::paged_attention {
namespace {

// Build-time tuning knobs (tools/device/tune_paged_attention.sh measures them); the defaults
// are the fastest measured on an H100 (bench/results/).
#ifndef XLA_EXT_PAGED_ATTENTION_PARTITION
#define XLA_EXT_PAGED_ATTENTION_PARTITION 512
#endif
#ifndef XLA_EXT_PAGED_ATTENTION_UNROLL
#define XLA_EXT_PAGED_ATTENTION_UNROLL 4
#endif

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kPartition = XLA_EXT_PAGED_ATTENTION_PARTITION;  // tokens per CTA
constexpr int kUnroll = XLA_EXT_PAGED_ATTENTION_UNROLL;  // tokens a thread loads before use
constexpr int kMaxHeadsPerCta = 8;

struct Params {
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const float* alibi_slopes;  // null: no ALiBi
  void* out;
  // Per (seq, head, partition), used when num_partitions > 1.
  float* partial_max;
  float* partial_sum;
  float* partial_out;  // [num_seqs, num_heads, num_partitions, head_size]
  int num_heads;
  int num_kv_heads;
  int num_blocks;
  int max_blocks_per_seq;
  int log2_block_size;  // block sizes are powers of two: token -> block is a shift
  int num_partitions;
  int head_chunks_per_kv_head;
  float scale;
  float softcap;
};

template <typename T, int kHeadSize>
struct Layout {
  static constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  static constexpr int kVecsPerRow = kHeadSize / kVec;
  // Threads reading one row: a power of two (for the shuffle reduction), at most a warp.
  static constexpr int kLanes = kVecsPerRow > 16 ? 32 : kVecsPerRow > 8 ? 16 : 8;
  static constexpr int kVecsPerLane = (kVecsPerRow + kLanes - 1) / kLanes;
  static constexpr int kSlots = kThreads / kLanes;  // tokens a CTA reads at once
  static_assert(kPartition % (kSlots * kUnroll) == 0, "a partition is whole iterations");
};

// The clamped length the CUDA path uses (see paged_attention.h).
__device__ __forceinline__ int SeqLen(const Params& p, int seq) {
  const int capacity = p.max_blocks_per_seq << p.log2_block_size;
  return min(max(p.seq_lens[seq], 0), capacity);
}

// Element offset of token t's row for kv_head, or -1 when its block id is outside the cache.
__device__ __forceinline__ int64_t RowOffset(const Params& p, const int32_t* blocks, int t,
                                             int kv_head, int head_size) {
  const int block = blocks[t >> p.log2_block_size];
  if (block < 0 || block >= p.num_blocks) return -1;
  const int64_t slot =
      (static_cast<int64_t>(block) << p.log2_block_size) + (t & ((1 << p.log2_block_size) - 1));
  return (slot * p.num_kv_heads + kv_head) * head_size;
}

template <typename T, int kHeadSize, int kHeads>
__global__ void __launch_bounds__(kThreads) AttendPartitionKernel(Params p) {
  using L = Layout<T, kHeadSize>;
  constexpr int kSmemFloats = kHeads * kPartition > kWarps * kHeads * kHeadSize
                                  ? kHeads * kPartition
                                  : kWarps * kHeads * kHeadSize;
  // Logits [kHeads][kPartition] during the passes, then [kWarps][kHeads][kHeadSize] partial
  // outputs for the cross-warp sum.
  __shared__ float smem[kSmemFloats];
  __shared__ float head_max[kHeads];
  __shared__ float head_sum[kHeads];

  const int seq = blockIdx.x / p.num_partitions;
  const int partition = blockIdx.x % p.num_partitions;
  const int kv_head = blockIdx.y / p.head_chunks_per_kv_head;
  const int first_head = kv_head * (p.num_heads / p.num_kv_heads) +
                         (blockIdx.y % p.head_chunks_per_kv_head) * kHeads;
  const int seq_len = SeqLen(p, seq);
  const int start = partition * kPartition;
  const int end = min(start + kPartition, seq_len);
  const bool direct = p.num_partitions == 1;
  T* out = static_cast<T*>(p.out);

  if (start >= end) {
    // Empty sequence; a partition past the end is never read by the combine kernel.
    if (direct) {
      for (int i = threadIdx.x; i < kHeads * kHeadSize; i += kThreads) {
        out[(static_cast<int64_t>(seq) * p.num_heads + first_head) * kHeadSize + i] =
            cuda::FromFloat<T>(0.0f);
      }
    }
    return;
  }

  const int lane = threadIdx.x % L::kLanes;
  const int slot = threadIdx.x / L::kLanes;
  const int32_t* blocks = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;

  // The scaled query slices this thread multiplies with.
  float q[kHeads][L::kVecsPerLane][L::kVec];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    const T* q_row = static_cast<const T*>(p.query) +
                     (static_cast<int64_t>(seq) * p.num_heads + first_head + h) * kHeadSize;
#pragma unroll
    for (int i = 0; i < L::kVecsPerLane; ++i) {
      const int v = lane + i * L::kLanes;
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (v < L::kVecsPerRow) raw = reinterpret_cast<const uint4*>(q_row)[v];
      const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) q[h][i][e] = p.scale * cuda::ToFloat(x[e]);
    }
  }

  // Loads the rows of tokens base + u * kSlots + slot (zeros for tokens past the end or in
  // an invalid block) and reports which are valid.
  auto load_rows = [&](const T* cache, int base, uint4 (&rows)[kUnroll][L::kVecsPerLane],
                       bool (&valid)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * L::kSlots + slot;
      const int64_t offset = t < end ? RowOffset(p, blocks, t, kv_head, kHeadSize) : -1;
      valid[u] = offset >= 0;
#pragma unroll
      for (int i = 0; i < L::kVecsPerLane; ++i) {
        const int v = lane + i * L::kLanes;
        rows[u][i] = make_uint4(0, 0, 0, 0);
        if (valid[u] && v < L::kVecsPerRow) {
          rows[u][i] = __ldg(reinterpret_cast<const uint4*>(cache + offset) + v);
        }
      }
    }
  };

  // K pass: logits of every token of the partition.
  float* logits = smem;
  const T* key_cache = static_cast<const T*>(p.key_cache);
  for (int base = start; base < end; base += L::kSlots * kUnroll) {
    uint4 rows[kUnroll][L::kVecsPerLane];
    bool valid[kUnroll];
    load_rows(key_cache, base, rows, valid);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float dot[kHeads];
#pragma unroll
      for (int h = 0; h < kHeads; ++h) dot[h] = 0.0f;
#pragma unroll
      for (int i = 0; i < L::kVecsPerLane; ++i) {
        const T* k = reinterpret_cast<const T*>(&rows[u][i]);
#pragma unroll
        for (int e = 0; e < L::kVec; ++e) {
          const float kf = cuda::ToFloat(k[e]);
#pragma unroll
          for (int h = 0; h < kHeads; ++h) dot[h] += q[h][i][e] * kf;
        }
      }
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
#pragma unroll
        for (int offset = L::kLanes / 2; offset > 0; offset /= 2) {
          dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], offset);
        }
      }
      const int t = base + u * L::kSlots + slot;
      if (lane == 0 && t < end) {
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          float logit = dot[h];
          if (p.softcap > 0.0f) logit = p.softcap * tanhf(logit / p.softcap);
          if (p.alibi_slopes != nullptr) {
            logit += p.alibi_slopes[first_head + h] * static_cast<float>(t - (seq_len - 1));
          }
          logits[h * kPartition + (t - start)] = valid[u] ? logit : -INFINITY;
        }
      }
    }
  }
  __syncthreads();

  // Softmax over the partition, one warp per head: logits become exp(logit - max).
  const int warp = threadIdx.x / 32;
  const int warp_lane = threadIdx.x % 32;
  for (int h = warp; h < kHeads; h += kWarps) {
    float* row = logits + h * kPartition;
    float m = -INFINITY;
    for (int t = warp_lane; t < end - start; t += 32) m = fmaxf(m, row[t]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    float sum = 0.0f;
    for (int t = warp_lane; t < end - start; t += 32) {
      const float e = m == -INFINITY ? 0.0f : __expf(row[t] - m);  // all skipped: weight 0
      row[t] = e;
      sum += e;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    if (warp_lane == 0) {
      head_max[h] = m;
      head_sum[h] = sum;
    }
  }
  __syncthreads();

  // V pass: this thread's slot accumulates its tokens' weighted rows.
  float acc[kHeads][L::kVecsPerLane][L::kVec];
#pragma unroll
  for (int h = 0; h < kHeads; ++h)
#pragma unroll
    for (int i = 0; i < L::kVecsPerLane; ++i)
#pragma unroll
      for (int e = 0; e < L::kVec; ++e) acc[h][i][e] = 0.0f;
  const T* value_cache = static_cast<const T*>(p.value_cache);
  for (int base = start; base < end; base += L::kSlots * kUnroll) {
    uint4 rows[kUnroll][L::kVecsPerLane];
    bool valid[kUnroll];
    load_rows(value_cache, base, rows, valid);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!valid[u]) continue;
      const int t = base + u * L::kSlots + slot;
      float weight[kHeads];
#pragma unroll
      for (int h = 0; h < kHeads; ++h) weight[h] = logits[h * kPartition + (t - start)];
#pragma unroll
      for (int i = 0; i < L::kVecsPerLane; ++i) {
        const T* v = reinterpret_cast<const T*>(&rows[u][i]);
#pragma unroll
        for (int e = 0; e < L::kVec; ++e) {
          const float vf = cuda::ToFloat(v[e]);
#pragma unroll
          for (int h = 0; h < kHeads; ++h) acc[h][i][e] += weight[h] * vf;
        }
      }
    }
  }

  // Sum the slots: within a warp by shuffles, across warps through shared memory (which the
  // logits no longer need).
#pragma unroll
  for (int h = 0; h < kHeads; ++h)
#pragma unroll
    for (int i = 0; i < L::kVecsPerLane; ++i)
#pragma unroll
      for (int e = 0; e < L::kVec; ++e)
#pragma unroll
        for (int offset = L::kLanes; offset < 32; offset *= 2) {
          acc[h][i][e] += __shfl_xor_sync(0xffffffffu, acc[h][i][e], offset);
        }
  __syncthreads();
  float* warp_out = smem;
  if (warp_lane < L::kLanes) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h)
#pragma unroll
      for (int i = 0; i < L::kVecsPerLane; ++i) {
        const int v = lane + i * L::kLanes;
        if (v < L::kVecsPerRow) {
#pragma unroll
          for (int e = 0; e < L::kVec; ++e) {
            warp_out[(warp * kHeads + h) * kHeadSize + v * L::kVec + e] = acc[h][i][e];
          }
        }
      }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < kHeads * kHeadSize; idx += kThreads) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_out[w * kHeads * kHeadSize + idx];
    const int h = idx / kHeadSize;
    const int64_t seq_head = static_cast<int64_t>(seq) * p.num_heads + first_head + h;
    if (direct) {
      const float inv_sum = head_sum[h] > 0.0f ? 1.0f / head_sum[h] : 0.0f;
      out[seq_head * kHeadSize + idx % kHeadSize] = cuda::FromFloat<T>(total * inv_sum);
    } else {
      p.partial_out[(seq_head * p.num_partitions + partition) * kHeadSize + idx % kHeadSize] =
          total;
    }
  }
  if (!direct && threadIdx.x < kHeads) {
    const int64_t seq_head = static_cast<int64_t>(seq) * p.num_heads + first_head + threadIdx.x;
    p.partial_max[seq_head * p.num_partitions + partition] = head_max[threadIdx.x];
    p.partial_sum[seq_head * p.num_partitions + partition] = head_sum[threadIdx.x];
  }
}

// One CTA per (seq, head): rescales each used partition's result to the global max and
// normalises by the total sum. Shared memory: num_partitions weights.
template <typename T, int kHeadSize>
__global__ void __launch_bounds__(kThreads) CombinePartitionsKernel(Params p) {
  extern __shared__ float weights[];
  __shared__ float inv_total;
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int64_t seq_head = static_cast<int64_t>(seq) * p.num_heads + head;
  const int used = (SeqLen(p, seq) + kPartition - 1) / kPartition;
  const float* maxes = p.partial_max + seq_head * p.num_partitions;
  const float* sums = p.partial_sum + seq_head * p.num_partitions;

  if (threadIdx.x < 32) {
    float m = -INFINITY;
    for (int i = threadIdx.x; i < used; i += 32) m = fmaxf(m, maxes[i]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    float total = 0.0f;
    for (int i = threadIdx.x; i < used; i += 32) {
      // A partition whose tokens were all skipped has max -inf and sum 0.
      const float w = maxes[i] == -INFINITY ? 0.0f : __expf(maxes[i] - m);
      weights[i] = w;
      total += w * sums[i];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      total += __shfl_xor_sync(0xffffffffu, total, offset);
    }
    if (threadIdx.x == 0) inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  }
  __syncthreads();

  const float* partial = p.partial_out + seq_head * p.num_partitions * kHeadSize;
  T* out = static_cast<T*>(p.out) + seq_head * kHeadSize;
  for (int d = threadIdx.x; d < kHeadSize; d += kThreads) {
    float value = 0.0f;
    for (int i = 0; i < used; ++i) value += weights[i] * partial[i * kHeadSize + d];
    out[d] = cuda::FromFloat<T>(value * inv_total);
  }
}

template <typename T, int kHeadSize, int kHeads>
void LaunchAttend(const Params& p, int num_seqs, cudaStream_t stream) {
  const dim3 grid(num_seqs * p.num_partitions, p.num_kv_heads * p.head_chunks_per_kv_head);
  AttendPartitionKernel<T, kHeadSize, kHeads><<<grid, kThreads, 0, stream>>>(p);
}

template <typename T, int kHeadSize>
void Launch(const Params& p, int num_seqs, int heads_per_cta, cudaStream_t stream) {
  switch (heads_per_cta) {
    case 8: LaunchAttend<T, kHeadSize, 8>(p, num_seqs, stream); break;
    case 4: LaunchAttend<T, kHeadSize, 4>(p, num_seqs, stream); break;
    case 2: LaunchAttend<T, kHeadSize, 2>(p, num_seqs, stream); break;
    default: LaunchAttend<T, kHeadSize, 1>(p, num_seqs, stream); break;
  }
  if (p.num_partitions > 1) {
    CombinePartitionsKernel<T, kHeadSize>
        <<<dim3(p.num_heads, num_seqs), kThreads, p.num_partitions * sizeof(float), stream>>>(p);
  }
}

template <typename T>
void LaunchForHeadSize(const Params& p, int num_seqs, int head_size, int heads_per_cta,
                       cudaStream_t stream) {
  switch (head_size) {
    case 64: Launch<T, 64>(p, num_seqs, heads_per_cta, stream); break;
    case 80: Launch<T, 80>(p, num_seqs, heads_per_cta, stream); break;
    case 96: Launch<T, 96>(p, num_seqs, heads_per_cta, stream); break;
    case 112: Launch<T, 112>(p, num_seqs, heads_per_cta, stream); break;
    case 128: Launch<T, 128>(p, num_seqs, heads_per_cta, stream); break;
    default: Launch<T, 256>(p, num_seqs, heads_per_cta, stream); break;
  }
}

// The largest power of two up to kMaxHeadsPerCta dividing the GQA group: a CTA then
// serves whole chunks of one kv head's query heads.
int HeadsPerCta(int64_t group_size) {
  int heads = kMaxHeadsPerCta;
  while (group_size % heads != 0) heads /= 2;
  return heads;
}

ffi::Error PagedAttentionCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                              ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                              ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                              ffi::AnyBuffer seq_lens, ffi::AnyBuffer alibi_slopes,
                              ffi::Result<ffi::AnyBuffer> out, float scale, float softcap) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(
      Check(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, *out, s));
  if (s.num_seqs == 0 || s.num_heads == 0) return ffi::Error::Success();
  // 16-byte row loads: XLA's buffers are aligned; a misaligned view would fault.
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(query.untyped_data()) |
                              reinterpret_cast<uintptr_t>(key_cache.untyped_data()) |
                              reinterpret_cast<uintptr_t>(value_cache.untyped_data());
  if (addresses % 16 != 0) {
    return ArgumentError(kTarget, "query, key_cache, value_cache", "16-byte aligned buffers",
                         "a misaligned buffer");
  }
  const int64_t num_partitions = std::max<int64_t>(1, (s.capacity() + kPartition - 1) / kPartition);
  if (num_partitions * static_cast<int64_t>(sizeof(float)) > 48 * 1024 ||
      s.num_seqs * num_partitions > INT32_MAX) {
    return ArgumentError(kTarget, "block_tables",
                         "at most " + std::to_string(12 * 1024 * kPartition) +
                             " tokens per sequence and num_seqs * partitions < 2^31",
                         "shape " + ShapeString(block_tables.dimensions()));
  }

  const int heads_per_cta = HeadsPerCta(s.group_size());
  Params p{};
  p.query = query.untyped_data();
  p.key_cache = key_cache.untyped_data();
  p.value_cache = value_cache.untyped_data();
  p.block_tables = static_cast<const int32_t*>(block_tables.untyped_data());
  p.seq_lens = static_cast<const int32_t*>(seq_lens.untyped_data());
  p.alibi_slopes = s.has_alibi ? static_cast<const float*>(alibi_slopes.untyped_data()) : nullptr;
  p.out = out->untyped_data();
  p.num_heads = static_cast<int>(s.num_heads);
  p.num_kv_heads = static_cast<int>(s.num_kv_heads);
  p.num_blocks = static_cast<int>(std::min<int64_t>(s.num_blocks, INT32_MAX));
  p.max_blocks_per_seq = static_cast<int>(s.max_blocks_per_seq);
  p.log2_block_size = s.block_size == 8 ? 3 : s.block_size == 16 ? 4 : 5;
  p.num_partitions = static_cast<int>(num_partitions);
  p.head_chunks_per_kv_head = static_cast<int>(s.group_size() / heads_per_cta);
  p.scale = scale;
  p.softcap = softcap;

  if (num_partitions > 1) {
    const int64_t rows = s.num_seqs * s.num_heads * num_partitions;
    const size_t bytes = static_cast<size_t>(rows * (2 + s.head_size)) * sizeof(float);
    // XLA refuses alignments above 16 bytes (its FFI DeviceMemory_Allocate).
    std::optional<void*> buffer = scratch.Allocate(bytes, 16);
    if (!buffer.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        std::string(kTarget) + ": cannot allocate " + std::to_string(bytes) +
                            " bytes of scratch for the partitions");
    }
    p.partial_out = static_cast<float*>(*buffer);
    p.partial_max = p.partial_out + rows * s.head_size;
    p.partial_sum = p.partial_max + rows;
  }

  cuda::DispatchFloat(query.element_type(), [&](auto zero) {
    using T = decltype(zero);
    LaunchForHeadSize<T>(p, static_cast<int>(s.num_seqs), static_cast<int>(s.head_size),
                         heads_per_cta, stream);
    return 0;
  });
  return cuda::LastLaunchError(kTarget);
}

// Not command-buffer compatible: the scratch for the partitions comes from the
// ScratchAllocator at every call, which a recorded command buffer cannot repeat.
XLA_FFI_DEFINE_HANDLER(kPagedAttentionCuda, PagedAttentionCuda,
                       Bind(ffi::Ffi::Bind()
                                .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                .Ctx<ffi::ScratchAllocator>()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kPagedAttentionCuda, XLA_EXT_NO_TRAITS);

}  // namespace xla_ext::paged_attention
