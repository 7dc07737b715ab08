// Hopper decode attention for f16/bf16 with GQA groups of up to 16 query heads. Decode reads
// every K and V byte once and does little arithmetic per byte, so the kernel spends as few
// instructions as possible per byte and keeps plenty of bytes in flight:
// - One CTA per (sequence, partition, kv_heads_per_cta consecutive kv heads), one warp per kv
//   head. A token's rows for those kv heads are contiguous in the NHD cache, so one TMA bulk
//   copy moves them into shared memory.
// - Stages of kStageTokens tokens (their K and V rows) stream through a ring of num_stages
//   buffers. A producer warp issues the copies; a buffer's `full` mbarrier completes when its
//   bytes have landed, its `empty` one when every consumer thread is done with it, and only
//   then does the producer refill it. No CTA-wide barrier in the loop. Every thread arrives
//   for itself: an arrive releases only the arriving thread's accesses.
// - Tensor cores (mma.sync m16n8k16, FlashAttention-2 layout): S = Q K^T with the warp's query
//   heads as the 16 rows of A (rows past the group are zero); an online softmax in registers;
//   O += P V with P taken straight from S's accumulators.
// - L2 policies: the K and V copies mark their lines evict-first (each byte is read once), the
//   split-KV partials are stored evict-last (the combine kernel reads them right after), so the
//   stream of the cache does not push the partials out to DRAM. Measured on an H100 against no
//   policies: B=1, L=32768 -2.5 to -3.3 us per call, the other shapes unchanged or faster; the
//   copies' policy alone made B=32 2-3 us slower, and reading the partials back evict-first in
//   the combine kernel was no better (bench/results/h100-tune-tensor-core.txt).
// Shared-memory rows are padded by 16 bytes so that ldmatrix's 8 rows of 8 tokens fall in
// distinct banks. Measured on an H100 (bench/results/h100-tune-tensor-core.txt): one L2 prefetch
// per block-sized run of tokens, a stage ahead, raised B=32, L=4096 from 82% to 88% of copy
// bandwidth in the same timing; copies of one kv head's 256-byte rows reached only about 50%.
#ifndef XLA_EXT_KERNELS_PAGED_ATTENTION_ATTEND_TENSOR_CORE_CUH_
#define XLA_EXT_KERNELS_PAGED_ATTENTION_ATTEND_TENSOR_CORE_CUH_

#include <cmath>
#include <cstdint>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"
#include "kernels/paged_attention/split_kv.cuh"

namespace xla_ext::paged_attention::tensor_core {

// Build-time tuning knob (tools/device/tune_paged_attention.sh): stages of L2 prefetch ahead.
#ifndef XLA_EXT_PAGED_ATTENTION_L2_PREFETCH_STAGES
#define XLA_EXT_PAGED_ATTENTION_L2_PREFETCH_STAGES 1
#endif

constexpr int kL2PrefetchStages = XLA_EXT_PAGED_ATTENTION_L2_PREFETCH_STAGES;
constexpr int kStageTokens = 16;  // one k16 step of P V; two n8 tiles of S
constexpr int kMaxStages = 16;
// Stages a CTA brings into L2 before the previous kernel has finished (PrefetchEarly). Measured
// on an H100 against none, 3 and 4 (bench/results/h100-tune-tensor-core.txt).
constexpr int kEarlyPrefetchStages = 2;
constexpr int kMaxKvHeadsPerCta = 8;
constexpr int kMaxGroupSize = 16;  // the rows of an m16n8k16 A tile
// Barriers and per-stage token masks come first in shared memory, then the stage buffers.
constexpr int kHeaderBytes = kMaxStages * (2 * sizeof(uint64_t) + sizeof(uint32_t));
static_assert(kHeaderBytes % 16 == 0, "stage buffers start 16-byte aligned");

struct Layout {
  static constexpr int kRowPadding = 16;  // bytes
  int row_stride;   // bytes of one token's rows in shared memory, padded
  int stage_bytes;  // K rows then V rows of kStageTokens tokens

