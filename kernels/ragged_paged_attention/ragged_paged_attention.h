// xla_ext.ragged_paged_attention: attention of a ragged batch of query tokens (decodes,
// prefills and prefill chunks side by side) over a combined paged KV cache, with the
// semantics of torch_xla 2.9.0's `ragged_paged_attention` (its reference:
// torch_xla/experimental/custom_kernel.py, `_ragged_paged_attention_nonkernel`).
//
//   q             [max_num_batched_tokens, num_q_heads, head_dim]         f32, f16 or bf16
//   kv_pages      [total_num_pages, page_size, 2 * num_kv_heads, head_dim] dtype of q, or
//                 f8e4m3fn with q f16/bf16; K of kv head h at combined head 2h, V at 2h + 1
//   kv_lens       [max_num_seqs] s32: tokens in the cache per sequence, the new ones included
//   page_indices  [max_num_seqs, pages_per_seq] s32: token t of sequence i lives in page
//                 page_indices[i][t / page_size] at offset t % page_size
//   cu_q_lens     [max_num_seqs + 1] s32: sequence i owns query rows cu_q_lens[i]..[i + 1]
//   num_seqs      [1] s32: sequences in use; entries of the arrays above past them are junk
//   attrs         sm_scale (f32); sliding_window (s32, 0 = none); soft_cap (f32, 0 = none);
//                 mask_value (f32); k_scale, v_scale (f32, 1 = none); max_q_len (s32): 0, or
//                 a bound on every sequence's q_len that the caller promises (1: a batch of
//                 decode steps only, which the CUDA handler runs on its decode kernel alone)
//   out           [max_num_batched_tokens, num_q_heads, head_dim], dtype of q
//   workspace     [bytes] u8: the CUDA handler's scratch, so that XLA allocates it with the
//                 call's other buffers and a command buffer can replay the call; the front
//                 ends size it (the library's xla_ext_workspace_bytes, which asks this op's
//                 contract) and drop it. Too small: InvalidArgument. The Host handler needs
//                 none (any size).
//
// For sequence i < num_seqs[0], q_len = cu_q_lens[i + 1] - cu_q_lens[i], kv_len = kv_lens[i],
// its query row j (0 <= j < q_len) sits at position q_pos = kv_len - q_len + j, and query head
// h (kv head h / (num_q_heads / num_kv_heads)) scores each position k < kv_len:
//   s = sm_scale * k_scale * (q . K_k);   if soft_cap > 0: s = soft_cap * tanh(s / soft_cap);
//   masked unless k <= q_pos and (sliding_window == 0 or k > q_pos - sliding_window), and a
//   masked score is mask_value;   out = v_scale * softmax(s) . V
// accumulated in f32 (K and V are dequantised from fp8 as f32 values; torch_xla's reference
// rounds them to q's dtype first). Rows no sequence owns (before cu_q_lens[0], at or after
// cu_q_lens[num_seqs[0]]) are zeros.
//
// Masked positions: a masked score takes weight exp(mask_value - max score). When
// mask_value <= kNegligibleMaskValue (-1e30; torch_xla's default is -0.7 * FLT_MAX) that
// weight is 0 in f32 for every row whose largest score is above mask_value + 104, so the CUDA
// kernel reads only the unmasked positions; with a larger mask_value it visits every position
// below kv_len and gives masked ones mask_value, as the reference does. The Host handler always
// computes the exact weights.
//
// Data-dependent arguments (num_seqs, cu_q_lens, kv_lens, page_indices):
// - Host checks, for the first num_seqs[0] sequences: 0 <= num_seqs[0] <= max_num_seqs;
//   0 <= cu_q_lens[0] <= cu_q_lens[1] <= ... <= cu_q_lens[num_seqs] <= max_num_batched_tokens;
//   q_len <= kv_len <= pages_per_seq * page_size; the page ids of positions below kv_len in
//   [0, total_num_pages). A violation returns InvalidArgument naming the argument and the
//   entry. Entries past num_seqs[0] are never read.
// - CUDA cannot report them without synchronising, so it never reads or writes out of bounds
//   instead: num_seqs[0] is clamped to [0, max_num_seqs]; a row belongs to sequence i only if
//   cu_q_lens[i] <= row < cu_q_lens[i + 1] for the i that a binary search over the first
//   num_seqs[0] + 1 entries finds (with non-monotone entries some rows may belong to none:
//   they are zeros); kv_len is clamped to [0, pages_per_seq * page_size]; a sequence with
//   q_len > kv_len (after the clamp) gives zeros for all its rows; positions in a page id
//   outside [0, total_num_pages) are skipped (no weight; a row left with none gives zeros).
//   Only a row's own q row, its sequence's entries and its pages' K/V rows are read.
//   The tiled kernels (kernels/attention/tiled_*.cuh) clamp the same way but find rows from
//   sequences, not sequences from rows: sequence i owns rows cu_q_lens[i]..cu_q_lens[i + 1],
//   both clamped into [cu_q_lens[0], cu_q_lens[num_seqs]], none if they decrease; with
//   non-monotone entries two sequences may claim a row, which then gets one of their results.
//   Beside them, the decode kernel (kernels/attention/decode_steps.cuh) takes the sequences
//   whose q_len is 1 after the same clamps. With max_q_len = 1 it runs alone: a sequence with
//   more than one row (a broken promise) gets NaN in all its rows.
//   With XLA_EXT_DEBUG_CHECKS set it runs DataChecks on the device first and returns the Host
//   handler's error (kernels/common/debug_checks.cuh).
#ifndef XLA_EXT_KERNELS_RAGGED_PAGED_ATTENTION_RAGGED_PAGED_ATTENTION_H_
#define XLA_EXT_KERNELS_RAGGED_PAGED_ATTENTION_RAGGED_PAGED_ATTENTION_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "kernels/common/contract.h"
#include "kernels/common/data_checks.h"
#include "kernels/common/errors.h"

