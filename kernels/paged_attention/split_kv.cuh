// What both CUDA attention kernels share: their parameters, the block-table walk, and the
// split-KV combine. A sequence's tokens are split into partitions of partition_len tokens, one
// CTA each; with more than one partition, each CTA writes its (max, sum, unnormalised output)
// per query head and CombinePartitionsKernel merges them.
#ifndef XLA_EXT_KERNELS_PAGED_ATTENTION_SPLIT_KV_CUH_
#define XLA_EXT_KERNELS_PAGED_ATTENTION_SPLIT_KV_CUH_

#include <cmath>
#include <cstdint>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"

namespace xla_ext::paged_attention {

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
  int partition_len;    // tokens per CTA
  int num_partitions;
  float scale;
  float softcap;
};

// The clamped length the CUDA path uses (see paged_attention.h).
__device__ __forceinline__ int SeqLen(const Params& p, int seq) {
  const int capacity = p.max_blocks_per_seq << p.log2_block_size;
  return min(max(p.seq_lens[seq], 0), capacity);
}

// Element offset of token t's row for kv_head (the rows of the following kv heads come right
// after it), or -1 when its block id is outside the cache.
__device__ __forceinline__ int64_t RowOffset(const Params& p, const int32_t* blocks, int t,
                                             int kv_head, int head_size) {
  const int block = blocks[t >> p.log2_block_size];
  if (block < 0 || block >= p.num_blocks) return -1;
  const int64_t slot =
      (static_cast<int64_t>(block) << p.log2_block_size) + (t & ((1 << p.log2_block_size) - 1));
  return (slot * p.num_kv_heads + kv_head) * head_size;
}

// The logit of query head `head` for token t: scaled, soft-capped, with the ALiBi bias.
__device__ __forceinline__ float Logit(const Params& p, float dot, int head, int t, int seq_len) {
  float logit = dot * p.scale;
  if (p.softcap > 0.0f) logit = p.softcap * tanhf(logit / p.softcap);
  if (p.alibi_slopes != nullptr) {
    logit += p.alibi_slopes[head] * static_cast<float>(t - (seq_len - 1));
  }
  return logit;
}

constexpr int kCombineWarps = 8;
constexpr int kCombineColumns = 32;  // output columns per CTA: one per lane

// `value` reduced with `op` over the CTA (kCombineWarps warps), in every thread; `scratch`
// holds kCombineWarps floats.
template <typename Op>
__device__ __forceinline__ float CtaReduce(float value, float* scratch, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  value = scratch[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) value = op(value, scratch[w]);
  __syncthreads();  // scratch is reused
  return value;
}

// One CTA per (seq, head, kCombineColumns output columns): rescales each used partition's
// result to the global max and normalises by the total sum. Short dependency chains, as a
// long sequence on few heads has hundreds of partitions and few CTAs: every thread loads
// some partitions' (max, sum) at once, and warp w sums partitions w, w + kCombineWarps, ...
// of its lane's column; the warps' sums meet in shared memory. It runs in a few microseconds
// after the attention kernel, so its memory round trips, not its bytes, set its time.
// Dynamic shared memory: num_partitions weights.
template <typename T, int kHeadSize>
__global__ void __launch_bounds__(kCombineWarps * 32) CombinePartitionsKernel(Params p) {
  extern __shared__ float weights[];
  __shared__ float reduce_scratch[kCombineWarps];
  __shared__ float warp_sums[kCombineWarps][kCombineColumns];
  cuda::sm90::WaitForPrerequisiteGrid();  // launched early, behind the attention kernel
  cuda::sm90::LaunchDependents();
  const int64_t seq_head = blockIdx.x;  // seq * num_heads + head
  const int seq = static_cast<int>(seq_head / p.num_heads);
  const int column = blockIdx.z * kCombineColumns + threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int used = (SeqLen(p, seq) + p.partition_len - 1) / p.partition_len;
  const float* maxes = p.partial_max + seq_head * p.num_partitions;
  const float* sums = p.partial_sum + seq_head * p.num_partitions;
  const float* partial = p.partial_out + seq_head * p.num_partitions * kHeadSize + column;
  const bool has_column = column < kHeadSize;

  // The first kBatch partitions of this warp are loaded before the statistics, so that one
  // memory round trip serves both (hundreds of partitions take a few more batches).
  constexpr int kBatch = 16;
  float values[kBatch];
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const int i = warp + j * kCombineWarps;
    values[j] = has_column && i < used ? partial[i * kHeadSize] : 0.0f;
  }

  // Likewise the (max, sum) of partition threadIdx.x.
  const bool has_stats = static_cast<int>(threadIdx.x) < used;
  const float first_max = has_stats ? maxes[threadIdx.x] : -INFINITY;
  const float first_sum = has_stats ? sums[threadIdx.x] : 0.0f;

  float m = first_max;
  for (int i = threadIdx.x + blockDim.x; i < used; i += blockDim.x) m = fmaxf(m, maxes[i]);
  m = CtaReduce(m, reduce_scratch, [](float a, float b) { return fmaxf(a, b); });
  // A partition whose tokens were all skipped has max -inf and sum 0: weight 0.
  const auto weight = [m](float max) { return max == -INFINITY ? 0.0f : __expf(max - m); };
  float total = 0.0f;
  if (has_stats) {
    weights[threadIdx.x] = weight(first_max);
    total = weights[threadIdx.x] * first_sum;
  }
  for (int i = threadIdx.x + blockDim.x; i < used; i += blockDim.x) {
    weights[i] = weight(maxes[i]);
    total += weights[i] * sums[i];
  }
  total = CtaReduce(total, reduce_scratch, [](float a, float b) { return a + b; });

  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const int i = warp + j * kCombineWarps;
    if (i < used) acc += weights[i] * values[j];
  }
  if (has_column) {
#pragma unroll 8
    for (int i = warp + kBatch * kCombineWarps; i < used; i += kCombineWarps) {
      acc += weights[i] * partial[i * kHeadSize];
    }
  }
  warp_sums[warp][threadIdx.x % 32] = acc;
  __syncthreads();
  if (warp == 0 && column < kHeadSize) {
    float value = 0.0f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) value += warp_sums[w][threadIdx.x];
    const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
    static_cast<T*>(p.out)[seq_head * kHeadSize + column] = cuda::FromFloat<T>(value * inv_total);
  }
}

}  // namespace xla_ext::paged_attention

#endif  // XLA_EXT_KERNELS_PAGED_ATTENTION_SPLIT_KV_CUH_
