// The tiled kernel (the sequences with more than one query row) and the decode-step kernel (the
// rest) run at the same time, each on its share of the SMs: a mixed batch's chunks are
// arithmetic and its decode steps stream the cache, and one after the other they added up (on
// 4 chunks of 256 + 60 decodes x 1024 on the H100, 46 then 98 us in a GPU trace).
// - The decode-step kernel is launched programmatically behind the tiled kernel, which lets it
//   launch as soon as every tiled CTA has started. It reads nothing the tiled kernel writes,
//   and every CTA of it waits for the tiled grid before exiting, so the kernels behind it (the
//   combines, which wait for their previous grid) start after both.
// - Every CTA of both kernels makes the same split from the batch on the device: its tiled
//   units and decode-step units, times what each costs an SM (GpuShare, the host's estimates).
//   A kernel's work goes to its first CTAs (balanced_split.cuh); the others exit at once,
//   which frees their SMs for the other kernel's.
// - The split: with T and D the two kernels' SM times and the decode steps streaming r times
//   faster per SM than while every SM streams (fewer SMs share the bandwidth), the tiled kernel
//   gets the part r T / (r T + D) of the SMs, which makes the two times equal. r is
//   kDecodeSpeedupPercent / 100: on the H100 the decode kernel on 68 of the 132 SMs, beside
//   the tiled kernel on the rest, streamed 1.4 times faster per SM. (With the decode kernel's
//   L2 prefetches off beside the tiled kernel, builds with r = 1.25 and 1.8 were both slower
//   than 1.5 on that mix, so 1.5 is fixed here.)
#ifndef XLA_EXT_KERNELS_ATTENTION_GPU_SHARE_CUH_
#define XLA_EXT_KERNELS_ATTENTION_GPU_SHARE_CUH_

#include "kernels/attention/batch_params.cuh"
#include "kernels/attention/decode_tensor_core.cuh"
#include "kernels/attention/tiled_batch.cuh"
#include "kernels/common/balanced_split.cuh"