namespace xla_ext::ragged_paged_attention {

inline constexpr char kTarget[] = "xla_ext.ragged_paged_attention";

// At or below this mask_value the CUDA kernel skips masked positions (see above).
inline constexpr float kNegligibleMaskValue = -1e30f;
inline constexpr int64_t kMaxGroupSize = 16;

// The op's contract (kernels/common/contract.h): the values Check accepts, the ones the CUDA
// kernels are built for, and the ones the front ends read from the kernel table. kv_pages has
// q's dtype, or f8e4m3fn beside an f16 or bf16 q.
inline constexpr int64_t kHeadDims[] = {64, 80, 96, 112, 128, 192, 256};
inline constexpr int64_t kPageSizes[] = {8, 16, 32, 64, 128};
inline constexpr int64_t kKvPagesDTypes[] = {XLA_FFI_DataType_F32, XLA_FFI_DataType_F16,
                                             XLA_FFI_DataType_BF16, XLA_FFI_DataType_F8E4M3FN};
inline constexpr XlaExtSupportedValues kSupported[] = {
    contract::Supported("dtype", "q", kFloatDTypes),
    contract::Supported("dtype", "kv_pages", kKvPagesDTypes),
    contract::Supported("head_dim", "q", kHeadDims),
    contract::Supported("page_size", "kv_pages", kPageSizes),
};

struct Shapes {
  int64_t num_tokens;  // max_num_batched_tokens
  int64_t num_q_heads;
  int64_t head_dim;
  int64_t num_pages;
  int64_t page_size;
  int64_t num_kv_heads;
  int64_t max_num_seqs;
  int64_t pages_per_seq;
  bool fp8_kv;  // kv_pages is f8e4m3fn

