// A ragged batch as the tensor-core kernels (tiled_tensor_core.cuh: mma.sync;
// tiled_warpgroup.cuh: wgmma) walk it, and the merge of the pieces of tiles split between CTAs.
// - A tile is `tile_rows` query rows of one sequence and one kv head: tile_tokens consecutive
//   query tokens times the group's query heads (row = token * group + head), so every K/V row
//   a tile loads serves all of them.
// - A tile attends to kv positions from its first token's window start (0 without a window) to
//   its last token's position, in stages of kStageTokens positions (the kernel's choice, a
//   template parameter here): its units of work. The units of every tile of every sequence
//   (its tiles in the order TileOf gives) are split evenly between the CTAs of a kv head
//   (kernels/common/balanced_split.cuh, the decode kernel's scheduler, with a sequence's units
//   the stages of its tiles). A CTA walks its range of (tile, stage) units; a tile may
//   span CTAs, a CTA may hold many tiles.
// - A tile one CTA holds whole is written to `out` directly. Only a CTA's first and last tiles
//   can be pieces of a split tile: their (max, sum, unnormalised output) rows go to records
//   2 * CTA (first) and 2 * CTA + 1 (last), so the host sizes the records by the grid alone.
//   The CTA holding a tile's first stage tells its tokens' rows where their records are
//   (row_pieces); CombineKernel merges them, and writes zeros to rows no tile holds (padding,
//   sequences with q_len > kv_len), but not to the decode steps left to the decode-step
//   kernel, which runs beside the tiled kernel (gpu_share.cuh marks both kinds of row).
#ifndef XLA_EXT_KERNELS_ATTENTION_TILED_BATCH_CUH_
#define XLA_EXT_KERNELS_ATTENTION_TILED_BATCH_CUH_

#include <cmath>
#include <cstdint>

#include "kernels/attention/batch_params.cuh"
#include "kernels/common/balanced_split.cuh"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/sm90.cuh"

namespace xla_ext::attention::ragged::tiled {

constexpr int kMinStageTokens = 64;  // the smallest stage a kernel takes (the host's bounds)
constexpr int kMinCtaStages = 2;  // the fewest units a CTA takes
constexpr int kCombineWarps = 8;

struct Params : BatchParams {
  // Per query token: {first record, pieces, the tile's first token, 0}; pieces 1: written
  // directly; pieces -1: a decode step, which the decode-step kernel writes; all zero: nobody
  // writes the token's rows. The tiled kernel writes every token's (gpu_share.cuh's
  // MarkRowsWithoutTiles and AnnounceTile).
  int4* row_pieces;
  // Records [num_kv_heads, num_records, tile_rows] (partial_out: x head_dim): a piece's
  // running max (in log2 units), sum and unnormalised output per row.
  float* partial_out;
  float* partial_max;
  float* partial_sum;
  int num_records;  // per kv head: 2 * gridDim.x
  int tile_rows;
  int tile_tokens;   // tile_rows / group_size
  int stage_tokens;  // the kernel's stage (for the decode-step kernel's share of the GPU)
  // Sequences with one query row are left to the decode-step kernel (decode_steps.cuh), which
  // runs beside the tiled kernel, each on its share of the SMs (gpu_share.cuh).
  bool decode_steps_elsewhere;
  GpuShare share;
};

// A sequence the tiled kernel attends: none of its rows when the decode-step kernel takes it.
__device__ __forceinline__ Sequence TiledSequence(const Params& p, const OwnedRows& rows,
                                                  int i) {
  Sequence s = ReadSequence(p, rows, i);
  if (p.decode_steps_elsewhere && s.q_len == 1) s.q_len = 0;
  return s;
}

struct Tile {
  int first_token;  // within the sequence
  int tokens;
  int first_pos;    // the first token's kv position
  int first_stage;  // of the sequence's kv positions
  int stages;
};

__device__ __forceinline__ int TilesOf(const Params& p, const Sequence& s) {
  return (s.q_len + p.tile_tokens - 1) / p.tile_tokens;
}

// A sequence's j-th tile in walk order, in stages of stage_tokens positions (the kernel's
// constant): its tiles from both ends in turn (0, last, 1, last - 1, ...). Under a causal mask
// a tile's stages grow with its index while what a tile costs beyond its stages (loading its
// queries, writing its rows, its masked last stage) does not: in index order, the CTAs given
// a sequence's first tiles took longest (on prefill 4 x 2048 the SMs were active 81% of the
// kernel's time); in this order a range of units holds about as many tiles wherever it lies
// (95%, and 413 -> 349 us on the wgmma kernel).
__device__ __forceinline__ Tile TileOf(const Params& p, const Sequence& s, int j,
                                       int stage_tokens) {
  const int tile = j % 2 == 0 ? j / 2 : TilesOf(p, s) - 1 - j / 2;
  Tile t;
  t.first_token = tile * p.tile_tokens;
  t.tokens = min(p.tile_tokens, s.q_len - t.first_token);
  t.first_pos = s.kv_len - s.q_len + t.first_token;
  const int end = t.first_pos + t.tokens;  // past the last token's position
  const int begin = p.sliding_window > 0 ? max(0, t.first_pos - p.sliding_window + 1) : 0;
  t.first_stage = begin / stage_tokens;
  t.stages = (end + stage_tokens - 1) / stage_tokens - t.first_stage;
  return t;
}

__device__ __forceinline__ int UnitsOf(const Params& p, const OwnedRows& rows, int seq,
                                       int stage_tokens) {
  const Sequence s = TiledSequence(p, rows, seq);
  int units = 0;
  for (int j = 0, tiles = TilesOf(p, s); j < tiles; ++j) {
    units += TileOf(p, s, j, stage_tokens).stages;
  }
  return units;
}

// A walk over consecutive units (every thread of the CTA holds the same one).
template <int kStageTokens>
struct UnitWalk {
  OwnedRows rows;
  int seq;
  Sequence s;
  int tile;
  Tile t;
  int tile_begin;  // the unit (of the whole list) where the tile starts
  int stage;       // within the tile