  static Layout For(int kv_heads_per_cta, int head_size, int element_size) {
    const int row_stride = kv_heads_per_cta * head_size * element_size + kRowPadding;
    return {row_stride, 2 * kStageTokens * row_stride};
  }
};

inline int SharedBytes(const Layout& layout, int num_stages) {
  return kHeaderBytes + num_stages * layout.stage_bytes;
}

// Launched programmatically, a CTA starts while the previous kernel drains, and must not read
// what that kernel may still write until WaitForPrerequisiteGrid. It can still start its first
// stages' DRAM reads: an L2 prefetch is only a hint, and L2 is where every SM's writes land, so
// a prefetched line can never be stale. The sequence length and block id that give the address
// are read past L1 (__ldcg), so that no stale copy stays there for the real reads after the
// wait; if the previous kernel changes them, this prefetches the wrong rows of the cache, which
// costs bandwidth and nothing else. Rows [t, t + run) of every kv head, a run within one block.
template <typename T, int kHeadSize>
__device__ __forceinline__ void PrefetchEarly(const Params& p, int seq, const int32_t* blocks,
                                              int t, int run) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (t >= ClampSeqLen(p, __ldcg(&p.seq_lens[seq]))) return;
  const int64_t offset = RowOffset(p, __ldcg(&blocks[t >> p.log2_block_size]), t, 0, kHeadSize);
  if (offset < 0) return;
  const uint32_t bytes = run * p.num_kv_heads * kHeadSize * sizeof(T);
  cuda::sm90::PrefetchToL2(static_cast<const T*>(p.key_cache) + offset, bytes);
  cuda::sm90::PrefetchToL2(static_cast<const T*>(p.value_cache) + offset, bytes);
#endif
}

