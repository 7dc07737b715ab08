// xla_ext.paged_attention: single-token decode attention over a paged KV cache, as vLLM's
// paged_attention / FlashAttention decode with a block table.
//
//   query         [num_seqs, num_heads, head_size]                    f32, f16 or bf16
//   key_cache     [num_blocks, block_size, num_kv_heads, head_size]   (NHD) dtype of query
//   value_cache   same shape and dtype as key_cache
//   block_tables  [num_seqs, max_blocks_per_seq] s32: token t of a sequence lives in block
//                 block_tables[seq][t / block_size] at offset t % block_size
//   seq_lens      [num_seqs] s32
//   alibi_slopes  f32 [num_heads], or [0] for no ALiBi
//   attrs         scale (f32), softcap (f32, 0 = off)
//   out           [num_seqs, num_heads, head_size], dtype of query
//   workspace     [bytes] u8: the CUDA handler's scratch (the split sequences' partial
//                 results), so that XLA allocates it with the call's other buffers and a command
//                 buffer can replay the call; the front ends size it (the library's
//                 xla_ext_workspace_bytes, which asks this op's contract) and drop it. Too
//                 small: InvalidArgument. The Host handler needs none (any size).
//
// For query head h (kv head h / (num_heads / num_kv_heads)) and token t < seq_len:
//   logit = scale * q.k_t; if softcap > 0: logit = softcap * tanh(logit / softcap);
//   logit += alibi_slopes[h] * (t - (seq_len - 1));   out = softmax(logits) . V
// accumulated in f32. A sequence of length 0 gives zeros.
//
// Data-dependent arguments (seq_lens, the block ids a sequence uses; SequenceChecks below):
// - Host checks them and returns InvalidArgument naming the argument.
// - CUDA cannot report them without synchronising, so it never reads out of bounds instead:
//   a seq_len below 0 counts as 0 (zeros out), one beyond the block table as the table's
//   capacity (max_blocks_per_seq * block_size); tokens in a block id outside [0, num_blocks)
//   are skipped (they get no attention weight; a sequence with no valid token gives zeros).
//   With XLA_EXT_DEBUG_CHECKS set it runs SequenceChecks on the device first and returns the
//   Host handler's error (kernels/common/debug_checks.cuh).
//   The Python front ends check these values when they are concrete.
#ifndef XLA_EXT_KERNELS_PAGED_ATTENTION_PAGED_ATTENTION_H_
#define XLA_EXT_KERNELS_PAGED_ATTENTION_PAGED_ATTENTION_H_

#include <cstdint>
#include <string>
#include <utility>

#include "kernels/common/contract.h"
#include "kernels/common/data_checks.h"
#include "kernels/common/errors.h"

namespace xla_ext::paged_attention {

inline constexpr char kTarget[] = "xla_ext.paged_attention";

// The op's contract (kernels/common/contract.h): the values Check accepts, the ones the CUDA
// kernels are built for, and the ones the front ends read from the kernel table.
inline constexpr int64_t kHeadSizes[] = {64, 80, 96, 112, 128, 256};
inline constexpr int64_t kBlockSizes[] = {8, 16, 32};
inline constexpr XlaExtSupportedValues kSupported[] = {
    contract::Supported("dtype", "query", kFloatDTypes),
    contract::Supported("head_size", "query", kHeadSizes),
    contract::Supported("block_size", "key_cache", kBlockSizes),
};

struct Shapes {
  int64_t num_seqs;
  int64_t num_heads;
  int64_t head_size;
  int64_t num_blocks;
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t max_blocks_per_seq;
  bool has_alibi;

