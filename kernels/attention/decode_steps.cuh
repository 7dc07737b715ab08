// The decode steps of a ragged batch (its sequences with one query row) as a batch of the
// decode engine (decode_tensor_core.cuh, paged_attention's kernel), which streams
// whole token rows of every kv head at close to copy bandwidth. The ragged tensor-core kernel
// loads one kv head's rows per CTA, a TMA copy of 512 bytes each, and its producer warp issues
// them one lane at a time: on decode steps that, not the bytes, set its time (its producer's
// copy instructions were where Nsight Compute's samples stalled). So the handler runs both,
// side by side
// (gpu_share.cuh): the ragged kernel on the sequences with more than one query row, this one on
// the rest.
#ifndef XLA_EXT_KERNELS_ATTENTION_DECODE_STEPS_CUH_
#define XLA_EXT_KERNELS_ATTENTION_DECODE_STEPS_CUH_

#include <cmath>
#include <cstdint>

#include "kernels/attention/batch_params.cuh"
#include "kernels/attention/gpu_share.cuh"
#include "kernels/attention/split_kv.cuh"
#include "kernels/attention/tiled_batch.cuh"
#include "kernels/common/balanced_split.cuh"

namespace xla_ext::attention::ragged {

// Sequence i of the decode kernel's batch is sequence i of the ragged batch; it has tokens to
// attend only if it is a decode step (gpu_share.cuh's DecodeStepOf), and its row is its query
// token.
// It runs beside the tiled kernel: it reads global memory before that grid ends, and on its
// share of the SMs.
struct DecodeSteps {
  tiled::Params batch;  // the tiled kernel's: the batch, and its tiles and stages
  static constexpr bool kWaitsBeforeReading = false;
  static constexpr bool kFillsOtherRows = false;  // the tiled kernel's combine writes them

  __device__ Sequence StepOf(int seq) const {
    const int num_seqs = NumSeqs(batch);
    if (seq >= num_seqs) return {0, 0, 0};
    return DecodeStepOf(batch, OwnedRowsOf(batch, num_seqs), seq);
  }
  __device__ int Length(const decode::Params&, int seq) const {
    return StepOf(seq).kv_len;
  }
  __device__ int64_t Row(const decode::Params&, int seq) const {
    const Sequence s = StepOf(seq);
    return s.q_len == 1 ? s.q_start : -1;
  }
  __device__ int ActiveCtas(const decode::Params&, int units, int* scratch) const {
    if (units == 0) return 1;  // nothing to split (the tiled kernel gets every SM)
    const int num_seqs = NumSeqs(batch);
    const OwnedRows rows = OwnedRowsOf(batch, num_seqs);
    int local = 0;
    for (int i = threadIdx.x; i < num_seqs; i += blockDim.x) {
      local += tiled::UnitsOf(batch, rows, i, batch.stage_tokens);
    }
    return SplitSms(batch.share, batch.num_kv_heads, cuda::balanced::BlockSum(local, scratch),
                    units)
        .decode_ctas;
  }
};

// A batch the caller promises holds decode steps only (the op's max_q_len = 1): the decode
// kernel runs alone, with no tiled kernel beside it and no combine behind it (it merges split
// sequences itself: Params::fused_combine), so it also writes the rows no decode step owns:
// zeros where the op's contract says so, NaN in the rows of a sequence with more than one
// (the promise broken: visibly wrong, not plausibly). On the H100's B=1 serving step the empty
// tiled launch and the combine were 7 of the layer's 26 us of attention.
struct DecodeOnlySteps {
  BatchParams batch;
  static constexpr bool kWaitsBeforeReading = true;  // the K/V write before it, first
  static constexpr bool kFillsOtherRows = true;

  __device__ Sequence StepOf(int seq) const {
    const int num_seqs = NumSeqs(batch);
    if (seq >= num_seqs) return {0, 0, 0};
    return DecodeStepOf(batch, OwnedRowsOf(batch, num_seqs), seq);
  }
  __device__ int Length(const decode::Params&, int seq) const { return StepOf(seq).kv_len; }
  __device__ int64_t Row(const decode::Params&, int seq) const {
    const Sequence s = StepOf(seq);
    return s.q_len == 1 ? s.q_start : -1;
  }
  __device__ int ActiveCtas(const decode::Params&, int, int*) const {
    return static_cast<int>(gridDim.x);
  }
  // Calls fill(row, value) for this CTA's share (CTA `cta` of `ctas`) of the rows no decode
  // step owns.
  template <typename Fill>
  __device__ void ForEachOtherRow(int cta, int ctas, Fill fill) const {
    const int num_seqs = NumSeqs(batch);
    const OwnedRows rows = OwnedRowsOf(batch, num_seqs);
    for (int t = cta; t < rows.first; t += ctas) fill(t, 0.0f);
    for (int t = rows.end + cta; t < batch.num_tokens; t += ctas) fill(t, 0.0f);
    for (int i = cta; i < num_seqs; i += ctas) {
      const Sequence s = ReadSequence(batch, rows, i);
      if (s.q_len == 1) continue;
      const float value = s.q_len > 1 ? NAN : 0.0f;
      for (int t = s.q_start, end = OwnedRowAt(batch, rows, i + 1); t < end; ++t) fill(t, value);
    }
  }
};

// After the tiled kernel and the decode-step kernel beside it: the decode steps' rows
// (decode::CombinePartitions), then the tiled kernel's (tiled::CombineRows), in one
// kernel launched programmatically behind the decode-step kernel, whose grid ends after the
// tiled one. (Two combine kernels, one behind the other, put one more launch and wait at the end
// of every call. The decode steps first: a long sequence's split rows are the call's last work.)
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(tiled::kCombineWarps * 32)
    CombineKernel(tiled::Params tiled_rows, decode::Params decode_rows,
                  int64_t num_decode_rows) {
  static_assert(tiled::kCombineWarps * 32 == decode::kCombineThreads,
                "both combines run in one CTA shape");
  cuda::sm90::WaitForPrerequisiteGrid();
  cuda::sm90::LaunchDependents();
  decode::CombinePartitions<T, kHeadDim>(decode_rows, DecodeSteps{tiled_rows},
                                                  num_decode_rows);
  tiled::CombineRows<T, kHeadDim>(tiled_rows);
}

// The decode kernel's parameters for the ragged batch `p` (its records and seq_records are the
// caller's): the combined cache, K and V of a kv head interleaved.
inline decode::Params DecodeStepParams(const BatchParams& p) {
  decode::Params d{};
  d.query = p.q;
  d.key_cache = p.kv_pages;
  d.value_cache = p.kv_pages;
  d.block_tables = p.page_indices;
  d.out = p.out;
  d.num_seqs = p.max_num_seqs;
  d.num_heads = p.num_q_heads;
  d.num_kv_heads = p.num_kv_heads;
  d.num_blocks = p.num_pages;
  d.max_blocks_per_seq = p.pages_per_seq;
  d.log2_block_size = p.log2_page_size;
  d.num_partitions = 1;
  d.scale = p.score_scale;
  d.softcap = p.soft_cap;
  d.window = p.sliding_window;
  d.out_scale = p.v_scale;
  d.kv_interleaved = true;
  return d;
}

}  // namespace xla_ext::attention::ragged

#endif  // XLA_EXT_KERNELS_ATTENTION_DECODE_STEPS_CUH_
