// Ragged paged attention on CUDA cores: any supported dtype (f32, f16, bf16; fp8 caches),
// head_dim and mask_value, on sm_80 and newer.
//
// The grid is (query row, chunk of up to 8 query heads of one kv head, partition), sized from
// static shapes only; nothing is read on the host. Each CTA:
// - finds the sequence owning its row on the device (a 32-way search of the first
//   num_seqs + 1 entries of cu_q_lens by every warp; the op's contract,
//   kernels/ragged_paged_attention/ragged_paged_attention.h, says what is done with junk) and the row's range of kv positions (causal, sliding window);
// - splits its partition of that range over thread groups ("slots") of kLanes threads: a
//   group reads one position's K and V rows (kLanes lanes x 8 elements, the widest aligned
//   loads) and keeps, per query head, an online softmax (max, sum, unnormalised output) in
//   f32; the query heads of the chunk share every K/V row loaded;
// - merges the slots (shuffles within a warp, shared memory across warps) and writes the
//   output row, or, when the range is split into partitions, the partial (max, sum, output)
//   to scratch, which CombineKernel merges into the output.
// Partitions are sized from the static shapes (pages_per_seq * page_size, as if every row
// attended that many positions) so that small batches of long rows still fill the GPU.
#ifndef XLA_EXT_KERNELS_ATTENTION_RAGGED_SIMT_CUH_
#define XLA_EXT_KERNELS_ATTENTION_RAGGED_SIMT_CUH_

#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "kernels/attention/batch_params.cuh"
#include "kernels/common/cuda_utils.cuh"

namespace xla_ext::attention::ragged::simt {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 8;             // elements of a row a lane reads
constexpr int kMaxHeadsPerCta = 8;
constexpr int kMinPartitionLen = 256;  // positions per CTA when a row's range is split
constexpr int kMaxPartitions = 1024;
constexpr int kCtasPerSmTarget = 4;    // with fewer CTAs than this per SM, split the rows
constexpr unsigned kFullMask = 0xffffffffu;

struct Params : BatchParams {
  // Per (token, q head, partition), used when num_partitions > 1.
  float* partial_out;  // [num_tokens * num_q_heads, num_partitions, head_dim]
  float* partial_max;  // [num_tokens * num_q_heads, num_partitions]
  float* partial_sum;
  int num_partitions;
  int partition_len;
};

using cuda::ToFloat;
__device__ __forceinline__ float ToFloat(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

// kChunk consecutive elements of E as raw words: 8 bytes (fp8), 16 (f16, bf16) or 32 (f32).
template <typename E, int kBytes = kChunk * sizeof(E)>
struct RawChunk {
  static_assert(kBytes % 16 == 0, "16 or 32 bytes");
  uint4 w[kBytes / 16];
  __device__ __forceinline__ void Load(const E* src) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) w[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
  }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) w[i] = make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ float At(int e) const {
    return ToFloat(reinterpret_cast<const E*>(w)[e]);
  }
};

template <typename E>
struct RawChunk<E, 8> {
  uint2 w;
  __device__ __forceinline__ void Load(const E* src) {
    w = __ldg(reinterpret_cast<const uint2*>(src));
  }
  __device__ __forceinline__ void Zero() { w = make_uint2(0, 0); }
  __device__ __forceinline__ float At(int e) const {
    return ToFloat(reinterpret_cast<const E*>(&w)[e]);
  }
};

// The sequence owning query row `token`, or -1. Every lane of the calling warp takes part and
// gets the same answer. Reads only cu_q_lens[0..n] (n = num_seqs clamped to max_num_seqs);
// the last entry <= token is found by rounds of 32 probes, and its ownership is verified, so
// non-monotone junk cannot make a row belong to a sequence whose range excludes it.
__device__ __forceinline__ int FindSequence(const Params& p, int token) {
  const int lane = threadIdx.x % 32;
  const int32_t* cu = p.cu_q_lens;
  const int n = min(max(__ldg(p.num_seqs), 0), p.max_num_seqs);
  if (n == 0 || __ldg(cu) > token) return -1;
  int lo = 0, hi = n;  // cu[lo] <= token; with monotone entries the answer is in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + 31) / 32;
    const int probe = lo + (lane + 1) * step;
    const bool below = probe <= hi && __ldg(cu + probe) <= token;
    const unsigned ballot = __ballot_sync(kFullMask, below);
    if (ballot == 0) {
      hi = lo + step - 1;
    } else {
      const int top = 31 - __clz(ballot);
      hi = min(hi, lo + (top + 2) * step - 1);
      lo = lo + (top + 1) * step;
    }
  }
  if (lo >= n || token >= __ldg(cu + lo + 1)) return -1;
  return lo;
}

