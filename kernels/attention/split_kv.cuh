// What both CUDA attention kernels share: their parameters, the block-table walk, and the
// split-KV combine. A sequence's tokens may be split over several CTAs ("pieces"); each piece
// writes its (max, sum, unnormalised output) per query head as one record, and
// CombinePartitionsKernel merges a sequence's records. The CUDA-core kernel splits every
// sequence into partitions of partition_len tokens (record seq * num_partitions + partition);
// the tensor-core kernel splits the batch's actual tokens evenly over its grid
// (kernels/common/balanced_split.cuh) and says in seq_records where each sequence's are.
#ifndef XLA_EXT_KERNELS_ATTENTION_SPLIT_KV_CUH_
#define XLA_EXT_KERNELS_ATTENTION_SPLIT_KV_CUH_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "kernels/common/balanced_split.cuh"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"

namespace xla_ext::attention::decode {

struct Params {
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const float* alibi_slopes;  // null: no ALiBi
  void* out;
  // Records of split sequences, per head: [num_heads, num_records] (out: and head_size).
  float* partial_max;
  float* partial_sum;
  float* partial_out;
  int num_records;
  // Tensor-core kernel: (first record, records) of each non-empty sequence, written by the
  // CTA that holds its first token; a sequence with one record was written to `out` directly.
  // Null for the CUDA-core kernel.
  int2* seq_records;
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int num_blocks;
  int max_blocks_per_seq;
  int log2_block_size;  // block sizes are powers of two: token -> block is a shift
  int partition_len;    // CUDA-core kernel: tokens per CTA
  int num_partitions;   // CUDA-core kernel: partitions per sequence
  float scale;
  float softcap;
  // Honoured by the tensor-core kernel and the combine (ragged attention's decode steps run
  // there); the CUDA-core kernel needs their defaults (0, 1, false).
  int window;           // a query row sees only the last `window` tokens; 0: all of them
  float out_scale;      // multiplies every output (the ragged op's v_scale)
  bool kv_interleaved;  // key_cache == value_cache, [blocks, block_size, 2 * num_kv_heads,
                        // head_size]: K of kv head h at 2h, its V at 2h + 1
  // Tensor-core kernel: the last piece of a split sequence to finish merges its records
  // (decode_tensor_core.cuh), and no combine kernel runs behind it.
  bool fused_combine;
  int min_cta_stages;  // tensor-core kernel: the fewest stages a CTA takes (its LaunchAttention)
};

// The batch as paged_attention gives it: sequence i has seq_lens[i] tokens, its query and
// output are row i. (The decode kernels take the batch as a type with the same two functions:
// ragged attention's decode steps are another: decode_steps.cuh.)
struct SeqLensBatch {
  // The tensor-core kernel reads global memory only after the previous grid has finished
  // (false: a batch whose kernel runs beside it waits for it before exiting instead).
  static constexpr bool kWaitsBeforeReading = true;
  // Whether the tensor-core kernel writes the output rows of no sequence itself (a batch that
  // does says which: ForEachOtherRow, as decode_steps.cuh's DecodeOnlySteps).
  static constexpr bool kFillsOtherRows = false;
  // Tokens of sequence `seq` to attend (0: none; the kernels then leave its row to others).
  __device__ int Length(const Params& p, int seq) const;
  // Its query and output row; -1: a row the combine must not write.
  __device__ int64_t Row(const Params&, int seq) const { return seq; }
  // The tensor-core kernel's CTAs that share the batch's `units` (all threads of a CTA call
  // it; it may use the CTA's schedule scratch).
  __device__ int ActiveCtas(const Params&, int /*units*/, int* /*scratch*/) const {
    return static_cast<int>(gridDim.x);
  }
};

// Tokens a sequence's block-table row can address.
__device__ __forceinline__ int Capacity(const Params& p) {
  return p.max_blocks_per_seq << p.log2_block_size;
}

// The clamped length the CUDA path uses (see paged_attention.h), of a seq_lens entry.
__device__ __forceinline__ int ClampSeqLen(const Params& p, int length) {
  return min(max(length, 0), Capacity(p));
}

__device__ __forceinline__ int SeqLen(const Params& p, int seq) {
  return ClampSeqLen(p, p.seq_lens[seq]);
}

__device__ __forceinline__ int SeqLensBatch::Length(const Params& p, int seq) const {
  return SeqLen(p, seq);
}

// The first token a query row of a sequence of `length` tokens sees.
__device__ __forceinline__ int WindowStart(int window, int length) {
  return window > 0 ? max(0, length - window) : 0;
}
__device__ __forceinline__ int WindowStart(const Params& p, int length) {
  return WindowStart(p.window, length);
}

// Element offset of token t's row for kv_head (the rows of the following kv heads come right
// after it), where `block` is its block id from the table; -1 when that is outside the cache.
__device__ __forceinline__ int64_t RowOffset(const Params& p, int block, int t, int kv_head,
                                             int head_size) {
  if (block < 0 || block >= p.num_blocks) return -1;
  const int64_t slot =
      (static_cast<int64_t>(block) << p.log2_block_size) + (t & ((1 << p.log2_block_size) - 1));
  return (slot * p.num_kv_heads + kv_head) * head_size;
}

__device__ __forceinline__ int64_t RowOffset(const Params& p, const int32_t* blocks, int t,
                                             int kv_head, int head_size) {
  return RowOffset(p, blocks[t >> p.log2_block_size], t, kv_head, head_size);
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

constexpr int kCombineWarps = 8;  // per CTA
constexpr int kCombineThreads = kCombineWarps * 32;

// Records a combine warp loads at once, into 16 float4 registers per lane (a lane holds 4
// columns of each, 8 with head sizes over 128).
template <int kHeadSize>
constexpr int CombineChunk() {
  return kHeadSize > 128 ? 8 : 16;
}

// A (sequence, head) row whose records a combine CTA merges.
struct CombineRow {
  int64_t first;       // its first record, numbered as in the partials ([num_heads, num_records])
  int64_t out_offset;  // its first output element
  int used;            // its records
  int warps;           // the CTA's warps that share them: one per chunk, at most all
  int round;           // the CTA's rows merge in rounds of at most kCombineWarps warps
  int first_warp;      // the first of its warps in its round
};

// One warp's share of a row's records: chunks share, share + warps, ... of CombineChunk
// records, merged online into (m, l, acc) (lane c holds columns 4c..4c+3, as float4). A warp
// issues all loads of a chunk together with the chunk's statistics: one memory round trip per
// chunk.
template <int kHeadSize>
__device__ __forceinline__ void MergeShare(const Params& p, const CombineRow& r, int share,
                                           float& m, float& l,
                                           float4 (&acc)[(kHeadSize + 127) / 128]) {
  constexpr int kVecs = (kHeadSize + 127) / 128;
  constexpr int kChunk = CombineChunk<kHeadSize>();
  const int lane = threadIdx.x % 32;
  const float4* partial = reinterpret_cast<const float4*>(p.partial_out + r.first * kHeadSize);
  const auto has_column = [&](int v) { return (v * 32 + lane) * 4 < kHeadSize; };
  m = -INFINITY;
  l = 0.0f;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) acc[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int base = share * kChunk; base < r.used; base += r.warps * kChunk) {
    const int mine = base + lane % kChunk;
    const bool has_stats = lane < kChunk && mine < r.used;
    const float chunk_max = has_stats ? p.partial_max[r.first + mine] : -INFINITY;
    const float chunk_sum = has_stats ? p.partial_sum[r.first + mine] : 0.0f;
    float4 values[kChunk][kVecs];
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        values[j][v] = base + j < r.used && has_column(v)
                           ? partial[(base + j) * (kHeadSize / 4) + v * 32 + lane]
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    const float new_max =
        fmaxf(m, cuda::WarpReduce(chunk_max, [](float a, float b) { return fmaxf(a, b); }));
    // A record whose tokens were all skipped has max -inf and sum 0: weight 0.
    if (new_max == -INFINITY) continue;
    const float rescale = __expf(m - new_max);  // 0 while m is -inf
    const float weight = chunk_max == -INFINITY ? 0.0f : __expf(chunk_max - new_max);
    l = l * rescale + cuda::WarpReduce(weight * chunk_sum, [](float a, float b) { return a + b; });
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float w = __shfl_sync(0xffffffffu, weight, j);
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const float s = j == 0 ? rescale : 1.0f;
        acc[v] = make_float4(acc[v].x * s + w * values[j][v].x, acc[v].y * s + w * values[j][v].y,
                             acc[v].z * s + w * values[j][v].z, acc[v].w * s + w * values[j][v].w);
      }
    }
    m = new_max;
  }
}

