// Ragged paged attention on tensor cores with mma.sync m16n8k16 (FlashAttention-2 layout; TMA
// bulk copies) for f16/bf16 queries and caches on Hopper: prefill chunks (and decodes, unless
// the decode-step kernel takes them: decode_steps.cuh) in one launch, over the tiles and
// (tile, stage) units of tiled_batch.cuh, split between the CTAs on the device by the actual q
// and kv lengths. tiled_warpgroup.cuh (wgmma) takes the head sizes it has; this kernel the
// others up to 128.
// - A tile is kTileRows rows. Each block of 16 rows is the A operand of S = Q K^T for one
//   consumer warp; a tile of one or two blocks (decodes, short chunks) has several warps per
//   block, each taking its share of every stage's positions, merged at the tile's end.
// - As in the decode kernel, stages stream through a ring of kStages buffers: a producer warp
//   walks the same units and copies each position's K and V rows (adjacent in the cache) with
//   one TMA bulk copy, zero-filling positions past the tile's last one or in a page outside
//   the cache (those also get no weight); a buffer's `full` mbarrier completes when its bytes
//   have landed, its `empty` one when every consumer thread is done with it. No CTA-wide
//   barrier in the loop (an earlier version, whose threads all issued 16-byte cp.async copies
//   with a barrier per stage, was bound by instruction issue and latency, not by bytes).
#ifndef XLA_EXT_KERNELS_ATTENTION_TILED_TENSOR_CORE_CUH_
#define XLA_EXT_KERNELS_ATTENTION_TILED_TENSOR_CORE_CUH_

#include <cmath>
#include <cstdint>

#include "kernels/attention/gpu_share.cuh"
#include "kernels/attention/tiled_batch.cuh"
#include "kernels/common/balanced_split.cuh"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"