// Positions of the row's sequence, and the range [begin, end) of them it visits.
struct Row {
  int seq = -1;
  int q_pos = -1;  // -1: the row gives zeros
  int begin = 0;
  int end = 0;
};

__device__ __forceinline__ Row FindRow(const Params& p, int token) {
  Row r;
  r.seq = FindSequence(p, token);
  if (r.seq < 0) return r;
  const int q_start = __ldg(p.cu_q_lens + r.seq);
  const int64_t q_len = int64_t{__ldg(p.cu_q_lens + r.seq + 1)} - q_start;  // >= 1
  const int kv_len = min(max(__ldg(p.kv_lens + r.seq), 0), p.pages_per_seq << p.log2_page_size);
  if (q_len > kv_len) return r;
  r.q_pos = kv_len - static_cast<int>(q_len) + (token - q_start);  // in [0, kv_len)
  if (p.visit_masked) {
    r.end = kv_len;
  } else {
    r.begin = p.sliding_window > 0 ? max(0, r.q_pos - p.sliding_window + 1) : 0;
    r.end = r.q_pos + 1;
  }
  return r;
}

template <typename KV, int kHeads>
constexpr int Unroll() {  // positions a slot loads before using them, within the registers
  return sizeof(KV) == 4 ? (kHeads >= 8 ? 1 : kHeads >= 4 ? 2 : 4) : (kHeads >= 8 ? 2 : 4);
}

template <typename T, typename KV, int kHeadDim, int kHeads>
__global__ void __launch_bounds__(kThreads) AttendKernel(Params p, int head_chunks) {
  constexpr int kLanesUsed = kHeadDim / kChunk;  // 8 to 32
  constexpr int kLanes = kLanesUsed <= 8 ? 8 : kLanesUsed <= 16 ? 16 : 32;
  constexpr int kSlots = kThreads / kLanes;
  constexpr int kUnroll = Unroll<KV, kHeads>();
  static_assert(kHeadDim % kChunk == 0 && kLanesUsed <= 32, "head_dim in [64, 256], by 8");

  __shared__ float warp_acc[kWarps][kHeads][kHeadDim];
  __shared__ float warp_max[kWarps][kHeads];
  __shared__ float warp_sum[kWarps][kHeads];

  const int token = blockIdx.x;
  const int kv_head = blockIdx.y / head_chunks;
  const int first_head = kv_head * p.group_size + (blockIdx.y % head_chunks) * kHeads;
  const int partition = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int warp_lane = threadIdx.x % 32;
  const int lane = threadIdx.x % kLanes;  // the chunk of a row this thread reads
  const int slot = threadIdx.x / kLanes;
  const bool has_chunk = lane < kLanesUsed;
  const bool direct = p.num_partitions == 1;
  const int64_t first_row = static_cast<int64_t>(token) * p.num_q_heads + first_head;

  const Row r = FindRow(p, token);
  const int begin = static_cast<int>(
      min(static_cast<int64_t>(r.begin) + static_cast<int64_t>(partition) * p.partition_len,
          static_cast<int64_t>(r.end)));
  const int end = min(r.end, begin + p.partition_len);
  if (r.q_pos < 0 || begin >= end) {  // the same for the whole CTA
    if (direct) {
      T* out = static_cast<T*>(p.out) + first_row * kHeadDim;
      for (int i = threadIdx.x; i < kHeads * kHeadDim; i += kThreads) {
        out[i] = cuda::FromFloat<T>(0.0f);
      }
    } else if (threadIdx.x < kHeads) {  // an empty partition: weight 0 in the combine
      const int64_t at = (first_row + threadIdx.x) * p.num_partitions + partition;
      p.partial_max[at] = -INFINITY;
      p.partial_sum[at] = 0.0f;
    }
    return;
  }

  // This thread's chunk of each query head.
  float q[kHeads][kChunk];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    RawChunk<T> raw;
    raw.Zero();
    if (has_chunk) {
      raw.Load(static_cast<const T*>(p.q) + (first_row + h) * kHeadDim + lane * kChunk);
    }
#pragma unroll
    for (int e = 0; e < kChunk; ++e) q[h][e] = raw.At(e);
  }

  float m[kHeads], l[kHeads], acc[kHeads][kChunk];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) acc[h][e] = 0.0f;
  }

  const KV* kv = static_cast<const KV*>(p.kv_pages);
  const int32_t* pages = p.page_indices + static_cast<int64_t>(r.seq) * p.pages_per_seq;
  const int64_t slot_stride = int64_t{2} * p.num_kv_heads * kHeadDim;  // one page slot
  const int64_t head_offset = int64_t{2} * kv_head * kHeadDim + lane * kChunk;
  const int offset_mask = (1 << p.log2_page_size) - 1;

  // Every thread runs the same iterations (begin and end are the CTA's): shuffles are safe.
  for (int base = begin; base < end; base += kSlots * kUnroll) {
    RawChunk<KV> k_raw[kUnroll], v_raw[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int pos = base + u * kSlots + slot;
      int64_t offset = -1;
      if (pos < end) {
        const int page = __ldg(pages + (pos >> p.log2_page_size));
        if (page >= 0 && page < p.num_pages) {
          offset = ((static_cast<int64_t>(page) << p.log2_page_size) + (pos & offset_mask)) *
                       slot_stride + head_offset;
        }
      }
      valid[u] = offset >= 0;
      k_raw[u].Zero();
      v_raw[u].Zero();
      if (valid[u] && has_chunk) {
        k_raw[u].Load(kv + offset);
        v_raw[u].Load(kv + offset + kHeadDim);
      }
    }

    float s[kUnroll][kHeads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float dot[kHeads];
#pragma unroll
      for (int h = 0; h < kHeads; ++h) dot[h] = 0.0f;
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        const float k = k_raw[u].At(e);
#pragma unroll
        for (int h = 0; h < kHeads; ++h) dot[h] += q[h][e] * k;
      }
      const int pos = base + u * kSlots + slot;
      const bool masked = pos > r.q_pos ||
                          (p.sliding_window > 0 && pos <= r.q_pos - p.sliding_window);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2) {
          dot[h] += __shfl_xor_sync(kFullMask, dot[h], offset);
        }
        float score = dot[h] * p.score_scale;
        if (p.soft_cap > 0.0f) score = p.soft_cap * tanhf(score / p.soft_cap);
        if (masked) score = p.mask_value;  // only visited when p.visit_masked
        s[u][h] = valid[u] ? score : -INFINITY;
      }
    }

    // Online softmax: rescale to the new maximum, then add this iteration's positions.
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      float new_max = m[h];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) new_max = fmaxf(new_max, s[u][h]);
      const float rescale = new_max == -INFINITY ? 1.0f : __expf(m[h] - new_max);
      l[h] *= rescale;