// Merges each (seq, head) row's records: out = out_scale * sum_i w_i o_i / sum_i w_i l_i, where
// w_i = exp(m_i - m) and (m_i, l_i, o_i) are record i's max, sum and unnormalised output. An
// empty sequence gets zeros (unless its row is -1); one the attention kernel wrote directly is
// left alone.
// It runs after the attention kernel, where memory round trips, not bytes, set its time, and a
// long sequence beside short ones has many times the records of the others. So the grid is at
// most one resident wave (LaunchCombine); CTA c of C takes rows c, c + C, c + 2C, ... (a
// sequence's heads, split alike, go to different CTAs), kCombineThreads at a time, a thread
// each: it looks up its row's records, writes the zeros of an empty one, and lists the row if it
// has records to merge, with a warp per chunk of them (at most all the CTA's). The listed rows
// merge in rounds of at most kCombineWarps warps: one round trip a round while a row has at most
// kCombineWarps chunks; a row's warps meet in shared memory. (Before, warps per row were fixed
// on the host from the average records: 256 x 32 tokens, with nothing to merge, had a grid of
// 1024 CTAs in 3.9 waves, and its call took 19.2 us against 16.6 now on the H100.)
// (The body of CombinePartitionsKernel, for kernels of kCombineThreads threads that combine
// other rows too: the ragged op's.)
template <typename T, int kHeadSize, typename Batch>
__device__ __forceinline__ void CombinePartitions(const Params& p, const Batch& batch,
                                                  int64_t rows) {
  constexpr int kVecs = (kHeadSize + 127) / 128;  // float4 columns per lane
  constexpr int kChunk = CombineChunk<kHeadSize>();
  __shared__ float4 warp_acc[kCombineWarps][kVecs * 32];
  __shared__ float warp_max[kCombineWarps], warp_sum[kCombineWarps];
  __shared__ CombineRow listed[kCombineThreads];
  __shared__ int scan_scratch[cuda::balanced::ScratchInts(kCombineThreads)];
  __shared__ int num_rounds;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  T* out = static_cast<T*>(p.out);
  // out = out_scale * acc / l, from the row's first warp.
  const auto write_row = [&](const CombineRow& r, float l, const float4 (&acc)[kVecs]) {
    const float inv_sum = l > 0.0f ? p.out_scale / l : 0.0f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int column = (v * 32 + lane) * 4;
      if (column >= kHeadSize) continue;
      T* dst = out + r.out_offset + column;
      dst[0] = cuda::FromFloat<T>(acc[v].x * inv_sum);
      dst[1] = cuda::FromFloat<T>(acc[v].y * inv_sum);
      dst[2] = cuda::FromFloat<T>(acc[v].z * inv_sum);
      dst[3] = cuda::FromFloat<T>(acc[v].w * inv_sum);
    }
  };
  const int64_t stride = gridDim.x;
  for (int64_t pass = blockIdx.x; pass < rows; pass += stride * kCombineThreads) {
    const int64_t row = pass + threadIdx.x * stride;
    CombineRow mine{};
    bool lists = false;
    if (row < rows) {
      const int seq = static_cast<int>(row / p.num_heads);
      const int head = static_cast<int>(row % p.num_heads);
      // Loaded beside the length (one round trip); an empty sequence's entry is never used.
      const int2 records = p.seq_records != nullptr ? p.seq_records[seq] : make_int2(0, 0);
      const int seq_len = batch.Length(p, seq);
      const int64_t out_row = batch.Row(p, seq);
      int first_record = 0, used = 0;
      if (p.seq_records != nullptr) {
        if (seq_len > 0) {
          first_record = records.x;
          used = records.y;
        }
      } else {
        first_record = seq * p.num_partitions;
        used = (seq_len + p.partition_len - 1) / p.partition_len;
      }
      const bool written = p.seq_records != nullptr && used == 1;
      const int64_t out_offset = (out_row * p.num_heads + head) * kHeadSize;
      if (out_row >= 0 && used == 0) {
        for (int i = 0; i < kHeadSize; ++i) out[out_offset + i] = cuda::FromFloat<T>(0.0f);
      } else if (out_row >= 0 && !written) {
        mine.first = static_cast<int64_t>(head) * p.num_records + first_record;
        mine.out_offset = out_offset;
        mine.used = used;
        mine.warps = min(kCombineWarps, (used + kChunk - 1) / kChunk);
        lists = true;
      }
    }
    // One scan counts the listed rows (low 16 bits) and their warps (high bits).
    int scanned;
    const int inclusive = cuda::balanced::BlockInclusiveScan(
        lists ? 1 + (mine.warps << 16) : 0, scan_scratch, scanned);
    const int num_listed = scanned & 0xffff;
    if (lists) {
      mine.round = 0;  // when every listed row's warps fit in one round
      mine.first_warp = (inclusive >> 16) - mine.warps;
      listed[(inclusive & 0xffff) - 1] = mine;
    }
    if ((scanned >> 16) > kCombineWarps) {  // rounds, in order, each row's warps in one
      __syncthreads();
      if (threadIdx.x == 0) {
        int round = 0, next_warp = 0;
        for (int i = 0; i < num_listed; ++i) {
          if (next_warp + listed[i].warps > kCombineWarps) {
            ++round;
            next_warp = 0;
          }
          listed[i].round = round;
          listed[i].first_warp = next_warp;
          next_warp += listed[i].warps;
        }
        num_rounds = round + 1;
      }
    } else if (threadIdx.x == 0) {
      num_rounds = num_listed > 0 ? 1 : 0;
    }
    __syncthreads();
    int round_begin = 0;  // the round's first listed row
    for (int round = 0; round < num_rounds; ++round) {
      int round_end = round_begin, own = -1;
      for (; round_end < num_listed && listed[round_end].round == round; ++round_end) {
        const CombineRow& r = listed[round_end];
        if (r.first_warp <= warp && warp < r.first_warp + r.warps) own = round_end;
      }
      round_begin = round_end;
      float m = -INFINITY, l = 0.0f;
      float4 acc[kVecs];
      CombineRow r{};
      if (own >= 0) {
        r = listed[own];
        MergeShare<kHeadSize>(p, r, warp - r.first_warp, m, l, acc);
        if (r.warps == 1) {
          write_row(r, l, acc);
        } else {
          if (lane == 0) {
            warp_max[warp] = m;
            warp_sum[warp] = l;
          }
#pragma unroll
          for (int v = 0; v < kVecs; ++v) warp_acc[warp][v * 32 + lane] = acc[v];
        }
      }
      __syncthreads();
      if (own >= 0 && r.warps > 1 && warp == r.first_warp) {  // the row's warps merge here
        float row_max = -INFINITY;
        for (int w = warp; w < warp + r.warps; ++w) row_max = fmaxf(row_max, warp_max[w]);
        l = 0.0f;
#pragma unroll
        for (int v = 0; v < kVecs; ++v) acc[v] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row_max != -INFINITY) {
          for (int w = warp; w < warp + r.warps; ++w) {
            const float s = __expf(warp_max[w] - row_max);  // 0 for a warp with nothing
            l += s * warp_sum[w];
#pragma unroll
            for (int v = 0; v < kVecs; ++v) {
              const float4 a = warp_acc[w][v * 32 + lane];
              acc[v] = make_float4(acc[v].x + s * a.x, acc[v].y + s * a.y, acc[v].z + s * a.z,
                                   acc[v].w + s * a.w);
            }
          }
        }
        write_row(r, l, acc);
      }
      __syncthreads();  // warp_acc is the next round's
    }
  }
}

