// What both CUDA ragged-attention kernels are given of a call: its buffers, sizes and scalars,
// as the handler reads them (each kernel's Params adds its own split of the work).
#ifndef XLA_EXT_KERNELS_RAGGED_PAGED_ATTENTION_BATCH_PARAMS_CUH_
#define XLA_EXT_KERNELS_RAGGED_PAGED_ATTENTION_BATCH_PARAMS_CUH_

#include <cstdint>

namespace xla_ext::ragged_paged_attention {

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

}  // namespace xla_ext::ragged_paged_attention

#endif  // XLA_EXT_KERNELS_RAGGED_PAGED_ATTENTION_BATCH_PARAMS_CUH_
