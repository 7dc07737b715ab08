// CUDA xla_ext.paged_attention: checks, the launch plan, and the launches. Two kernels of the
// attention library (kernels/attention):
// - decode_tensor_core.cuh: TMA + tensor cores, for f16/bf16 on Hopper and newer with GQA
//   groups of up to 16 heads (the serving case);
// - decode_simt.cuh: CUDA cores, for everything else (f32, larger groups, older GPUs).
// Both may split a sequence over several CTAs, whose pieces CombinePartitionsKernel merges: the
// tensor-core kernel splits the batch's actual tokens evenly over a grid that fills the GPU
// once (the split is made on the device: kernels/common/balanced_split.cuh), the CUDA-core
// kernel every sequence into fixed partitions (a grid sized for the longest possible sequence,
// whose CTAs past a sequence's end return at once).
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <type_traits>

#include "kernels/attention/decode_simt.cuh"
#include "kernels/attention/decode_tensor_core.cuh"
#include "kernels/attention/split_kv.cuh"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/debug_checks.cuh"
#include "kernels/paged_attention/paged_attention.h"
#include "xla_ext/registry.h"

namespace xla_ext::paged_attention {

// The decode kernels of the attention library (kernels/attention); this op's batch is the
// sequences of seq_lens (SeqLensBatch).
namespace simt = attention::decode::simt;
namespace tensor_core = attention::decode::tensor_core;
using attention::decode::LaunchCombine;
using attention::decode::Params;
using attention::decode::SeqLensBatch;

namespace {

// XLA_EXT_PAGED_ATTENTION_KERNEL=simt selects the CUDA-core kernel everywhere, so that tests and
// benchmarks can run it on a GPU where the tensor-core kernel would be chosen.
bool ForceSimt() {
  static const bool force = cuda::EnvIs("XLA_EXT_PAGED_ATTENTION_KERNEL", "simt");
  return force;
}

// How a call is split: the tensor-core kernel's plan, or the CUDA-core kernel's partitions per
// sequence.
struct Plan {
  std::optional<tensor_core::Plan> tensor_core;
  int partition_len = simt::kPartition;
  int64_t num_partitions = 1;
};

// The plan and the launches for one element type and head size.
template <typename T, int kHeadSize>
struct Kernels {
  static Plan MakePlan(const Shapes& s, const std::optional<cuda::DeviceInfo>& device) {
    Plan plan;
    if (!ForceSimt() && device.has_value() && s.num_seqs <= INT32_MAX) {
      plan.tensor_core = tensor_core::MakePlan<T, kHeadSize, SeqLensBatch>(
          static_cast<int>(s.num_kv_heads), static_cast<int>(s.group_size()),
          /*kv_interleaved=*/false, static_cast<int>(s.block_size), *device);
    }
    if (!plan.tensor_core.has_value()) {
      plan.num_partitions =
          std::max<int64_t>(1, (s.capacity() + simt::kPartition - 1) / simt::kPartition);
    }
    return plan;
  }

