// Host (CPU) xla_ext.paged_attention: one query head at a time, walking the sequence's
// K and V rows (each head_size contiguous elements) in token order; f32 accumulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels/common/host_float.h"
#include "kernels/paged_attention/paged_attention.h"
#include "xla_ext/registry.h"

namespace xla_ext::paged_attention {
namespace {

template <typename T>
void Attend(const Shapes& s, const T* query, const T* key_cache, const T* value_cache,
            const int32_t* block_tables, const int32_t* seq_lens, const float* alibi_slopes,
            float scale, float softcap, T* out) {
  const int64_t d = s.head_size;
  std::vector<float> q(d), acc(d), logits(s.capacity());
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t seq_len = seq_lens[seq];
    const int32_t* blocks = block_tables + seq * s.max_blocks_per_seq;
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const int64_t kv_head = h / s.group_size();
      // Offset of token t's row for this kv head in either cache.
      auto row = [&](int64_t t) {
        const int64_t slot = int64_t{blocks[t / s.block_size]} * s.block_size + t % s.block_size;
        return (slot * s.num_kv_heads + kv_head) * d;
      };
      const T* q_row = query + (seq * s.num_heads + h) * d;
      for (int64_t i = 0; i < d; ++i) q[i] = scale * host::ToFloat(q_row[i]);

      float max_logit = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < seq_len; ++t) {
        const T* k = key_cache + row(t);
        float logit = 0.0f;
        for (int64_t i = 0; i < d; ++i) logit += q[i] * host::ToFloat(k[i]);
        if (softcap > 0.0f) logit = softcap * std::tanh(logit / softcap);
        if (alibi_slopes != nullptr) logit += alibi_slopes[h] * static_cast<float>(t - (seq_len - 1));
        logits[t] = logit;
        max_logit = std::max(max_logit, logit);
      }

      std::fill(acc.begin(), acc.end(), 0.0f);
      float sum = 0.0f;
      for (int64_t t = 0; t < seq_len; ++t) {
        const float p = std::exp(logits[t] - max_logit);
        sum += p;
        const T* v = value_cache + row(t);
        for (int64_t i = 0; i < d; ++i) acc[i] += p * host::ToFloat(v[i]);
      }
      T* out_row = out + (seq * s.num_heads + h) * d;
      const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;  // seq_len 0 gives zeros
      for (int64_t i = 0; i < d; ++i) out_row[i] = host::FromFloat<T>(acc[i] * inv_sum);
    }
  }
}

ffi::Error PagedAttentionHost(ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                              ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                              ffi::AnyBuffer seq_lens, ffi::AnyBuffer alibi_slopes,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace, float scale, float softcap) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(
      Check(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, *out, s));
  XLA_EXT_RETURN_IF_ERROR(CheckWorkspace(kTarget, *workspace));  // the CUDA handler's
  XLA_EXT_RETURN_IF_ERROR(FirstViolation(SequenceChecks::For(s, block_tables, seq_lens)));
  const auto* tables = static_cast<const int32_t*>(block_tables.untyped_data());
  const auto* lens = static_cast<const int32_t*>(seq_lens.untyped_data());
  const float* slopes = s.has_alibi ? static_cast<const float*>(alibi_slopes.untyped_data())
                                    : nullptr;
  return host::DispatchFloat(kTarget, query.element_type(), [&](auto zero) {
    using T = decltype(zero);
    Attend<T>(s, static_cast<const T*>(query.untyped_data()),
              static_cast<const T*>(key_cache.untyped_data()),
              static_cast<const T*>(value_cache.untyped_data()), tables, lens, slopes, scale,
              softcap, static_cast<T*>(out->untyped_data()));
  });
}

XLA_FFI_DEFINE_HANDLER(kPagedAttentionHost, PagedAttentionHost, Bind(ffi::Ffi::Bind()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "Host", kPagedAttentionHost, XLA_EXT_NO_TRAITS);

}  // namespace xla_ext::paged_attention
