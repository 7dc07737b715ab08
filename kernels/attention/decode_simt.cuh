// CUDA-core decode attention: any float dtype, any GPU (the path for f32, for GQA groups over
// 16 heads and for GPUs before Hopper), in the style of vLLM's paged_attention_v2:
// - One CTA per (sequence, partition of kPartition tokens, chunk of up to 8 query heads of
//   one kv head): the query heads of a GQA group share each K/V row the CTA loads.
// - A token's row for one kv head (head_size contiguous elements) is read by kLanes threads
//   with 16-byte loads; kUnroll tokens per thread are loaded before any is used, so enough
//   bytes are in flight to cover memory latency.
// - Logits of the partition live in shared memory; softmax; then the V pass, in f32.
#ifndef XLA_EXT_KERNELS_ATTENTION_DECODE_SIMT_CUH_
#define XLA_EXT_KERNELS_ATTENTION_DECODE_SIMT_CUH_

#include <cmath>
#include <cstdint>

#include "kernels/attention/split_kv.cuh"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/tuning.h"

namespace xla_ext::attention::decode::simt {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// The tuning knobs (kernels/common/tuning.h).
constexpr int kPartition = tuning::kDecodeSimtPartition;  // tokens per CTA
constexpr int kUnroll = tuning::kDecodeSimtUnroll;  // tokens a thread loads before use
constexpr int kMaxHeadsPerCta = 8;

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

// Where (head, seq, partition)'s record goes (split_kv.cuh: [num_heads, num_records]).
__device__ __forceinline__ int64_t Record(const Params& p, int head, int seq, int partition) {
  return static_cast<int64_t>(head) * p.num_records + seq * p.num_partitions + partition;
}

template <typename T, int kHeadSize, int kHeads>
__global__ void __launch_bounds__(kThreads) AttendSimtKernel(Params p,
                                                              int head_chunks_per_kv_head) {
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
  const int kv_head = blockIdx.y / head_chunks_per_kv_head;
  const int first_head = kv_head * (p.num_heads / p.num_kv_heads) +
                         (blockIdx.y % head_chunks_per_kv_head) * kHeads;
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

  // The query slices this thread multiplies with.
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
      for (int e = 0; e < L::kVec; ++e) q[h][i][e] = cuda::ToFloat(x[e]);
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
          logits[h * kPartition + (t - start)] =
              valid[u] ? Logit(p, dot[h], first_head + h, t, seq_len) : -INFINITY;
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
    m = cuda::WarpReduce(m, [](float a, float b) { return fmaxf(a, b); });
    float sum = 0.0f;
    for (int t = warp_lane; t < end - start; t += 32) {
      const float e = m == -INFINITY ? 0.0f : __expf(row[t] - m);  // all skipped: weight 0
      row[t] = e;
      sum += e;
    }
    sum = cuda::WarpReduce(sum, [](float a, float b) { return a + b; });
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
    if (direct) {
      const int64_t seq_head = static_cast<int64_t>(seq) * p.num_heads + first_head + h;
      const float inv_sum = head_sum[h] > 0.0f ? 1.0f / head_sum[h] : 0.0f;
      out[seq_head * kHeadSize + idx % kHeadSize] = cuda::FromFloat<T>(total * inv_sum);
    } else {
      p.partial_out[Record(p, first_head + h, seq, partition) * kHeadSize + idx % kHeadSize] =
          total;
    }
  }
  if (!direct && threadIdx.x < kHeads) {
    const int64_t record = Record(p, first_head + threadIdx.x, seq, partition);
    p.partial_max[record] = head_max[threadIdx.x];
    p.partial_sum[record] = head_sum[threadIdx.x];
  }
}

// The largest power of two up to kMaxHeadsPerCta dividing the GQA group: a CTA then
// serves whole chunks of one kv head's query heads.
inline int HeadsPerCta(int64_t group_size) {
  int heads = kMaxHeadsPerCta;
  while (group_size % heads != 0) heads /= 2;
  return heads;
}

template <typename T, int kHeadSize, int kHeads>
void LaunchAttend(const Params& p, int num_seqs, int head_chunks_per_kv_head,
                  cudaStream_t stream) {
  const dim3 grid(num_seqs * p.num_partitions, p.num_kv_heads * head_chunks_per_kv_head);
  AttendSimtKernel<T, kHeadSize, kHeads><<<grid, kThreads, 0, stream>>>(p, head_chunks_per_kv_head);
}

// p.partition_len must be kPartition.
template <typename T, int kHeadSize>
void Attend(const Params& p, int num_seqs, int64_t group_size, cudaStream_t stream) {
  const int heads = HeadsPerCta(group_size);
  const int chunks = static_cast<int>(group_size / heads);
  switch (heads) {
    case 8: LaunchAttend<T, kHeadSize, 8>(p, num_seqs, chunks, stream); break;
    case 4: LaunchAttend<T, kHeadSize, 4>(p, num_seqs, chunks, stream); break;
    case 2: LaunchAttend<T, kHeadSize, 2>(p, num_seqs, chunks, stream); break;
    default: LaunchAttend<T, kHeadSize, 1>(p, num_seqs, chunks, stream); break;
  }
}

}  // namespace xla_ext::attention::decode::simt

#endif  // XLA_EXT_KERNELS_ATTENTION_DECODE_SIMT_CUH_