  int64_t group_size() const { return num_q_heads / num_kv_heads; }
  // Tokens a sequence's row of page_indices can address.
  int64_t capacity() const { return pages_per_seq * page_size; }
};


struct Attrs {
  float sm_scale;
  int32_t sliding_window;
  float soft_cap;
  float mask_value;
  float k_scale;
  float v_scale;
  int32_t max_q_len;  // 0: any
};

inline ffi::Error CheckS32Vector(const char* arg, const ffi::AnyBuffer& buffer, int64_t length) {
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, arg, buffer, ffi::DataType::S32));
  const auto dims = buffer.dimensions();
  if (dims.size() != 1 || dims[0] != length) {
    return ArgumentError(kTarget, arg, "shape [" + std::to_string(length) + "]",
                         "shape " + ShapeString(dims));
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckAttrs(const Attrs& a) {
  auto finite = [](const char* name, float value) {
    if (std::isfinite(value)) return ffi::Error::Success();
    return ArgumentError(kTarget, name, "a finite value", std::to_string(value));
  };
  XLA_EXT_RETURN_IF_ERROR(finite("sm_scale", a.sm_scale));
  XLA_EXT_RETURN_IF_ERROR(finite("k_scale", a.k_scale));
  XLA_EXT_RETURN_IF_ERROR(finite("v_scale", a.v_scale));
  if (a.sliding_window < 0) {
    return ArgumentError(kTarget, "sliding_window", "a window >= 1, or 0 for none",
                         std::to_string(a.sliding_window));
  }
  if (!(a.soft_cap >= 0.0f) || std::isinf(a.soft_cap)) {
    return ArgumentError(kTarget, "soft_cap", "a finite cap > 0, or 0 for none",
                         std::to_string(a.soft_cap));
  }
  if (std::isnan(a.mask_value)) {
    return ArgumentError(kTarget, "mask_value", "a value that is not NaN", "NaN");
  }
  if (a.max_q_len < 0) {
    return ArgumentError(kTarget, "max_q_len", "a bound >= 1 on every q_len, or 0 for none",
                         std::to_string(a.max_q_len));
  }
  return ffi::Error::Success();
}

// Checks dtypes, ranks and shapes of every buffer and the attributes, and fills `shapes`.
inline ffi::Error Check(const ffi::AnyBuffer& q, const ffi::AnyBuffer& kv_pages,
                        const ffi::AnyBuffer& kv_lens, const ffi::AnyBuffer& page_indices,
                        const ffi::AnyBuffer& cu_q_lens, const ffi::AnyBuffer& num_seqs,
                        const ffi::AnyBuffer& out, const Attrs& attrs, Shapes& shapes) {
  XLA_EXT_RETURN_IF_ERROR(CheckFloatType(kTarget, "q", q));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "q", q, 3));
  const ffi::DataType q_type = q.element_type();
  const ffi::DataType kv_type = kv_pages.element_type();
  const bool fp8_kv = kv_type == ffi::DataType::F8E4M3FN;
  if (kv_type != q_type && !(fp8_kv && q_type != ffi::DataType::F32)) {
    return ArgumentError(kTarget, "kv_pages",
                         std::string("dtype ") + DTypeName(q_type) + " (the dtype of 'q')" +
                             (q_type == ffi::DataType::F32 ? "" : " or f8e4m3fn"),
                         std::string("dtype ") + DTypeName(kv_type));
  }
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "kv_pages", kv_pages, 4));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "page_indices", page_indices, ffi::DataType::S32));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "page_indices", page_indices, 2));

  const auto qd = q.dimensions();
  const auto kd = kv_pages.dimensions();
  const auto pd = page_indices.dimensions();
  shapes = Shapes{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2] / 2, pd[0], pd[1], fp8_kv};

  if (!contract::Contains(kHeadDims, shapes.head_dim)) {
    return ArgumentError(kTarget, "q", "head_dim (dim 2) " + contract::OneOf(kHeadDims),
                         std::to_string(shapes.head_dim) + " in shape " + ShapeString(qd));
  }
  if (kd[3] != shapes.head_dim) {
    return ArgumentError(kTarget, "kv_pages",
                         "head_dim (dim 3) " + std::to_string(shapes.head_dim) + " (the q's)",
                         "shape " + ShapeString(kd));
  }
  if (!contract::Contains(kPageSizes, shapes.page_size)) {
    return ArgumentError(kTarget, "kv_pages",
                         "page_size (dim 1) " + contract::OneOf(kPageSizes),
                         std::to_string(shapes.page_size) + " in shape " + ShapeString(kd));
  }
  if (kd[2] <= 0 || kd[2] % 2 != 0 || shapes.num_q_heads % shapes.num_kv_heads != 0 ||
      shapes.group_size() > kMaxGroupSize) {
    return ArgumentError(kTarget, "kv_pages",
                         "2 * num_kv_heads combined heads (dim 2), num_kv_heads dividing "
                         "num_q_heads = " + std::to_string(shapes.num_q_heads) +
                             " into groups of at most " + std::to_string(kMaxGroupSize),
                         std::to_string(kd[2]) + " in shape " + ShapeString(kd));
  }
  XLA_EXT_RETURN_IF_ERROR(CheckS32Vector("kv_lens", kv_lens, shapes.max_num_seqs));
  XLA_EXT_RETURN_IF_ERROR(CheckS32Vector("cu_q_lens", cu_q_lens, shapes.max_num_seqs + 1));
  XLA_EXT_RETURN_IF_ERROR(CheckS32Vector("num_seqs", num_seqs, 1));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "out", out, q_type));
  XLA_EXT_RETURN_IF_ERROR(CheckSameShape(kTarget, "out", out, "q", q));
  // Positions and rows are int32 on the device (page ids and lengths are s32 already).
  if (shapes.capacity() > INT32_MAX / 2) {
    return ArgumentError(kTarget, "page_indices", "pages_per_seq * page_size < 2^30",
                         "shape " + ShapeString(pd) + " with page_size " +
                             std::to_string(shapes.page_size));
  }
  if (shapes.num_tokens > INT32_MAX || shapes.num_q_heads > 65535) {
    return ArgumentError(kTarget, "q", "fewer than 2^31 tokens and 65536 heads",
                         "shape " + ShapeString(qd));
  }
  return CheckAttrs(attrs);
}