  static void Launch(const Params& p, const Plan& plan, const Shapes& s, cudaStream_t stream) {
    if constexpr (!std::is_same_v<T, float>) {  // f32 has no tensor-core plan
      if (plan.tensor_core.has_value()) {
        tensor_core::Launch<T, kHeadSize>(p, SeqLensBatch{}, *plan.tensor_core, stream);
        return;
      }
    }
    simt::Attend<T, kHeadSize>(p, static_cast<int>(s.num_seqs), s.group_size(), stream);
    if (p.num_partitions > 1) {
      LaunchCombine<T, kHeadSize>(p, SeqLensBatch{}, s.num_seqs * s.num_heads, stream);
    }
  }
};

// Calls fn(Kernels<T, head_size>{}) for the query's element type T, with kernels built for
// every head size of the contract (kHeadSizes); another head size is an error.
template <typename Fn>
ffi::Error DispatchKernels(ffi::DataType dtype, int64_t head_size, Fn&& fn) {
  bool found = true;
  XLA_EXT_RETURN_IF_ERROR(cuda::DispatchFloat(kTarget, dtype, [&](auto zero) {
    using T = decltype(zero);
    found = contract::Dispatch<kHeadSizes>(
        head_size, [&](auto size) { fn(Kernels<T, decltype(size)::value>{}); });
  }));
  return found ? ffi::Error::Success()
               : NoKernelError(kTarget, "head_size", std::to_string(head_size));
}

// The call's plan, and its parameters but for the buffers' addresses, with the scratch taken
// from `workspace` (counted only, while it measures).
ffi::Error PlanCall(const Shapes& s, ffi::DataType dtype, float scale, float softcap,
                    const std::optional<cuda::DeviceInfo>& device, cuda::Workspace& workspace,
                    Plan& plan, Params& p) {
  XLA_EXT_RETURN_IF_ERROR(DispatchKernels(
      dtype, s.head_size, [&](auto kernels) { plan = kernels.MakePlan(s, device); }));
  const int64_t records = plan.tensor_core.has_value()
                              ? tensor_core::NumRecords(*plan.tensor_core, s.num_seqs)
                              : s.num_seqs * plan.num_partitions;
  if (records > INT32_MAX) {  // grid dimensions and record numbers
    return ArgumentError(kTarget, "block_tables", "num_seqs * partitions < 2^31",
                         std::to_string(s.num_seqs) + " sequences of " +
                             std::to_string(s.max_blocks_per_seq) + " blocks");
  }
  p = Params{};
  p.num_seqs = static_cast<int>(s.num_seqs);
  p.num_heads = static_cast<int>(s.num_heads);
  p.num_kv_heads = static_cast<int>(s.num_kv_heads);
  p.num_blocks = static_cast<int>(std::min<int64_t>(s.num_blocks, INT32_MAX));
  p.max_blocks_per_seq = static_cast<int>(s.max_blocks_per_seq);
  p.log2_block_size = 0;  // block sizes are powers of two (kBlockSizes)
  while ((int64_t{1} << p.log2_block_size) < s.block_size) ++p.log2_block_size;
  p.partition_len = plan.partition_len;
  p.num_partitions = static_cast<int>(plan.num_partitions);
  p.num_records = static_cast<int>(records);
  p.scale = scale;
  p.softcap = softcap;
  p.out_scale = 1.0f;
  // Records CTA + sequence (balanced_split.cuh), and where each sequence's are.
  if (plan.tensor_core.has_value()) p.seq_records = workspace.Take<int2>(s.num_seqs);
  if (plan.tensor_core.has_value() || p.num_partitions > 1) {
    const int64_t slots = s.num_heads * p.num_records;
    const cuda::PartialResults partials = cuda::TakePartials(workspace, slots, s.head_size);
    p.partial_out = partials.out;
    p.partial_max = partials.max;
    p.partial_sum = partials.sum;
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttentionCuda(cudaStream_t stream, ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                              ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                              ffi::AnyBuffer seq_lens, ffi::AnyBuffer alibi_slopes,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace, float scale, float softcap) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(
      Check(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, *out, s));
  XLA_EXT_RETURN_IF_ERROR(CheckWorkspace(kTarget, *workspace));
  if (cuda::DebugChecksEnabled()) {
    XLA_EXT_RETURN_IF_ERROR(
        cuda::DebugCheck(kTarget, stream, SequenceChecks::For(s, block_tables, seq_lens)));
  }
  if (s.num_seqs == 0 || s.num_heads == 0) return ffi::Error::Success();
  // 16-byte row loads and copies: XLA's buffers are aligned; a misaligned view would fault.
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(query.untyped_data()) |
                              reinterpret_cast<uintptr_t>(key_cache.untyped_data()) |
                              reinterpret_cast<uintptr_t>(value_cache.untyped_data()) |
                              reinterpret_cast<uintptr_t>(workspace->untyped_data());
  if (addresses % 16 != 0) {
    return ArgumentError(kTarget, "query, key_cache, value_cache, workspace",
                         "16-byte aligned buffers", "a misaligned buffer");
  }

  cuda::Workspace scratch(workspace->untyped_data(), workspace->size_bytes());
  Plan plan;
  Params p;
  XLA_EXT_RETURN_IF_ERROR(PlanCall(s, query.element_type(), scale, softcap,
                                   cuda::CurrentDeviceInfo(), scratch, plan, p));
  XLA_EXT_RETURN_IF_ERROR(scratch.CheckFits(kTarget, "workspace"));
  p.query = query.untyped_data();
  p.key_cache = key_cache.untyped_data();
  p.value_cache = value_cache.untyped_data();
  p.block_tables = static_cast<const int32_t*>(block_tables.untyped_data());
  p.seq_lens = static_cast<const int32_t*>(seq_lens.untyped_data());
  p.alibi_slopes = s.has_alibi ? static_cast<const float*>(alibi_slopes.untyped_data()) : nullptr;
  p.out = out->untyped_data();
  XLA_EXT_RETURN_IF_ERROR(DispatchKernels(query.element_type(), s.head_size, [&](auto kernels) {
    kernels.Launch(p, plan, s, stream);
  }));
  return cuda::LastLaunchError(kTarget);
}

// The contract's workspace query (kernel_table.h): the call's operands are the handler's, in
// its binding order (query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes).
int64_t WorkspaceBytes(int device, const XlaExtCallShape* call) {
  constexpr uint32_t kOperands = 6;
  if (call->num_operands != kOperands) return 0;
  XLA_FFI_Buffer b[kOperands];
  for (uint32_t i = 0; i < kOperands; ++i) b[i] = contract::OperandBuffer(*call, i);
  const ffi::AnyBuffer query(&b[0]);
  Shapes s;
  if (Check(query, ffi::AnyBuffer(&b[1]), ffi::AnyBuffer(&b[2]), ffi::AnyBuffer(&b[3]),
            ffi::AnyBuffer(&b[4]), ffi::AnyBuffer(&b[5]), query, s)
          .failure() ||
      s.num_seqs == 0 || s.num_heads == 0) {
    return 0;  // the handler rejects it, or launches nothing
  }
  return cuda::WorkspaceBytes(device, [&](const auto& info, auto& workspace) {
    Plan plan;
    Params p;
    return PlanCall(s, query.element_type(), 1.0f, 0.0f, info, workspace, plan, p);
  });
}

// Not in a CUDA graph's way: no host synchronisation, and its scratch is the workspace result
// (XLA's own buffer), not an allocation at every call.
XLA_FFI_DEFINE_HANDLER(kPagedAttentionCuda, PagedAttentionCuda,
                       Bind(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kPagedAttentionCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, WorkspaceBytes});

}  // namespace xla_ext::paged_attention