  // Starts at `unit`, which lies in sequence `seq`, whose units start at `seq_begin`.
  __device__ void Start(const Params& p, const OwnedRows& owned, int first_seq, int seq_begin,
                        int unit) {
    rows = owned;
    seq = first_seq;
    s = TiledSequence(p, rows, seq);
    tile = 0;
    t = TileOf(p, s, 0, kStageTokens);
    tile_begin = seq_begin;
    while (unit >= tile_begin + t.stages) {
      tile_begin += t.stages;
      t = TileOf(p, s, ++tile, kStageTokens);
    }
    stage = unit - tile_begin;
  }

  // To the next unit; the caller knows there is one.
  __device__ void Next(const Params& p) {
    if (++stage < t.stages) return;
    stage = 0;
    tile_begin += t.stages;
    if (++tile < TilesOf(p, s)) {
      t = TileOf(p, s, tile, kStageTokens);
      return;
    }
    do {
      s = TiledSequence(p, rows, ++seq);
    } while (s.q_len == 0);
    tile = 0;
    t = TileOf(p, s, 0, kStageTokens);
  }

  __device__ int FirstPosition() const { return (t.first_stage + stage) * kStageTokens; }
};

// Called by the consumer threads of a CTA (at least tile_tokens of them, threadIdx.x from 0)
// starting tile w.t at its unit w: if the tile's first stage is this CTA's, tells its tokens'
// rows where their pieces' records are (kv head 0's CTAs do it for all: the split is the same
// for every kv head).
template <int kStageTokens>
__device__ __forceinline__ void AnnounceTile(const Params& p, const UnitWalk<kStageTokens>& w,
                                             const cuda::balanced::Range& range) {
  if (w.stage != 0 || blockIdx.y != 0 || threadIdx.x >= w.t.tokens) return;
  const int first_token = w.s.q_start + w.t.first_token;
  const int last_cta = (w.tile_begin + w.t.stages - 1) / range.chunk;
  const int first_record = 2 * blockIdx.x + (w.tile_begin == range.begin ? 0 : 1);
  p.row_pieces[first_token + threadIdx.x] =
      make_int4(first_record, last_cta - static_cast<int>(blockIdx.x) + 1, first_token, 0);
}

// Where row `row` of this CTA's piece of a tile is recorded: the CTA's first piece (which
// started at range.begin) in record 2 * CTA, its last in 2 * CTA + 1.
__device__ __forceinline__ int64_t RecordRow(const Params& p, const cuda::balanced::Range& range,
                                             int piece_first_unit, int row) {
  const int record = 2 * blockIdx.x + (piece_first_unit == range.begin ? 0 : 1);
  return (static_cast<int64_t>(blockIdx.y) * p.num_records + record) * p.tile_rows + row;
}

// The rows (token, query head): a token nobody writes gets zeros; one whose tile was split gets
// out = v_scale * sum_i w_i o_i / sum_i w_i l_i over its pieces' records i,
// w_i = 2^(m_i - max_i m_i) (maxima in log2 units; a piece that saw nothing has m_i = -inf:
// weight 0). A grid of at most what the GPU holds at once: warp w of W takes rows w, w + W,
// w + 2W, ..., 32 at a time, a lane each, which looks up its row's pieces and writes its zeros
// if it gets them; then the warp merges its split rows one after another. Consecutive rows,
// which are split or not together (a tile's), so go to different warps. (A warp per row, 32768
// CTAs on prefill 4 x 2048, took 32 us, nearly all of it launching warps whose tile had been
// written whole; 32 consecutive rows per warp left a 512-token chunk's split rows to a few
// warps, 48 us.)
template <typename T, int kHeadDim>
__device__ __forceinline__ void CombineRows(const Params& p) {
  constexpr int kPerLane = (kHeadDim + 31) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  const int64_t warps = int64_t{gridDim.x} * kCombineWarps;
  for (int64_t first = int64_t{blockIdx.x} * kCombineWarps + threadIdx.x / 32; first < rows;
       first += 32 * warps) {
    const int64_t lane_row = first + lane * warps;
    const int lane_pieces = lane_row < rows ? p.row_pieces[lane_row / p.num_q_heads].y : 1;
    if (lane_pieces == 0) {  // (-1: a decode step's row, the decode-step kernel's)
      uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(p.out) + lane_row * kHeadDim);
#pragma unroll
      for (int i = 0; i < kHeadDim * static_cast<int>(sizeof(T)) / 16; ++i) {
        out[i] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    uint32_t pending = __ballot_sync(0xffffffffu, lane_pieces > 1);
    while (pending != 0) {
      const int64_t row = first + (__ffs(pending) - 1) * warps;
      pending &= pending - 1;
      const int token = static_cast<int>(row / p.num_q_heads);
      const int head = static_cast<int>(row % p.num_q_heads);
      const int4 pieces = p.row_pieces[token];
      float acc[kPerLane];
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[i] = 0.0f;
      float sum = 0.0f;
      const int kv_head = head / p.group_size;
      const int tile_row = (token - pieces.z) * p.group_size + head % p.group_size;
      const auto at = [&](int piece) {  // the piece's record row
        const int record = piece == 0 ? pieces.x : 2 * (pieces.x / 2 + piece);
        return (static_cast<int64_t>(kv_head) * p.num_records + record) * p.tile_rows + tile_row;
      };
      float row_max = -INFINITY;
      for (int i = 0; i < pieces.y; ++i) row_max = fmaxf(row_max, p.partial_max[at(i)]);
      if (row_max != -INFINITY) {
        for (int i = 0; i < pieces.y; ++i) {
          const int64_t record = at(i);
          const float m = p.partial_max[record];
          if (m == -INFINITY) continue;
          const float weight = cuda::Exp2(m - row_max);
          sum += weight * p.partial_sum[record];
          const float* partial = p.partial_out + record * kHeadDim;
#pragma unroll
          for (int k = 0; k < kPerLane; ++k) {
            const int d = lane + 32 * k;
            if (d < kHeadDim) acc[k] += weight * partial[d];
          }
        }
      }
      const float scale = sum > 0.0f ? p.v_scale / sum : 0.0f;
      T* out = static_cast<T*>(p.out) + row * kHeadDim;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        const int d = lane + 32 * k;
        if (d < kHeadDim) out[d] = cuda::FromFloat<T>(acc[k] * scale);
      }
    }
  }
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32) CombineKernel(Params p) {
  cuda::sm90::WaitForPrerequisiteGrid();  // launched early, behind the attention kernel
  cuda::sm90::LaunchDependents();
  CombineRows<T, kHeadDim>(p);
}

}  // namespace xla_ext::attention::ragged::tiled

#endif  // XLA_EXT_KERNELS_ATTENTION_TILED_BATCH_CUH_