namespace xla_ext::attention::ragged::tensor_core {

// 7 consumer warps (16 rows of a tile each) and a producer: 8 warps, two per SM sub-partition,
// may hold up to 255 registers each (9 warps would be capped at 168 and spill).
constexpr int kWarps = 7;
constexpr int kThreads = (kWarps + 1) * 32;
constexpr int kTileRows = kWarps * 16;
constexpr int kStages = 4;
constexpr int kRowPadding = 16;  // bytes: ldmatrix's 8 rows fall in distinct banks
constexpr int kStageTokens = tiled::kMinStageTokens;  // 8 n8 tiles of S, 4 k16 steps of P V
using tiled::Params;
using UnitWalk = tiled::UnitWalk<kStageTokens>;

// Shared memory: per stage a `full` and an `empty` mbarrier and the mask of its positions
// that have a row, the scheduler's scratch, then the stages (per position its K row then its V
// row, as in the cache), then where warps that split a stage's positions meet at the end of a
// tile (per warp: 16 rows of output, maxima, sums). All of it dynamic: static shared memory
// would lower the dynamic maximum a kernel may opt in to.
constexpr int kScheduleScratchInts = cuda::balanced::ScratchInts(kThreads);
constexpr int kHeaderBytes =
    (kStages * (2 * sizeof(uint64_t) + sizeof(uint2)) + kScheduleScratchInts * sizeof(int) + 15) /
    16 * 16;

template <typename T, int kHeadDim>
struct Layout {
  static constexpr int kRowBytes = 2 * kHeadDim * sizeof(T);  // a position's K and V rows
  static constexpr int kRowStride = kRowBytes + kRowPadding;
  static constexpr int kStageBytes = kStageTokens * kRowStride;
  static constexpr int kMergeBytes = kWarps * 16 * (kHeadDim + 2) * sizeof(float);
  static constexpr int kSharedBytes = kHeaderBytes + kStages * kStageBytes + kMergeBytes;
};

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, 1) AttendKernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace sm90 = cuda::sm90;
  using L = Layout<T, kHeadDim>;
  constexpr int kSteps = kHeadDim / 16;  // k16 steps of Q K^T
  constexpr int kTiles = kHeadDim / 8;   // n8 tiles of O
  constexpr int kScoreTiles = kStageTokens / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // a stage's rows have landed
  uint64_t* empty = full + kStages;                      // every consumer is done with it
  uint2* stage_masks = reinterpret_cast<uint2*>(empty + kStages);  // positions with a row
  int* schedule_scratch = reinterpret_cast<int*>(stage_masks + kStages);
  unsigned char* stages = smem + kHeaderBytes;
  float* merge_out = reinterpret_cast<float*>(stages + kStages * L::kStageBytes);
  float* merge_max = merge_out + kWarps * 16 * kHeadDim;
  float* merge_sum = merge_max + kWarps * 16;

  const int kv_head = blockIdx.y;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = p.group_size;
  if (threadIdx.x == 0) {
    for (int slot = 0; slot < kStages; ++slot) {
      sm90::BarrierInit(sm90::SharedAddress(&full[slot]), 32);  // the producer warp's lanes
      sm90::BarrierInit(sm90::SharedAddress(&empty[slot]), kWarps * 32);
    }
    sm90::FenceBarrierInit();
  }
  sm90::LaunchDependents();  // the decode-step kernel (gpu_share.cuh) or the combine
  const int num_seqs = NumSeqs(p);
  const OwnedRows owned_rows = OwnedRowsOf(p, num_seqs);
  // (Its barriers also publish the mbarrier initialisation to the CTA.)
  const cuda::balanced::Range range =
      LocateTiledRange<kStageTokens>(p, owned_rows, num_seqs, schedule_scratch);
  if (range.begin >= range.end) return;  // more CTAs than units
  const int num_iters = range.end - range.begin;

  if (warp == kWarps) {
    // Producer: one TMA bulk copy per position of a stage (its K and V rows of this kv head are
    // adjacent in the cache), lane l taking positions l and l + 32; the page ids of the next
    // stage are loaded before waiting for its buffer.
    const T* kv = static_cast<const T*>(p.kv_pages);
    const int64_t position_stride = int64_t{2} * p.num_kv_heads * kHeadDim;  // elements
    const int offset_mask = (1 << p.log2_page_size) - 1;
    const uint64_t read_once = sm90::EvictFirstPolicy();
    UnitWalk loads;
    loads.Start(p, owned_rows, range.first_seq, range.first_seq_begin, range.begin);
    const auto row_offsets = [&](int64_t (&offsets)[2]) {
      const int first_pos = loads.FirstPosition();
      const int end = loads.t.first_pos + loads.t.tokens;
      const int32_t* pages = p.page_indices + static_cast<int64_t>(loads.seq) * p.pages_per_seq;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int pos = first_pos + lane + 32 * k;
        const int page = pos < end ? __ldg(pages + (pos >> p.log2_page_size)) : -1;
        offsets[k] = page >= 0 && page < p.num_pages
                         ? ((static_cast<int64_t>(page) << p.log2_page_size) +
                            (pos & offset_mask)) * position_stride +
                               int64_t{2} * kv_head * kHeadDim
                         : -1;
      }
    };
    int64_t offsets[2];
    row_offsets(offsets);
    for (int iter = 0; iter < num_iters; ++iter) {
      const int slot = iter % kStages;
      int64_t next[2] = {-1, -1};
      if (iter + 1 < num_iters) {
        loads.Next(p);
        row_offsets(next);
      }
      if (iter >= kStages) {
        sm90::WaitParity(sm90::SharedAddress(&empty[slot]), (iter / kStages - 1) & 1);
      }
      unsigned char* stage = stages + slot * L::kStageBytes;
      const uint32_t barrier = sm90::SharedAddress(&full[slot]);
      uint32_t bytes = 0;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (offsets[k] >= 0) {
          bytes += L::kRowBytes;
        } else {
          // A position without a row: zeros (weight 0 times finite values), released to the
          // consumers by this lane's arrive below, ordered before later TMA writes to them.
          unsigned char* row = stage + (lane + 32 * k) * L::kRowStride;
          for (int i = 0; i < L::kRowBytes; i += 16) {
            *reinterpret_cast<uint4*>(row + i) = make_uint4(0, 0, 0, 0);
          }
          sm90::FenceProxyAsync();
        }
      }
      const uint32_t mask_lo = __ballot_sync(0xffffffffu, offsets[0] >= 0);
      const uint32_t mask_hi = __ballot_sync(0xffffffffu, offsets[1] >= 0);
      const uint32_t total = __reduce_add_sync(0xffffffffu, bytes);
      // Every lane arrives, releasing its own shared-memory writes (lane 0: the mask).
      if (lane == 0) {
        stage_masks[slot] = make_uint2(mask_lo, mask_hi);
        sm90::ArriveExpectBytes(barrier, total);
      } else {
        sm90::Arrive(barrier);
      }
      __syncwarp();  // the bytes are expected before any copy can complete
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (offsets[k] >= 0) {
          sm90::BulkCopyToShared(sm90::SharedAddress(stage + (lane + 32 * k) * L::kRowStride),
                                 kv + offsets[k], L::kRowBytes, barrier, read_once);
        }
      }
      offsets[0] = next[0];
      offsets[1] = next[1];
    }
    return;
  }

  UnitWalk work;
  work.Start(p, owned_rows, range.first_seq, range.first_seq_begin, range.begin);

  // A tile's rows come in blocks of 16, one per warp. A tile of one or two blocks (decodes,
  // short chunks) would leave most warps idle, and one warp's arithmetic per stage is slower
  // than the stage's copies: then `slices` warps share each block, warp `slice` taking the
  // 16-position slices m of a stage with m % slices == slice, and they merge at the tile's end.
  // Rows of this lane: lo = 16 * row_block + lane / 4 and hi = lo + 8; the A fragments hold
  // columns 2 * (lane % 4) + {0, 1} and + 8 of each k16 step.
  const int col = 2 * (lane % 4);
  int row_blocks = 1, slices = 1, row_block = 0, slice = 0;
  int rows[2] = {0, 0};
  uint32_t qa[kSteps][4];
  float running_max[2], running_sum[2];
  float o[kTiles][4];
  // The tile in progress: its rows' tokens (in the batch; -1: a row past its tokens) and
  // positions, and the positions the warp's rows may see.
  int row_token[2], row_pos[2];
  int warp_first_pos = 0, warp_last_pos = -1;
  int piece_first_unit = 0;  // where this CTA's piece of it started
  bool piece_from_start = false;

  const auto start_tile = [&](const UnitWalk& w) {
    const int first_token = w.s.q_start + w.t.first_token;
    row_blocks = (w.t.tokens * group + 15) / 16;
    slices = row_blocks * 4 <= kWarps ? 4 : row_blocks * 2 <= kWarps ? 2 : 1;
    row_block = warp % row_blocks;
    slice = warp / row_blocks;  // >= slices: the warp has no part in this tile
    const bool active = slice < slices;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rows[r] = 16 * row_block + lane / 4 + 8 * r;
      const int token = rows[r] / group;
      const bool valid = active && token < w.t.tokens;
      row_token[r] = valid ? first_token + token : -1;
      row_pos[r] = w.t.first_pos + token;
      const T* q = static_cast<const T*>(p.q) +
                   (static_cast<int64_t>(valid ? row_token[r] : 0) * p.num_q_heads +
                    kv_head * group + rows[r] % group) * kHeadDim + col;
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
        qa[step][r] = valid ? *reinterpret_cast<const uint32_t*>(q + step * 16) : 0u;
        qa[step][r + 2] = valid ? *reinterpret_cast<const uint32_t*>(q + step * 16 + 8) : 0u;
      }
      running_max[r] = -INFINITY;
      running_sum[r] = 0.0f;
    }