namespace xla_ext::attention::ragged {

constexpr int kDecodeSpeedupPercent = 150;
static_assert(kDecodeSpeedupPercent >= 100, "an SM streams at least its share");

// Active CTAs along each grid's x.
struct SmSplit {
  int tiled_ctas;
  int decode_ctas;
};

// The split for a batch of `tiled_units` (per kv head) and `decode_units` (per kv-head group).
// In doubles with no a * b + c (which the compiler may fuse in one kernel and not the other):
// both kernels must get the same numbers.
__device__ __forceinline__ SmSplit SplitSms(const GpuShare& g, int num_kv_heads, int tiled_units,
                                            int decode_units) {
  if (decode_units == 0 || g.decode_workers == 0) return {g.tiled_workers, 0};
  if (tiled_units == 0) return {0, g.decode_workers};
  // r T and D.
  const double tiled = static_cast<double>(tiled_units) * num_kv_heads * g.tiled_unit_ns *
                       (kDecodeSpeedupPercent / 100.0);
  const double decode = static_cast<double>(decode_units) * g.decode_groups * g.decode_unit_ns;
  const double part = 1.0 / (decode / tiled + 1.0);
  const double tiled_ctas = ceil(part * g.sms * g.tiled_ctas_per_sm / num_kv_heads);
  SmSplit split;
  split.tiled_ctas = static_cast<int>(fmin(fmax(tiled_ctas, 1.0), g.tiled_workers));
  const int tiled_sms =
      (split.tiled_ctas * num_kv_heads + g.tiled_ctas_per_sm - 1) / g.tiled_ctas_per_sm;
  split.decode_ctas =
      min(max((g.sms - tiled_sms) * g.decode_ctas_per_sm / g.decode_groups, 1), g.decode_workers);
  return split;
}

// Sequence `seq` (< num_seqs) if it is a decode step, which the decode-step kernel takes (one
// query row after the clamps of ReadSequence; tiled::TiledSequence leaves it out), else an
// empty one.
__device__ __forceinline__ Sequence DecodeStepOf(const BatchParams& p, const OwnedRows& rows,
                                                 int seq) {
  const Sequence s = ReadSequence(p, rows, seq);
  return s.q_len == 1 ? s : Sequence{0, 0, 0};
}

// The decode-step kernel's units of sequence `seq` (< num_seqs), in its stages.
__device__ __forceinline__ int DecodeStepUnits(const BatchParams& p, const OwnedRows& rows,
                                               int seq) {
  return decode::tensor_core::UnitsOf(p.sliding_window,
                                               DecodeStepOf(p, rows, seq).kv_len);
}

// Writes the row_pieces entries of the query rows no tile announces (AnnounceTile writes the
// others), so that the combine can read every row's and nothing has to clear them first (that
// was a kernel launch of its own before the tiled kernel): -1 for a decode step the
// decode-step kernel takes, zeros for rows no sequence owns (before cu_q_lens[0], past
// cu_q_lens[num_seqs]) and for the rows of a sequence the kernels skip (q_len > kv_len). With
// cu_q_lens increasing these rows are no tile's; where it is not, a row two writers share gets
// one of their entries, each of which the combine can use. The kv head 0 CTAs call it; CTA 0
// takes the sequences (the entries LocateRange reads next, in the same threads), all of them
// the rows no sequence owns.
__device__ __forceinline__ void MarkRowsWithoutTiles(const tiled::Params& p, const OwnedRows& rows,
                                                     int num_seqs) {
  const int4 nobody = make_int4(0, 0, 0, 0);
  const int worker = blockIdx.x * blockDim.x + threadIdx.x;
  const int workers = gridDim.x * blockDim.x;
  for (int t = worker; t < rows.first; t += workers) p.row_pieces[t] = nobody;
  for (int t = rows.end + worker; t < p.num_tokens; t += workers) p.row_pieces[t] = nobody;
  if (blockIdx.x != 0) return;
  for (int i = threadIdx.x; i < num_seqs; i += blockDim.x) {
    const Sequence s = ReadSequence(p, rows, i);
    if (s.q_len == 1 && p.decode_steps_elsewhere) {
      p.row_pieces[s.q_start] = make_int4(0, -1, 0, 0);
    } else if (s.q_len == 0) {
      for (int t = s.q_start, end = OwnedRowAt(p, rows, i + 1); t < end; ++t) {
        p.row_pieces[t] = nobody;
      }
    }
  }
}

// A tiled kernel's range of units (every thread of the CTA calls it). The kv head 0 CTAs also
// mark the rows no tile announces, and with the decode steps elsewhere the units go to the
// tiled kernel's share of the CTAs.
template <int kStageTokens>
__device__ cuda::balanced::Range LocateTiledRange(const tiled::Params& p, const OwnedRows& rows,
                                                  int num_seqs, int* scratch) {
  if (blockIdx.y == 0) MarkRowsWithoutTiles(p, rows, num_seqs);
  return cuda::balanced::LocateRange(
      num_seqs, tiled::kMinCtaStages,
      [&](int seq) { return tiled::UnitsOf(p, rows, seq, kStageTokens); }, scratch,
      [&](int units) {
        if (!p.decode_steps_elsewhere) return static_cast<int>(gridDim.x);
        if (units == 0) return 1;  // nothing to split (the decode kernel gets every SM)
        int local = 0;
        for (int i = threadIdx.x; i < num_seqs; i += blockDim.x) {
          local += DecodeStepUnits(p, rows, i);
        }
        return SplitSms(p.share, p.num_kv_heads, units, cuda::balanced::BlockSum(local, scratch))
            .tiled_ctas;
      });
}

}  // namespace xla_ext::attention::ragged

#endif  // XLA_EXT_KERNELS_ATTENTION_GPU_SHARE_CUH_