#pragma unroll
      for (int e = 0; e < kChunk; ++e) acc[h][e] *= rescale;
      m[h] = new_max;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!valid[u]) continue;
      float v[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) v[e] = v_raw[u].At(e);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        const float w = s[u][h] == -INFINITY ? 0.0f : __expf(s[u][h] - m[h]);
        l[h] += w;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) acc[h][e] += w * v[e];
      }
    }
  }

  // Merge the slots of a warp into its first kLanes lanes.
#pragma unroll
  for (int offset = kLanes; offset < 32; offset *= 2) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      const float other_max = __shfl_xor_sync(kFullMask, m[h], offset);
      const float other_sum = __shfl_xor_sync(kFullMask, l[h], offset);
      const float new_max = fmaxf(m[h], other_max);
      const float mine = new_max == -INFINITY ? 0.0f : __expf(m[h] - new_max);
      const float theirs = new_max == -INFINITY ? 0.0f : __expf(other_max - new_max);
      l[h] = l[h] * mine + other_sum * theirs;
#pragma unroll
      for (int e = 0; e < kChunk; ++e) {
        const float other_acc = __shfl_xor_sync(kFullMask, acc[h][e], offset);
        acc[h][e] = acc[h][e] * mine + other_acc * theirs;
      }
      m[h] = new_max;
    }
  }
  if (warp_lane < kLanes) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (has_chunk) {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) warp_acc[warp][h][lane * kChunk + e] = acc[h][e];
      }
      if (warp_lane == 0) {
        warp_max[warp][h] = m[h];
        warp_sum[warp][h] = l[h];
      }
    }
  }
  __syncthreads();

  // Merge the warps: one thread per (head, element).
  for (int i = threadIdx.x; i < kHeads * kHeadDim; i += kThreads) {
    const int h = i / kHeadDim;
    const int d = i % kHeadDim;
    float row_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) row_max = fmaxf(row_max, warp_max[w][h]);
    float sum = 0.0f, total = 0.0f;
    if (row_max != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = warp_max[w][h] == -INFINITY ? 0.0f : __expf(warp_max[w][h] - row_max);
        sum += weight * warp_sum[w][h];
        total += weight * warp_acc[w][h][d];
      }
    }
    const int64_t row = first_row + h;
    if (direct) {
      const float scale = sum > 0.0f ? p.v_scale / sum : 0.0f;  // no valid position: zeros
      static_cast<T*>(p.out)[row * kHeadDim + d] = cuda::FromFloat<T>(total * scale);
    } else {
      const int64_t at = row * p.num_partitions + partition;
      p.partial_out[at * kHeadDim + d] = total;
      if (d == 0) {
        p.partial_max[at] = row_max;
        p.partial_sum[at] = sum;
      }
    }
  }
}