#pragma unroll
    for (int n = 0; n < kTiles; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
    const int warp_first_token = (16 * row_block) / group;
    const int warp_last_token = min((16 * row_block + 15) / group, w.t.tokens - 1);
    warp_first_pos = w.t.first_pos + warp_first_token;
    warp_last_pos = active ? w.t.first_pos + warp_last_token : -1;
    tiled::AnnounceTile(p, w, range);
  };

  // Writes this CTA's piece of the tile: `out` itself when it is the whole tile, else its
  // record (2 * CTA, or 2 * CTA + 1 when the piece is not the CTA's first).
  const auto finish_tile = [&](bool whole) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 1);
      running_sum[r] += __shfl_xor_sync(0xffffffffu, running_sum[r], 2);
    }
    if (slices > 1) {  // the same for the whole CTA
      // Warps of slices 1.. hand their state to the block's slice-0 warp.
      const int row16[2] = {lane / 4, lane / 4 + 8};
      if (slice > 0 && slice < slices) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float* dst = merge_out + (warp * 16 + row16[r]) * kHeadDim + col;
#pragma unroll
          for (int n = 0; n < kTiles; ++n) {
            *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
          }
          if (lane % 4 == 0) {
            merge_max[warp * 16 + row16[r]] = running_max[r];
            merge_sum[warp * 16 + row16[r]] = running_sum[r];
          }
        }
      }
      sm90::NamedBarrierSync(1, kWarps * 32);  // the consumer warps
      if (slice == 0) {
        for (int other = 1; other < slices; ++other) {
          const int from = other * row_blocks + row_block;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float their_max = merge_max[from * 16 + row16[r]];
            const float new_max = fmaxf(running_max[r], their_max);
            const bool none = new_max == -INFINITY;
            const float mine = none ? 0.0f : cuda::Exp2(running_max[r] - new_max);
            const float theirs = none ? 0.0f : cuda::Exp2(their_max - new_max);
            running_sum[r] = running_sum[r] * mine + merge_sum[from * 16 + row16[r]] * theirs;
            running_max[r] = new_max;
            const float* src = merge_out + (from * 16 + row16[r]) * kHeadDim + col;
#pragma unroll
            for (int n = 0; n < kTiles; ++n) {
              const float2 v = *reinterpret_cast<const float2*>(src + n * 8);
              o[n][2 * r] = o[n][2 * r] * mine + v.x * theirs;
              o[n][2 * r + 1] = o[n][2 * r + 1] * mine + v.y * theirs;
            }
          }
        }
      }
      // Read before any warp hands over its next tile.
      sm90::NamedBarrierSync(1, kWarps * 32);
      if (slice != 0) return;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (row_token[r] < 0) continue;
      const int head = kv_head * group + rows[r] % group;
      if (whole) {
        const float scale = running_sum[r] > 0.0f ? p.v_scale / running_sum[r] : 0.0f;
        uint32_t* dst = reinterpret_cast<uint32_t*>(
            static_cast<T*>(p.out) +
            (static_cast<int64_t>(row_token[r]) * p.num_q_heads + head) * kHeadDim + col);
#pragma unroll
        for (int n = 0; n < kTiles; ++n) {
          dst[n * 4] = sm90::Pack<T>(o[n][2 * r] * scale, o[n][2 * r + 1] * scale);
        }
      } else {
        const int64_t at = tiled::RecordRow(p, range, piece_first_unit, rows[r]);
        float2* dst = reinterpret_cast<float2*>(p.partial_out + at * kHeadDim + col);
#pragma unroll
        for (int n = 0; n < kTiles; ++n) dst[n * 4] = make_float2(o[n][2 * r], o[n][2 * r + 1]);
        if (lane % 4 == 0) {
          p.partial_max[at] = running_max[r];
          p.partial_sum[at] = running_sum[r];
        }
      }
    }
  };

  // ldmatrix row addresses of this lane relative to a stage's K or V rows (as in the decode
  // kernel): K, matrix j = lane / 8 is (positions 8 * (j / 2).., columns 8 * (j % 2)..);
  // V, transposed: (positions 8 * (j % 2).., columns 8 * (j / 2)..).
  const int j = lane / 8;
  const int k_lane = ((j / 2) * 8 + lane % 8) * L::kRowStride + (j % 2) * 8 * sizeof(T);
  const int v_lane = ((j % 2) * 8 + lane % 8) * L::kRowStride + (j / 2) * 8 * sizeof(T);

  // A score's logit in log2 units: scaled, soft-capped, times log2 e.
  const float log2_scale = p.score_scale * cuda::kLog2e;
  const float cap_scale = p.soft_cap > 0.0f ? p.score_scale / p.soft_cap : 0.0f;
  const float log2_cap = p.soft_cap * cuda::kLog2e;
  const auto logit2 = [&](float dot) {
    return p.soft_cap > 0.0f ? log2_cap * tanhf(dot * cap_scale) : dot * log2_scale;
  };

  for (int iter = 0; iter < num_iters; ++iter) {
    const int slot = iter % kStages;
    sm90::WaitParity(sm90::SharedAddress(&full[slot]), (iter / kStages) & 1);
    const uint2 mask = stage_masks[slot];

    if (work.stage == 0 || iter == 0) {
      start_tile(work);
      piece_first_unit = range.begin + iter;
      piece_from_start = work.stage == 0;
    }
    const int first_pos = work.FirstPosition();
    const bool visible =
        first_pos <= warp_last_pos &&
        (p.sliding_window == 0 ||
         first_pos + kStageTokens - 1 > warp_first_pos - p.sliding_window);
    if (visible) {
      const uint32_t k_base = sm90::SharedAddress(stages + slot * L::kStageBytes);
      const uint32_t v_base = k_base + kHeadDim * sizeof(T);

      // S (16 rows x kStageTokens positions) = Q K^T.
      float s[kScoreTiles][4];
#pragma unroll
      for (int n = 0; n < kScoreTiles; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
#pragma unroll
      for (int step = 0; step < kSteps; ++step) {
#pragma unroll
        for (int m = 0; m < kScoreTiles / 2; ++m) {
          if (m % slices != slice) continue;
          uint32_t b[4];
          sm90::LoadMatrixX4(b, k_base + m * 16 * L::kRowStride + k_lane + step * 16 * sizeof(T));
          sm90::Mma16816<T>(s[2 * m], qa[step], b[0], b[1], s[2 * m]);
          sm90::Mma16816<T>(s[2 * m + 1], qa[step], b[2], b[3], s[2 * m + 1]);
        }
      }

      // Logits in log2 units (each weight is then one exp2), masked (causal, window,
      // positions without a page, rows past the tile), then the online softmax per row;
      // s[n][i] is row i / 2, position n * 8 + col + i % 2. A stage every row of the warp
      // sees whole (most of a long prefill's) skips the masks: a third of the loop's
      // instructions on prefill 4 x 2048, by Nsight Compute's per-instruction counts.
      const bool unmasked =
          slices == 1 && (mask.x & mask.y) == 0xffffffffu &&
          first_pos + kStageTokens - 1 <= warp_first_pos &&
          (p.sliding_window == 0 || first_pos > warp_last_pos - p.sliding_window);
      float tile_max[2] = {-INFINITY, -INFINITY};
      if (unmasked) {
#pragma unroll
        for (int n = 0; n < kScoreTiles; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            s[n][i] = logit2(s[n][i]);
            tile_max[i / 2] = fmaxf(tile_max[i / 2], s[n][i]);
          }
        }
      } else {
#pragma unroll
        for (int n = 0; n < kScoreTiles; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i / 2;
            const int index = n * 8 + col + i % 2;
            const int pos = first_pos + index;
            const bool has_row = ((index < 32 ? mask.x : mask.y) >> (index % 32)) & 1u;
            const bool seen = n / 2 % slices == slice && row_token[r] >= 0 && has_row &&
                              pos <= row_pos[r] &&
                              (p.sliding_window == 0 || pos > row_pos[r] - p.sliding_window);
            s[n][i] = seen ? logit2(s[n][i]) : -INFINITY;
            tile_max[r] = fmaxf(tile_max[r], s[n][i]);
          }
        }
      }
      float scale_old[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_max = fmaxf(running_max[r], tile_max[r]);
        base[r] = new_max == -INFINITY ? 0.0f : new_max;  // nothing seen yet: all weights 0
        scale_old[r] = cuda::Exp2(running_max[r] - base[r]);
        running_max[r] = new_max;
        running_sum[r] *= scale_old[r];
      }
#pragma unroll
      for (int n = 0; n < kScoreTiles; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s[n][i] = cuda::Exp2(s[n][i] - base[i / 2]);
          running_sum[i / 2] += s[n][i];
        }
      }
      // Once a prefill row's maximum has settled, most stages leave it alone.
      if (!__all_sync(0xffffffffu, scale_old[0] == 1.0f && scale_old[1] == 1.0f)) {
#pragma unroll
        for (int n = 0; n < kTiles; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) o[n][i] *= scale_old[i / 2];
      }

      // O += P V, k16 step by step: P's A fragment is S's accumulators, rounded to T.