// The data listed above, for the first num_seqs[0] sequences (data_checks.h), in the order of
// the list: entry 0 num_seqs; 1 cu_q_lens[0]; 2 + i cu_q_lens[i + 1] >= cu_q_lens[i];
// 2 + max_num_seqs cu_q_lens[num_seqs]; then per sequence i, from 3 + max_num_seqs +
// i * (pages_per_seq + 2): kv_len >= q_len and q_len <= max_q_len (when set), kv_len <=
// capacity, and its pages in order.
struct DataChecks {
  static constexpr int32_t kNumSeqs = 1;       // values: num_seqs, max_num_seqs
  static constexpr int32_t kFirstRow = 2;      // values: cu_q_lens[0]
  static constexpr int32_t kDecreasing = 3;    // values: i + 1, cu_q_lens[i + 1], cu_q_lens[i],
                                               //         num_seqs
  static constexpr int32_t kRowsBeyond = 4;    // values: num_seqs, cu_q_lens[num_seqs],
                                               //         max_num_batched_tokens
  static constexpr int32_t kKvBelowQ = 5;      // values: i, kv_len, q_len
  static constexpr int32_t kKvBeyond = 6;      // values: i, kv_len, capacity
  static constexpr int32_t kPageId = 7;        // values: i, page index, page id, num_pages
  static constexpr int32_t kQBeyondMax = 8;    // values: i, q_len, max_q_len

  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  const int32_t* num_seqs;
  int64_t max_num_seqs;
  int64_t pages_per_seq;
  int64_t page_size;
  int64_t num_pages;
  int64_t num_tokens;
  int64_t max_q_len;  // 0: any

  static DataChecks For(const Shapes& s, const Attrs& a, const ffi::AnyBuffer& kv_lens,
                        const ffi::AnyBuffer& page_indices, const ffi::AnyBuffer& cu_q_lens,
                        const ffi::AnyBuffer& num_seqs) {
    return DataChecks{static_cast<const int32_t*>(kv_lens.untyped_data()),
                      static_cast<const int32_t*>(page_indices.untyped_data()),
                      static_cast<const int32_t*>(cu_q_lens.untyped_data()),
                      static_cast<const int32_t*>(num_seqs.untyped_data()),
                      s.max_num_seqs, s.pages_per_seq, s.page_size, s.num_pages, s.num_tokens,
                      a.max_q_len};
  }

  XLA_EXT_HOST_DEVICE int64_t num_entries() const {
    return 3 + max_num_seqs * (pages_per_seq + 3);
  }

