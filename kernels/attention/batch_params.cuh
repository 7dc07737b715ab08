// What the CUDA ragged-attention kernels are given of a call: its buffers, sizes and scalars,
// as the handler reads them (each kernel's Params adds its own split of the work), and what a
// sequence is to the kernels that walk the batch by sequence.
#ifndef XLA_EXT_KERNELS_ATTENTION_BATCH_PARAMS_CUH_
#define XLA_EXT_KERNELS_ATTENTION_BATCH_PARAMS_CUH_

#include <cstdint>

namespace xla_ext::attention::ragged {

// How the tiled kernel and the decode-step kernel, which run at the same time, share the SMs
// (gpu_share.cuh): their grids, and what a unit of each costs an SM. (In tiled::Params, which
// both kernels get.)
struct GpuShare {
  int sms;
  int tiled_workers;       // the tiled grid's CTAs per kv head (its gridDim.x)
  int tiled_ctas_per_sm;
  int decode_workers;      // the decode-step grid's gridDim.x; 0: no decode-step kernel
  int decode_groups;       // its gridDim.y
  int decode_ctas_per_sm;
  int tiled_unit_ns;       // one tiled unit (a stage of a tile of one kv head)
  int decode_unit_ns;      // one decode-step unit (a stage of a CTA's kv heads), at the
                           // bandwidth an SM gets while every SM streams
};

struct BatchParams {
  const void* q;
  const void* kv_pages;
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  const int32_t* num_seqs;
  void* out;
  int num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int group_size;
  int num_pages;
  int log2_page_size;
  int pages_per_seq;
  int max_num_seqs;
  float score_scale;  // sm_scale * k_scale
  int sliding_window;
  float soft_cap;
  float v_scale;
  float mask_value;
  bool visit_masked;  // mask_value > kNegligibleMaskValue: masked positions are visited
};

// A sequence as the tensor-core and decode-step kernels use it: entries clamped into range
// (the op's contract: kernels/ragged_paged_attention/ragged_paged_attention.h); q_len 0 when
// the entries make no sense (q_len > kv_len, decreasing cu_q_lens).
struct Sequence {
  int q_start;
  int q_len;
  int kv_len;
};

__device__ __forceinline__ int NumSeqs(const BatchParams& p) {
  return min(max(__ldg(p.num_seqs), 0), p.max_num_seqs);
}

// Rows are owned only from cu_q_lens[0] up to cu_q_lens[num_seqs] (the op's contract); read
// once per thread, they clamp every sequence's rows.
struct OwnedRows {
  int first;
  int end;
};

__device__ __forceinline__ OwnedRows OwnedRowsOf(const BatchParams& p, int num_seqs) {
  const int first = min(max(__ldg(p.cu_q_lens), 0), p.num_tokens);
  return {first, min(max(__ldg(p.cu_q_lens + num_seqs), first), p.num_tokens)};
}

// cu_q_lens[i] clamped into the owned rows.
__device__ __forceinline__ int OwnedRowAt(const BatchParams& p, const OwnedRows& rows, int i) {
  return min(max(__ldg(p.cu_q_lens + i), rows.first), rows.end);
}

__device__ __forceinline__ Sequence ReadSequence(const BatchParams& p, const OwnedRows& rows,
                                                 int i) {
  const int q_start = OwnedRowAt(p, rows, i);
  const int q_end = OwnedRowAt(p, rows, i + 1);
  const int kv_len = min(max(__ldg(p.kv_lens + i), 0), p.pages_per_seq << p.log2_page_size);
  const int q_len = q_end - q_start;
  return {q_start, q_len > 0 && q_len <= kv_len ? q_len : 0, kv_len};
}

}  // namespace xla_ext::attention::ragged

#endif  // XLA_EXT_KERNELS_ATTENTION_BATCH_PARAMS_CUH_