#pragma unroll
      for (int step = 0; step < kStageTokens / 16; ++step) {
        if (step % slices != slice) continue;
        const uint32_t pa[4] = {sm90::Pack<T>(s[2 * step][0], s[2 * step][1]),
                                sm90::Pack<T>(s[2 * step][2], s[2 * step][3]),
                                sm90::Pack<T>(s[2 * step + 1][0], s[2 * step + 1][1]),
                                sm90::Pack<T>(s[2 * step + 1][2], s[2 * step + 1][3])};
#pragma unroll
        for (int n = 0; n < kTiles; n += 2) {
          uint32_t b[4];
          sm90::LoadMatrixX4Transposed(
              b, v_base + step * 16 * L::kRowStride + v_lane + n * 8 * sizeof(T));
          sm90::Mma16816<T>(o[n], pa, b[0], b[1], o[n]);
          sm90::Mma16816<T>(o[n + 1], pa, b[2], b[3], o[n + 1]);
        }
      }
    }

    // This thread is done with the buffer; the producer refills it once every consumer is.
    sm90::Arrive(sm90::SharedAddress(&empty[slot]));
    const bool tile_done = work.stage == work.t.stages - 1;
    if (tile_done || iter == num_iters - 1) finish_tile(piece_from_start && tile_done);
    if (iter + 1 < num_iters) work.Next(p);
  }
#else
  __trap();  // launched only on sm_90 and newer (see the plan)
#endif
}

}  // namespace xla_ext::attention::ragged::tensor_core

#endif  // XLA_EXT_KERNELS_ATTENTION_TILED_TENSOR_CORE_CUH_