template <typename T, int kHeadSize, typename Batch>
__global__ void __launch_bounds__(kCombineThreads)
    CombinePartitionsKernel(Params p, Batch batch, int64_t rows) {
  cuda::sm90::WaitForPrerequisiteGrid();  // launched early, behind the attention kernel
  cuda::sm90::LaunchDependents();
  CombinePartitions<T, kHeadSize>(p, batch, rows);
}

// Launches the combine of `rows` (sequence, head) rows behind the attention kernel on `stream`
// (it waits for it on the GPU): at most a CTA per row, and no more than the GPU holds at once.
template <typename T, int kHeadSize, typename Batch>
void LaunchCombine(const Params& p, const Batch& batch, int64_t rows, cudaStream_t stream) {
  constexpr int64_t kCtasWithoutDeviceInfo = 1024;
  int64_t ctas = std::min(rows, kCtasWithoutDeviceInfo);
  if (const std::optional<cuda::DeviceInfo> device = cuda::CurrentDeviceInfo()) {
    ctas = cuda::OneWaveCtas(
        reinterpret_cast<const void*>(&CombinePartitionsKernel<T, kHeadSize, Batch>), *device,
        kCombineThreads, rows);
  }
  cuda::LaunchProgrammatic(CombinePartitionsKernel<T, kHeadSize, Batch>,
                           dim3(static_cast<unsigned>(ctas)), dim3(kCombineThreads), 0, stream,
                           p, batch, rows);
}

}  // namespace xla_ext::attention::decode

#endif  // XLA_EXT_KERNELS_ATTENTION_SPLIT_KV_CUH_