  XLA_EXT_HOST_DEVICE Violation Check(int64_t entry) const {
    const int64_t n = *num_seqs;
    if (n < 0 || n > max_num_seqs) {
      return entry == 0 ? Violation{kNumSeqs, {n, max_num_seqs}} : Violation{};
    }
    if (entry == 0) return Violation{};
    if (entry == 1) {
      return cu_q_lens[0] >= 0 ? Violation{} : Violation{kFirstRow, {cu_q_lens[0]}};
    }
    if (entry < 2 + max_num_seqs) {
      const int64_t i = entry - 2;
      if (i >= n || cu_q_lens[i + 1] >= cu_q_lens[i]) return Violation{};
      return Violation{kDecreasing, {i + 1, cu_q_lens[i + 1], cu_q_lens[i], n}};
    }
    if (entry == 2 + max_num_seqs) {
      if (cu_q_lens[n] <= num_tokens) return Violation{};
      return Violation{kRowsBeyond, {n, cu_q_lens[n], num_tokens}};
    }
    const int64_t i = (entry - 3 - max_num_seqs) / (pages_per_seq + 2);
    const int64_t j = (entry - 3 - max_num_seqs) % (pages_per_seq + 2);
    if (i >= n) return Violation{};
    const int64_t q_len = int64_t{cu_q_lens[i + 1]} - cu_q_lens[i];
    const int64_t kv_len = kv_lens[i];
    const int64_t capacity = pages_per_seq * page_size;
    if (j == 0) {
      if (kv_len < q_len) return Violation{kKvBelowQ, {i, kv_len, q_len}};
      if (max_q_len > 0 && q_len > max_q_len) return Violation{kQBeyondMax, {i, q_len, max_q_len}};
      return Violation{};
    }
    if (j == 1) {
      return kv_len <= capacity ? Violation{} : Violation{kKvBeyond, {i, kv_len, capacity}};
    }
    const int64_t p = j - 2;  // a page the sequence uses
    if (p * page_size >= kv_len) return Violation{};
    const int64_t page = page_indices[i * pages_per_seq + p];
    if (page >= 0 && page < num_pages) return Violation{};
    return Violation{kPageId, {i, p, page, num_pages}};
  }

  static ffi::Error Describe(const Violation& v) {
    const int64_t* x = v.values;
    switch (v.check) {
      case kNumSeqs:
        return ArgumentError(kTarget, "num_seqs",
                             "0 <= num_seqs[0] <= max_num_seqs = " + std::to_string(x[1]),
                             Entry("num_seqs", 0, x[0]));
      case kFirstRow:
        return ArgumentError(kTarget, "cu_q_lens", "cu_q_lens[0] >= 0",
                             Entry("cu_q_lens", 0, x[0]));
      case kDecreasing:
        return ArgumentError(kTarget, "cu_q_lens",
                             "non-decreasing entries 0..num_seqs = " + std::to_string(x[3]),
                             Entry("cu_q_lens", x[0], x[1]) + " < " +
                                 Entry("cu_q_lens", x[0] - 1, x[2]));
      case kRowsBeyond:
        return ArgumentError(kTarget, "cu_q_lens",
                             "cu_q_lens[num_seqs] <= max_num_batched_tokens = " +
                                 std::to_string(x[2]),
                             Entry("cu_q_lens", x[0], x[1]));
      case kKvBelowQ:
        return ArgumentError(kTarget, "kv_lens",
                             "kv_len >= q_len (the new tokens are in the cache)",
                             Entry("kv_lens", x[0], x[1]) + " with q_len = " +
                                 std::to_string(x[2]));
      case kQBeyondMax:
        return ArgumentError(kTarget, "max_q_len",
                             "a bound on every sequence's q_len (cu_q_lens[i + 1] - cu_q_lens[i])",
                             std::to_string(x[2]) + " with sequence " + std::to_string(x[0]) +
                                 "'s q_len = " + std::to_string(x[1]));
      case kKvBeyond:
        return ArgumentError(kTarget, "kv_lens",
                             "kv_len <= pages_per_seq * page_size = " + std::to_string(x[2]),
                             Entry("kv_lens", x[0], x[1]));
      default:
        return ArgumentError(kTarget, "page_indices",
                             "page ids in [0, total_num_pages = " + std::to_string(x[3]) + ")",
                             "page_indices[" + std::to_string(x[0]) + "][" +
                                 std::to_string(x[1]) + "] = " + std::to_string(x[2]));
    }
  }
};

// Both platforms bind the same arguments, results and attributes, after their contexts.
template <typename Binding>
auto Bind(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // kv_pages
      .template Arg<ffi::AnyBuffer>()  // kv_lens
      .template Arg<ffi::AnyBuffer>()  // page_indices
      .template Arg<ffi::AnyBuffer>()  // cu_q_lens
      .template Arg<ffi::AnyBuffer>()  // num_seqs
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // workspace
      .template Attr<float>("sm_scale")
      .template Attr<int32_t>("sliding_window")
      .template Attr<float>("soft_cap")
      .template Attr<float>("mask_value")
      .template Attr<float>("k_scale")
      .template Attr<float>("v_scale")
      .template Attr<int32_t>("max_q_len");
}

}  // namespace xla_ext::ragged_paged_attention

#endif  // XLA_EXT_KERNELS_RAGGED_PAGED_ATTENTION_RAGGED_PAGED_ATTENTION_H_
