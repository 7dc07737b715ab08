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
          /*kv_interleaved=*/false, *device);
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

// Calls fn(Kernels<T, head_size>{}) for the query's element type T; a head size without
// kernels is an error.
template <typename Fn>
ffi::Error DispatchKernels(ffi::DataType dtype, int64_t head_size, Fn&& fn) {
  bool found = true;
  XLA_EXT_RETURN_IF_ERROR(cuda::DispatchFloat(kTarget, dtype, [&](auto zero) {
    using T = decltype(zero);
    switch (head_size) {
      case 64: fn(Kernels<T, 64>{}); break;
      case 80: fn(Kernels<T, 80>{}); break;
      case 96: fn(Kernels<T, 96>{}); break;
      case 112: fn(Kernels<T, 112>{}); break;
      case 128: fn(Kernels<T, 128>{}); break;
      case 256: fn(Kernels<T, 256>{}); break;
      default: found = false;
    }
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
  p.log2_block_size = s.block_size == 8 ? 3 : s.block_size == 16 ? 4 : 5;
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

// Not in a CUDA graph's way: no host synchronisation, and its scratch is the workspace result
// (XLA's own buffer), not an allocation at every call.
XLA_FFI_DEFINE_HANDLER(kPagedAttentionCuda, PagedAttentionCuda,
                       Bind(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kPagedAttentionCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);

}  // namespace xla_ext::paged_attention

// For the front ends, which size the op's workspace result when they build the call: the bytes
// a call with these shapes (query [3], key_cache [4] and block_tables [2] dimensions; the
// query's XLA_FFI_DataType, which the caches share) needs on CUDA device `device`, or with
// device -1 the most any visible device needs; 0 where no device is visible or where the
// handler rejects the call (it says why itself).
extern "C" __attribute__((visibility("default"))) int64_t xla_ext_paged_attention_workspace_bytes(
    int device, int dtype, const int64_t* query_dims, const int64_t* cache_dims,
    const int64_t* block_tables_dims) {
  namespace pa = xla_ext::paged_attention;
  using xla_ext::cuda::DatalessBuffer;
  const int64_t seq_lens_dims[] = {block_tables_dims[0]};
  const int64_t no_alibi_dims[] = {0};
  const XLA_FFI_Buffer query = DatalessBuffer(dtype, query_dims, 3);
  const XLA_FFI_Buffer cache = DatalessBuffer(dtype, cache_dims, 4);
  const XLA_FFI_Buffer block_tables = DatalessBuffer(XLA_FFI_DataType_S32, block_tables_dims, 2);
  const XLA_FFI_Buffer seq_lens = DatalessBuffer(XLA_FFI_DataType_S32, seq_lens_dims, 1);
  const XLA_FFI_Buffer alibi = DatalessBuffer(XLA_FFI_DataType_F32, no_alibi_dims, 1);
  pa::Shapes s;
  if (pa::Check(xla::ffi::AnyBuffer(&query), xla::ffi::AnyBuffer(&cache),
                xla::ffi::AnyBuffer(&cache), xla::ffi::AnyBuffer(&block_tables),
                xla::ffi::AnyBuffer(&seq_lens), xla::ffi::AnyBuffer(&alibi),
                xla::ffi::AnyBuffer(&query), s)
          .failure() ||
      s.num_seqs == 0 || s.num_heads == 0) {
    return 0;  // the handler rejects it, or launches nothing
  }
  return xla_ext::cuda::WorkspaceBytes(device, [&](const auto& info, auto& workspace) {
    pa::Plan plan;
    pa::Params p;
    return pa::PlanCall(s, static_cast<xla::ffi::DataType>(dtype), 1.0f, 0.0f, info, workspace,
                        plan, p);
  });
}