// kHighRows: the GQA group has more than 8 heads, so rows 8-15 of the MMA tiles are used.
template <typename T, int kHeadSize, bool kHighRows>
__global__ void __launch_bounds__((kMaxKvHeadsPerCta + 1) * 32)
    AttendTensorCoreKernel(Params p, Layout layout, int num_stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace sm90 = cuda::sm90;
  constexpr int kSteps = kHeadSize / 16;  // k16 steps of Q K^T
  constexpr int kTiles = kHeadSize / 8;   // n8 tiles of O
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // a stage's bytes have landed
  uint64_t* empty = full + kMaxStages;                   // every consumer is done with it
  uint32_t* valid_masks = reinterpret_cast<uint32_t*>(empty + kMaxStages);
  unsigned char* stages = smem + kHeaderBytes;

  const int seq = blockIdx.x;
  const int partition = blockIdx.y;
  const int kv_heads_per_cta = blockDim.x / 32 - 1;  // consumer warps; the last warp produces
  const int first_kv_head = blockIdx.z * kv_heads_per_cta;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = p.num_heads / p.num_kv_heads;
  const int first_head = (first_kv_head + warp) * group;  // this warp's query heads
  if (threadIdx.x == 0) {
    for (int s = 0; s < num_stages; ++s) {
      sm90::BarrierInit(sm90::SharedAddress(&full[s]), 32);  // the producer warp's lanes
      sm90::BarrierInit(sm90::SharedAddress(&empty[s]), kv_heads_per_cta * 32);
    }
    sm90::FenceBarrierInit();
  }
  const int start = partition * p.partition_len;
  const int32_t* blocks = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  // With every kv head in the CTA, the rows of a block's tokens are one contiguous run: one
  // large L2 prefetch per run turns a stage's row copies into L2 hits. The first
  // kEarlyPrefetchStages stages are prefetched here, the rest a stage ahead in the loop.
  const int prefetch_run =
      kv_heads_per_cta == p.num_kv_heads ? min(1 << p.log2_block_size, kStageTokens) : 0;
  if (warp == kv_heads_per_cta && prefetch_run > 0 &&
      lane < kEarlyPrefetchStages * kStageTokens / prefetch_run) {
    PrefetchEarly<T, kHeadSize>(p, seq, blocks, start + lane * prefetch_run, prefetch_run);
  }
  __syncthreads();
  // Launched programmatically: the set-up above overlaps the previous kernel's tail; global
  // memory only after it has finished.
  sm90::WaitForPrerequisiteGrid();
  // The producer loads its first stage's block ids beside the sequence length: one memory
  // round trip before the first copies, not two. Entries below the capacity are readable.
  const int first_token = start + lane % kStageTokens;
  const int first_block =
      warp == kv_heads_per_cta && first_token < Capacity(p)
          ? blocks[first_token >> p.log2_block_size]
          : -1;
  const int seq_len = SeqLen(p, seq);
  const int end = min(start + p.partition_len, seq_len);
  const bool direct = p.num_partitions == 1;
  T* out = static_cast<T*>(p.out);

  if (start >= end) {
    // Empty sequence; a partition past the end is never read by the combine kernel.
    if (direct) {
      const int64_t first = (static_cast<int64_t>(seq) * p.num_heads + first_kv_head * group) *
                            kHeadSize;
      for (int i = threadIdx.x; i < kv_heads_per_cta * group * kHeadSize; i += blockDim.x) {
        out[first + i] = cuda::FromFloat<T>(0.0f);
      }
    }
    return;
  }

  const int num_iters = (end - start + kStageTokens - 1) / kStageTokens;

  if (warp == kv_heads_per_cta) {
    // Producer: lanes 0-15 copy the K rows of a stage's tokens, lanes 16-31 their V rows. The
    // block-table entry of the next stage is loaded before waiting for its buffer.
    const int index = lane % kStageTokens;
    const bool value = lane >= kStageTokens;
    const uint32_t row_bytes = layout.row_stride - Layout::kRowPadding;
    const T* cache = static_cast<const T*>(value ? p.value_cache : p.key_cache);
    const uint64_t read_once = sm90::EvictFirstPolicy();
    const auto row_offset = [&](int iter) -> int64_t {
      const int t = start + iter * kStageTokens + index;
      return t < end ? RowOffset(p, blocks, t, first_kv_head, kHeadSize) : -1;
    };
    int64_t offset =
        first_token < end ? RowOffset(p, first_block, first_token, first_kv_head, kHeadSize) : -1;
    for (int iter = 0; iter < num_iters; ++iter) {
      const int slot = iter % num_stages;
      const int64_t next = iter + 1 < num_iters ? row_offset(iter + 1) : -1;
      if (iter >= num_stages) {
        sm90::WaitParity(sm90::SharedAddress(&empty[slot]), (iter / num_stages - 1) & 1);
      }
      const uint32_t valid = __ballot_sync(0xffffffffu, offset >= 0);
      const uint32_t bytes = offset >= 0 ? row_bytes : 0;
      const uint32_t total = __reduce_add_sync(0xffffffffu, bytes);
      const uint32_t barrier = sm90::SharedAddress(&full[slot]);
      unsigned char* dst = stages + slot * layout.stage_bytes +
                           ((value ? kStageTokens : 0) + index) * layout.row_stride;
      if (offset < 0) {
        // A skipped token: zeros (weight 0 times finite values), released to the consumers
        // by this lane's arrive below, and ordered before later TMA writes to these bytes.
        for (uint32_t i = 0; i < row_bytes; i += 16) {
          *reinterpret_cast<uint4*>(dst + i) = make_uint4(0, 0, 0, 0);
        }
        sm90::FenceProxyAsync();
      }
      // Every lane arrives, releasing its own shared-memory writes (lane 0: the token mask).
      if (lane == 0) {
        valid_masks[slot] = valid & 0xffffu;
        sm90::ArriveExpectBytes(barrier, total);
      } else {
        sm90::Arrive(barrier);
      }
      __syncwarp();  // the bytes are expected before any copy can complete
      if (offset >= 0) {
        sm90::BulkCopyToShared(sm90::SharedAddress(dst), cache + offset, bytes, barrier,
                               read_once);
      }
      const int ahead_iter = iter + kL2PrefetchStages;
      if (kL2PrefetchStages > 0 && prefetch_run > 0 && ahead_iter >= kEarlyPrefetchStages &&
          ahead_iter < num_iters && index % prefetch_run == 0) {
        const int64_t ahead = row_offset(ahead_iter);
        if (ahead >= 0) sm90::PrefetchToL2(cache + ahead, prefetch_run * row_bytes);
      }
      offset = next;
    }
    return;
  }

  // Q as MMA A fragments: lane holds rows lane/4 and lane/4 + 8, columns 2*(lane%4) + {0,1}
  // and + 8 of each 16-column step. Rows past the group are zero.
  const int row = lane / 4;
  const int col = 2 * (lane % 4);
  uint32_t qa[kSteps][4];
  {
    const T* q = static_cast<const T*>(p.query) +
                 (static_cast<int64_t>(seq) * p.num_heads + first_head) * kHeadSize;
    const uint32_t* q_lo = reinterpret_cast<const uint32_t*>(q + row * kHeadSize + col);
    const uint32_t* q_hi = reinterpret_cast<const uint32_t*>(q + (row + 8) * kHeadSize + col);
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      qa[s][0] = row < group ? q_lo[s * 8] : 0u;
      qa[s][2] = row < group ? q_lo[s * 8 + 4] : 0u;
      qa[s][1] = kHighRows && row + 8 < group ? q_hi[s * 8] : 0u;
      qa[s][3] = kHighRows && row + 8 < group ? q_hi[s * 8 + 4] : 0u;
    }
  }

  // Online softmax state of rows `row` (lo) and `row + 8` (hi); O's accumulators per n8 tile:
  // [0..1] row lo, [2..3] row hi (kept only with kHighRows), columns col + {0,1}.
  constexpr int kRows = kHighRows ? 2 : 1;
  float running_max[kRows], running_sum[kRows];
  float o[kTiles][4];  // rows hi are dead code without kHighRows
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    running_max[r] = -INFINITY;
    running_sum[r] = 0.0f;
  }
