// Host (CPU) xla_ext.ragged_paged_attention: checks the first num_seqs sequences' entries
// (DataChecks), then one (query row, query head) at a time over its sequence's K and V rows,
// with the exact softmax weights of masked positions (ragged_paged_attention.h); f64
// accumulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/common/host_float.h"
#include "kernels/ragged_paged_attention/ragged_paged_attention.h"
#include "xla_ext/registry.h"

namespace xla_ext::ragged_paged_attention {
namespace {

struct Fp8E4M3Fn { uint8_t bits; };

// f8e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
float ToFloat(Fp8E4M3Fn x) {
  const int exponent = (x.bits >> 3) & 0xf;
  const int mantissa = x.bits & 0x7;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m * 2^-6 / 8
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  }
  return (x.bits & 0x80) ? -magnitude : magnitude;
}

template <typename T>
float ToFloat(T x) {
  return host::ToFloat(x);
}

template <typename T, typename KV>
void Attend(const Shapes& s, const Attrs& a, int32_t num_seqs, const T* q, const KV* kv_pages,
            const int32_t* kv_lens, const int32_t* page_indices, const int32_t* cu_q_lens,
            T* out) {
  const int64_t d = s.head_dim;
  const int64_t combined = 2 * s.num_kv_heads;
  // Rows no sequence owns are zeros.
  std::fill(out, out + s.num_tokens * s.num_q_heads * d, host::FromFloat<T>(0.0f));
  std::vector<double> qf(d), acc(d), scores, masked_v(d);
  std::vector<char> masked;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_start = cu_q_lens[i];
    const int64_t q_len = cu_q_lens[i + 1] - q_start;
    const int64_t kv_len = kv_lens[i];
    const int32_t* pages = page_indices + i * s.pages_per_seq;
    scores.resize(kv_len);
    masked.resize(kv_len);
    // Element offset of position k's row of combined head c.
    auto row = [&](int64_t k, int64_t c) {
      const int64_t slot = int64_t{pages[k / s.page_size]} * s.page_size + k % s.page_size;
      return (slot * combined + c) * d;
    };
    for (int64_t j = 0; j < q_len; ++j) {
      const int64_t token = q_start + j;
      const int64_t q_pos = kv_len - q_len + j;
      int64_t num_masked = 0;
      for (int64_t k = 0; k < kv_len; ++k) {
        masked[k] = k > q_pos || (a.sliding_window > 0 && k <= q_pos - a.sliding_window);
        num_masked += masked[k];
      }
      for (int64_t h = 0; h < s.num_q_heads; ++h) {
        const int64_t kv_head = h / s.group_size();
        const T* q_row = q + (token * s.num_q_heads + h) * d;
        for (int64_t e = 0; e < d; ++e) qf[e] = ToFloat(q_row[e]);
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t k = 0; k < kv_len; ++k) {
          double score = a.mask_value;
          if (!masked[k]) {
            const KV* key = kv_pages + row(k, 2 * kv_head);
            double dot = 0.0;
            for (int64_t e = 0; e < d; ++e) dot += qf[e] * ToFloat(key[e]);
            score = dot * a.sm_scale * a.k_scale;
            if (a.soft_cap > 0.0f) score = a.soft_cap * std::tanh(score / a.soft_cap);
          }
          scores[k] = score;
          max_score = std::max(max_score, score);
        }
        // Masked positions share one weight; their V rows are summed only when it is not 0.
        const double masked_weight =
            num_masked > 0 ? std::exp(double{a.mask_value} - max_score) : 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        std::fill(masked_v.begin(), masked_v.end(), 0.0);
        double sum = masked_weight * static_cast<double>(num_masked);
        for (int64_t k = 0; k < kv_len; ++k) {
          if (masked[k] && masked_weight == 0.0) continue;
          const KV* value = kv_pages + row(k, 2 * kv_head + 1);
          if (masked[k]) {
            for (int64_t e = 0; e < d; ++e) masked_v[e] += ToFloat(value[e]);
            continue;
          }
          const double p = std::exp(scores[k] - max_score);
          sum += p;
          for (int64_t e = 0; e < d; ++e) acc[e] += p * ToFloat(value[e]);
        }
        T* out_row = out + (token * s.num_q_heads + h) * d;
        const double scale = sum > 0.0 ? a.v_scale / sum : 0.0;
        for (int64_t e = 0; e < d; ++e) {
          const double total = acc[e] + masked_weight * masked_v[e];
          out_row[e] = host::FromFloat<T>(static_cast<float>(total * scale));
        }
      }
    }
  }
}

// Calls fn(T{}, KV{}) for the element types of q and kv_pages; a pair without a kernel is an
// error (Check() rejects those first).
template <typename Fn>
ffi::Error Dispatch(ffi::DataType q_type, bool fp8_kv, Fn&& fn) {
  switch (q_type) {
    case ffi::DataType::F32:
      if (fp8_kv) break;
      fn(float{}, float{});
      return ffi::Error::Success();
    case ffi::DataType::F16:
      if (fp8_kv) fn(host::Half{}, Fp8E4M3Fn{}); else fn(host::Half{}, host::Half{});
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      if (fp8_kv) fn(host::BFloat16{}, Fp8E4M3Fn{}); else fn(host::BFloat16{}, host::BFloat16{});
      return ffi::Error::Success();
    default:
      break;
  }
  return NoKernelError(kTarget, "q dtype",
                       std::string(DTypeName(q_type)) + " with kv_pages " +
                           (fp8_kv ? "f8e4m3fn" : "of the same dtype"));
}

ffi::Error RaggedPagedAttentionHost(ffi::AnyBuffer q, ffi::AnyBuffer kv_pages,
                                    ffi::AnyBuffer kv_lens, ffi::AnyBuffer page_indices,
                                    ffi::AnyBuffer cu_q_lens, ffi::AnyBuffer num_seqs,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> workspace, float sm_scale,
                                    int32_t sliding_window, float soft_cap, float mask_value,
                                    float k_scale, float v_scale, int32_t max_q_len) {
  const Attrs attrs{sm_scale, sliding_window, soft_cap, mask_value, k_scale, v_scale, max_q_len};
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(
      Check(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *out, attrs, s));
  XLA_EXT_RETURN_IF_ERROR(CheckWorkspace(kTarget, *workspace));  // the CUDA handler's; unused here
  const auto* lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  const auto* pages = static_cast<const int32_t*>(page_indices.untyped_data());
  const auto* cu = static_cast<const int32_t*>(cu_q_lens.untyped_data());
  const int32_t n = *static_cast<const int32_t*>(num_seqs.untyped_data());
  XLA_EXT_RETURN_IF_ERROR(
      FirstViolation(DataChecks::For(s, attrs, kv_lens, page_indices, cu_q_lens, num_seqs)));
  return Dispatch(q.element_type(), s.fp8_kv, [&](auto q_zero, auto kv_zero) {
    using T = decltype(q_zero);
    using KV = decltype(kv_zero);
    Attend<T, KV>(s, attrs, n, static_cast<const T*>(q.untyped_data()),
                  static_cast<const KV*>(kv_pages.untyped_data()), lens, pages, cu,
                  static_cast<T*>(out->untyped_data()));
  });
}

XLA_FFI_DEFINE_HANDLER(kRaggedPagedAttentionHost, RaggedPagedAttentionHost,
                       Bind(ffi::Ffi::Bind()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "Host", kRaggedPagedAttentionHost, XLA_EXT_NO_TRAITS);

}  // namespace xla_ext::ragged_paged_attention