  int64_t group_size() const { return num_heads / num_kv_heads; }
  // Tokens a sequence's block table can address.
  int64_t capacity() const { return max_blocks_per_seq * block_size; }
};

// Checks dtypes, ranks and shapes of every buffer and fills `shapes`.
inline ffi::Error Check(const ffi::AnyBuffer& query, const ffi::AnyBuffer& key_cache,
                        const ffi::AnyBuffer& value_cache, const ffi::AnyBuffer& block_tables,
                        const ffi::AnyBuffer& seq_lens, const ffi::AnyBuffer& alibi_slopes,
                        const ffi::AnyBuffer& out, Shapes& shapes) {
  XLA_EXT_RETURN_IF_ERROR(CheckFloatType(kTarget, "query", query));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "query", query, 3));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "key_cache", key_cache, query.element_type()));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "key_cache", key_cache, 4));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "value_cache", value_cache, query.element_type()));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "block_tables", block_tables, ffi::DataType::S32));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "block_tables", block_tables, 2));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "seq_lens", seq_lens, ffi::DataType::S32));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "seq_lens", seq_lens, 1));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "alibi_slopes", alibi_slopes, ffi::DataType::F32));
  XLA_EXT_RETURN_IF_ERROR(CheckRank(kTarget, "alibi_slopes", alibi_slopes, 1));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "out", out, query.element_type()));

  const auto q = query.dimensions();
  const auto kc = key_cache.dimensions();
  shapes = Shapes{q[0], q[1], q[2], kc[0], kc[1], kc[2], block_tables.dimensions()[1],
                  alibi_slopes.dimensions()[0] != 0};

  if (!contract::Contains(kHeadSizes, shapes.head_size)) {
    return ArgumentError(kTarget, "query", "head_size (dim 2) " + contract::OneOf(kHeadSizes),
                         std::to_string(shapes.head_size) + " in shape " + ShapeString(q));
  }
  if (kc[3] != shapes.head_size) {
    return ArgumentError(kTarget, "key_cache",
                         "head_size (dim 3) " + std::to_string(shapes.head_size) +
                             " (the query's)",
                         "shape " + ShapeString(kc));
  }
  if (!contract::Contains(kBlockSizes, shapes.block_size)) {
    return ArgumentError(kTarget, "key_cache",
                         "block_size (dim 1) " + contract::OneOf(kBlockSizes),
                         std::to_string(shapes.block_size) + " in shape " + ShapeString(kc));
  }
  if (shapes.num_kv_heads == 0 || shapes.num_heads % shapes.num_kv_heads != 0) {
    return ArgumentError(kTarget, "key_cache",
                         "num_kv_heads (dim 2) dividing num_heads = " +
                             std::to_string(shapes.num_heads),
                         std::to_string(shapes.num_kv_heads) + " in shape " + ShapeString(kc));
  }
  XLA_EXT_RETURN_IF_ERROR(
      CheckSameShape(kTarget, "value_cache", value_cache, "key_cache", key_cache));
  if (block_tables.dimensions()[0] != shapes.num_seqs) {
    return ArgumentError(kTarget, "block_tables",
                         "num_seqs = " + std::to_string(shapes.num_seqs) + " rows",
                         "shape " + ShapeString(block_tables.dimensions()));
  }
  if (seq_lens.dimensions()[0] != shapes.num_seqs) {
    return ArgumentError(kTarget, "seq_lens", "shape [" + std::to_string(shapes.num_seqs) + "]",
                         "shape " + ShapeString(seq_lens.dimensions()));
  }
  if (shapes.has_alibi && alibi_slopes.dimensions()[0] != shapes.num_heads) {
    return ArgumentError(kTarget, "alibi_slopes",
                         "shape [" + std::to_string(shapes.num_heads) + "] or [0] (no ALiBi)",
                         "shape " + ShapeString(alibi_slopes.dimensions()));
  }
  return CheckSameShape(kTarget, "out", out, "query", query);
}

// seq_lens within the block table, and every block id a sequence uses within the cache
// (data_checks.h). Entry seq * (max_blocks_per_seq + 1) is seq_lens[seq]; the next
// max_blocks_per_seq entries are its blocks, checked where the sequence uses them.
struct SequenceChecks {
  static constexpr int32_t kSeqLen = 1;   // values: seq, seq_len, capacity
  static constexpr int32_t kBlockId = 2;  // values: seq, block index, block id, num_blocks

  const int32_t* block_tables;
  const int32_t* seq_lens;
  int64_t num_seqs;
  int64_t max_blocks_per_seq;
  int64_t block_size;
  int64_t num_blocks;

  static SequenceChecks For(const Shapes& s, const ffi::AnyBuffer& block_tables,
                            const ffi::AnyBuffer& seq_lens) {
    return SequenceChecks{static_cast<const int32_t*>(block_tables.untyped_data()),
                          static_cast<const int32_t*>(seq_lens.untyped_data()), s.num_seqs,
                          s.max_blocks_per_seq, s.block_size, s.num_blocks};
  }

  XLA_EXT_HOST_DEVICE int64_t num_entries() const {
    return num_seqs * (max_blocks_per_seq + 1);
  }

  XLA_EXT_HOST_DEVICE Violation Check(int64_t entry) const {
    const int64_t seq = entry / (max_blocks_per_seq + 1);
    const int64_t b = entry % (max_blocks_per_seq + 1) - 1;  // -1: the length itself
    const int64_t seq_len = seq_lens[seq];
    const int64_t capacity = max_blocks_per_seq * block_size;
    if (seq_len < 0 || seq_len > capacity) {
      return b < 0 ? Violation{kSeqLen, {seq, seq_len, capacity}} : Violation{};
    }
    if (b < 0 || b * block_size >= seq_len) return Violation{};  // a block the sequence uses
    const int64_t block = block_tables[seq * max_blocks_per_seq + b];
    if (block >= 0 && block < num_blocks) return Violation{};
    return Violation{kBlockId, {seq, b, block, num_blocks}};
  }

  static ffi::Error Describe(const Violation& v) {
    if (v.check == kSeqLen) {
      return ArgumentError(
          kTarget, "seq_lens",
          "0 <= seq_len <= max_blocks_per_seq * block_size = " + std::to_string(v.values[2]),
          Entry("seq_lens", v.values[0], v.values[1]) +
              (v.values[1] < 0 ? "" : " (seq_len beyond the block table)"));
    }
    return ArgumentError(kTarget, "block_tables",
                         "block ids in [0, num_blocks = " + std::to_string(v.values[3]) + ")",
                         "block_tables[" + std::to_string(v.values[0]) + "][" +
                             std::to_string(v.values[1]) + "] = " + std::to_string(v.values[2]));
  }
};

// Both platforms bind the same arguments, results and attributes, after their contexts.
template <typename Binding>
auto Bind(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // query
      .template Arg<ffi::AnyBuffer>()  // key_cache
      .template Arg<ffi::AnyBuffer>()  // value_cache
      .template Arg<ffi::AnyBuffer>()  // block_tables
      .template Arg<ffi::AnyBuffer>()  // seq_lens
      .template Arg<ffi::AnyBuffer>()  // alibi_slopes
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // workspace
      .template Attr<float>("scale")
      .template Attr<float>("softcap");
}

}  // namespace xla_ext::paged_attention

#endif  // XLA_EXT_KERNELS_PAGED_ATTENTION_PAGED_ATTENTION_H_