// One warp per (token, q head) row: out = v_scale * sum_i w_i o_i / sum_i w_i l_i over the
// row's partitions i, w_i = exp(m_i - max_i m_i); partitions with nothing (m_i = -inf) have
// weight 0 and their partial output is never read.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads) CombineKernel(Params p, int64_t rows) {
  constexpr int kPerLane = (kHeadDim + 31) / 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* maxes = p.partial_max + row * p.num_partitions;
  const float* sums = p.partial_sum + row * p.num_partitions;
  float row_max = -INFINITY;
  for (int i = 0; i < p.num_partitions; ++i) row_max = fmaxf(row_max, maxes[i]);
  float sum = 0.0f;
  float acc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) acc[j] = 0.0f;
  if (row_max != -INFINITY) {
    for (int i = 0; i < p.num_partitions; ++i) {
      if (maxes[i] == -INFINITY) continue;
      const float weight = __expf(maxes[i] - row_max);
      sum += weight * sums[i];
      const float* partial = p.partial_out + (row * p.num_partitions + i) * kHeadDim;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int d = lane + 32 * j;
        if (d < kHeadDim) acc[j] += weight * partial[d];
      }
    }
  }
  const float scale = sum > 0.0f ? p.v_scale / sum : 0.0f;
  T* out = static_cast<T*>(p.out) + row * kHeadDim;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + 32 * j;
    if (d < kHeadDim) out[d] = cuda::FromFloat<T>(acc[j] * scale);
  }
}

// How a call is split.
struct Plan {
  int heads_per_cta = 1;
  int head_chunks = 1;  // per kv head
  int num_partitions = 1;
  int partition_len = 1;
};

// The largest power of two up to kMaxHeadsPerCta dividing the GQA group.
inline int HeadsPerCta(int64_t group_size) {
  int heads = kMaxHeadsPerCta;
  while (group_size % heads != 0) heads /= 2;
  return heads;
}

inline Plan MakePlan(const BatchParams& batch, const std::optional<cuda::DeviceInfo>& device) {
  Plan plan;
  plan.heads_per_cta = HeadsPerCta(batch.group_size);
  plan.head_chunks = batch.group_size / plan.heads_per_cta;
  // The tokens a sequence's row of page_indices can address.
  const int64_t capacity =
      std::max<int64_t>(int64_t{batch.pages_per_seq} << batch.log2_page_size, 1);
  plan.partition_len = static_cast<int>(capacity);
  const int64_t ctas = int64_t{batch.num_tokens} * batch.num_kv_heads * plan.head_chunks;
  if (!device.has_value() || ctas <= 0) return plan;
  const int64_t target = int64_t{device->sms} * kCtasPerSmTarget;
  if (ctas >= target || capacity < 2 * kMinPartitionLen) return plan;
  const int64_t wanted = std::min<int64_t>({(target + ctas - 1) / ctas,
                                            capacity / kMinPartitionLen, kMaxPartitions});
  const int64_t len = (capacity + wanted - 1) / wanted;
  plan.partition_len = static_cast<int>((len + 63) / 64 * 64);
  plan.num_partitions = static_cast<int>((capacity + plan.partition_len - 1) / plan.partition_len);
  return plan;
}

}  // namespace xla_ext::attention::ragged::simt

#endif  // XLA_EXT_KERNELS_ATTENTION_RAGGED_SIMT_CUH_