#pragma unroll
  for (int n = 0; n < kTiles; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;

  // ldmatrix row addresses of this lane, relative to the warp's first K or V element.
  // K (B of Q K^T, not transposed): matrix j = lane/8 is (tokens 8*(j/2).., columns 8*(j%2)..).
  // V (B of P V, transposed): matrix j is (tokens 8*(j%2).., columns 8*(j/2)..).
  const int j = lane / 8;
  const int k_lane = ((j / 2) * 8 + lane % 8) * layout.row_stride + (j % 2) * 8 * sizeof(T);
  const int v_lane = ((j % 2) * 8 + lane % 8) * layout.row_stride + (j / 2) * 8 * sizeof(T);

  for (int iter = 0; iter < num_iters; ++iter) {
    const int slot = iter % num_stages;
    sm90::WaitParity(sm90::SharedAddress(&full[slot]), (iter / num_stages) & 1);
    const uint32_t k_base = sm90::SharedAddress(stages + slot * layout.stage_bytes) +
                            warp * kHeadSize * sizeof(T);
    const uint32_t v_base = k_base + kStageTokens * layout.row_stride;

    // S (16 query rows x 16 tokens) = Q K^T, as two n8 tiles of tokens.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      uint32_t b[4];
      sm90::LoadMatrixX4(b, k_base + k_lane + step * 16 * sizeof(T));
      sm90::Mma16816<T>(s[0], qa[step], b[0], b[1], s[0]);
      sm90::Mma16816<T>(s[1], qa[step], b[2], b[3], s[1]);
    }

    // Logits, masked; then the online softmax update per row.
    const uint32_t valid = valid_masks[slot];
    const int first_token = start + iter * kStageTokens;
    // Calls fn(n, i, r) for each of this lane's scores s[n][i]; r: its row, 0 (lo) or 1 (hi).
    const auto for_each_score = [&](auto fn) {
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int i = 0; i < 2 * kRows; ++i) fn(n, i, i / 2);
    };
    float tile_max[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) tile_max[r] = -INFINITY;
    for_each_score([&](int n, int i, int r) {
      const int index = n * 8 + col + i % 2;
      // Padding rows still need a finite logit; their results are never written.
      const int head = first_head + min(row + 8 * r, group - 1);
      const float logit = (valid >> index) & 1u
                              ? Logit(p, s[n][i], head, first_token + index, seq_len)
                              : -INFINITY;
      s[n][i] = logit;
      tile_max[r] = fmaxf(tile_max[r], logit);
    });
    float scale_old[kRows], base[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      const float new_max = fmaxf(running_max[r], tile_max[r]);
      base[r] = new_max == -INFINITY ? 0.0f : new_max;  // nothing valid yet: all weights 0
      scale_old[r] = __expf(running_max[r] - base[r]);
      running_max[r] = new_max;
      running_sum[r] *= scale_old[r];
    }
    for_each_score([&](int n, int i, int r) {
      s[n][i] = __expf(s[n][i] - base[r]);
      running_sum[r] += s[n][i];
    });
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 2 * kRows; ++i) o[n][i] *= scale_old[i / 2];

    // O += P V: P's A fragment is S's accumulators (tokens 0-7 then 8-15), rounded to T.
    const uint32_t pa[4] = {
        sm90::Pack<T>(s[0][0], s[0][1]), kHighRows ? sm90::Pack<T>(s[0][2], s[0][3]) : 0u,
        sm90::Pack<T>(s[1][0], s[1][1]), kHighRows ? sm90::Pack<T>(s[1][2], s[1][3]) : 0u};
#pragma unroll
    for (int n = 0; n < kTiles; n += 2) {
      uint32_t b[4];
      sm90::LoadMatrixX4Transposed(b, v_base + v_lane + n * 8 * sizeof(T));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* acc = o[n + half];
        float c[4] = {acc[0], acc[1], kHighRows ? acc[2] : 0.0f, kHighRows ? acc[3] : 0.0f};
        sm90::Mma16816<T>(c, pa, b[2 * half], b[2 * half + 1], c);
        acc[0] = c[0];
        acc[1] = c[1];
        if constexpr (kHighRows) {
          acc[2] = c[2];
          acc[3] = c[3];
        }
      }
    }

    // This thread is done with the buffer; the producer refills it once every consumer is.
    sm90::Arrive(sm90::SharedAddress(&empty[slot]));
  }

  // The combine kernel may start launching (it waits for this grid to finish).
  sm90::LaunchDependents();

  // Each row's sum is spread over its 4 lanes.
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 1);
    running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 2);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int head_row = row + 8 * r;
    if (head_row >= group) continue;
    const int64_t seq_head = static_cast<int64_t>(seq) * p.num_heads + first_head + head_row;
    if (direct) {
      const float inv_sum = running_sum[r] > 0.0f ? 1.0f / running_sum[r] : 0.0f;
      uint32_t* dst = reinterpret_cast<uint32_t*>(out + seq_head * kHeadSize + col);
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        dst[n * 4] = sm90::Pack<T>(o[n][2 * r] * inv_sum, o[n][2 * r + 1] * inv_sum);
      }
    } else {
      const uint64_t read_soon = sm90::EvictLastPolicy();
      const int64_t index = seq_head * p.num_partitions + partition;
      float2* dst = reinterpret_cast<float2*>(p.partial_out + index * kHeadSize + col);
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        sm90::Store(&dst[n * 4], make_float2(o[n][2 * r], o[n][2 * r + 1]), read_soon);
      }
      if (lane % 4 == 0) {
        sm90::Store(&p.partial_max[index], running_max[r], read_soon);
        sm90::Store(&p.partial_sum[index], running_sum[r], read_soon);
      }
    }
  }
#else
  __trap();  // launched only on sm_90 and newer (see Supported)
#endif
}

}  // namespace xla_ext::paged_attention::tensor_core

#endif  // XLA_EXT_KERNELS_PAGED_ATTENTION_ATTEND_TENSOR_CORE_CUH_
