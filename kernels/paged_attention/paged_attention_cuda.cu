// CUDA xla_ext.paged_attention: checks, the launch plan, and the launches. Two kernels:
// - attend_tensor_core.cuh: TMA + tensor cores, for f16/bf16 on Hopper and newer with GQA groups
//   of up to 16 heads (the serving case);
// - attend_simt.cuh: CUDA cores, for everything else (f32, larger groups, older GPUs).
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

#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/debug_checks.cuh"
#include "kernels/paged_attention/attend_simt.cuh"
#include "kernels/paged_attention/attend_tensor_core.cuh"
#include "kernels/paged_attention/paged_attention.h"
#include "kernels/paged_attention/split_kv.cuh"
#include "xla_ext/registry.h"

namespace xla_ext::paged_attention {
namespace {

// Build-time tuning knobs of the tensor-core kernel (tools/device/tune_paged_attention.sh).
#ifndef XLA_EXT_PAGED_ATTENTION_KV_HEADS_PER_CTA
#define XLA_EXT_PAGED_ATTENTION_KV_HEADS_PER_CTA 8
#endif
#ifndef XLA_EXT_PAGED_ATTENTION_SHARED_KB  // shared memory a CTA's stage ring may use
#define XLA_EXT_PAGED_ATTENTION_SHARED_KB 200
#endif
// Consumer warps (one per kv head of a CTA) an SM should hold at least: a CTA of fewer kv heads
// gets a smaller share of shared memory, so that more CTAs fit. 1 keeps one CTA of the largest
// ring per SM, which leaves one consumer warp per SM when a GPU holds one kv head (tensor-
// parallel shards), and its stages' arithmetic then runs one after another.
#ifndef XLA_EXT_PAGED_ATTENTION_MIN_CONSUMER_WARPS_PER_SM
#define XLA_EXT_PAGED_ATTENTION_MIN_CONSUMER_WARPS_PER_SM 1
#endif
static_assert(XLA_EXT_PAGED_ATTENTION_KV_HEADS_PER_CTA >= 1 &&
                  XLA_EXT_PAGED_ATTENTION_KV_HEADS_PER_CTA <= tensor_core::kMaxKvHeadsPerCta,
              "the kernel's launch bounds allow at most kMaxKvHeadsPerCta consumer warps");

// Shared memory the driver keeps for itself per resident CTA (sm_80 and later).
constexpr int kReservedSharedBytes = 1024;

// XLA_EXT_PAGED_ATTENTION_KERNEL=simt selects the CUDA-core kernel everywhere, so that tests and
// benchmarks can run it on a GPU where the tensor-core kernel would be chosen.
bool ForceSimt() {
  static const bool force = cuda::EnvIs("XLA_EXT_PAGED_ATTENTION_KERNEL", "simt");
  return force;
}

// How a call is split: for the CUDA-core kernel partitions per sequence; for the tensor-core
// kernel its CTA shape and the CTAs that share the batch's tokens (per group of kv heads).
struct Plan {
  bool tensor_core = false;
  int partition_len = simt::kPartition;
  int64_t num_partitions = 1;
  int kv_heads_per_cta = 1;
  int num_stages = 0;
  int workers = 1;
  tensor_core::Layout layout{};
};

// The tensor-core kernel's plan with `kv_heads` consecutive kv heads per CTA (nullopt if two
// stages do not fit in shared memory): as many stages as the budget holds, and as many CTAs as
// fill every CTA slot of the GPU once (each CTA keeps several stages in flight, so one wave
// streams at full bandwidth, and a single wave has no tail). The kernel splits the tokens
// between them.
template <typename T, int kHeadSize, bool kHighRows>
std::optional<Plan> TensorCorePlanFor(const Shapes& s, const cuda::DeviceInfo& device, int kv_heads) {
  Plan plan;
  plan.tensor_core = true;
  plan.kv_heads_per_cta = kv_heads;
  plan.layout = tensor_core::Layout::For(kv_heads, kHeadSize, sizeof(T));
  const int ctas_per_sm_wanted =
      cuda::CeilDiv(XLA_EXT_PAGED_ATTENTION_MIN_CONSUMER_WARPS_PER_SM, kv_heads);
  const int share = ctas_per_sm_wanted == 1
                        ? device.max_shared_bytes
                        : device.max_shared_bytes / ctas_per_sm_wanted - kReservedSharedBytes;
  const int budget = std::min(XLA_EXT_PAGED_ATTENTION_SHARED_KB * 1024, share);
  plan.num_stages = std::clamp((budget - tensor_core::kHeaderBytes) / plan.layout.stage_bytes, 2,
                               tensor_core::kMaxStages);
  while (plan.num_stages >= 2 &&
         tensor_core::SharedBytes(plan.layout, plan.num_stages) > device.max_shared_bytes) {
    --plan.num_stages;
  }
  if (plan.num_stages < 2) return std::nullopt;

  const int ctas_per_sm = cuda::CtasPerSm(
      reinterpret_cast<const void*>(&tensor_core::AttendTensorCoreKernel<T, kHeadSize, kHighRows>),
      device, (kv_heads + 1) * 32, tensor_core::SharedBytes(plan.layout, plan.num_stages));
  if (ctas_per_sm == 0) return std::nullopt;
  plan.workers = static_cast<int>(
      std::max<int64_t>(1, device.sms * ctas_per_sm / (s.num_kv_heads / kv_heads)));
  return plan;
}

// Every kv head of a token in one CTA (up to the knob) streams whole token rows and lets the
// kernel prefetch whole blocks into L2.
template <typename T, int kHeadSize, bool kHighRows>
std::optional<Plan> TensorCorePlan(const Shapes& s, const cuda::DeviceInfo& device) {
  int kv_heads = XLA_EXT_PAGED_ATTENTION_KV_HEADS_PER_CTA;
  while (kv_heads > 1 && s.num_kv_heads % kv_heads != 0) kv_heads /= 2;
  std::optional<Plan> plan = TensorCorePlanFor<T, kHeadSize, kHighRows>(s, device, kv_heads);
  while (!plan.has_value() && kv_heads > 1) {
    kv_heads /= 2;
    plan = TensorCorePlanFor<T, kHeadSize, kHighRows>(s, device, kv_heads);
  }
  return plan;
}

Plan SimtPlan(const Shapes& s) {
  Plan plan;
  plan.num_partitions =
      std::max<int64_t>(1, (s.capacity() + simt::kPartition - 1) / simt::kPartition);
  return plan;
}

template <typename T, int kHeadSize, bool kHighRows>
void LaunchTensorCore(const Params& p, const Plan& plan, const Shapes& s, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(plan.workers),
                  static_cast<unsigned>(s.num_kv_heads / plan.kv_heads_per_cta));
  cuda::LaunchProgrammatic(tensor_core::AttendTensorCoreKernel<T, kHeadSize, kHighRows>, grid,
                           dim3((plan.kv_heads_per_cta + 1) * 32),
                           tensor_core::SharedBytes(plan.layout, plan.num_stages), stream, p,
                           plan.layout, plan.num_stages);
}

// The plan and the launches for one element type and head size.
template <typename T, int kHeadSize>
struct Kernels {
  static Plan MakePlan(const Shapes& s, const std::optional<cuda::DeviceInfo>& device) {
    if constexpr (!std::is_same_v<T, float>) {
      if (!ForceSimt() && device.has_value() && device->major >= 9 &&
          s.group_size() <= tensor_core::kMaxGroupSize && s.num_seqs <= INT32_MAX) {
        std::optional<Plan> plan = s.group_size() > 8
                                       ? TensorCorePlan<T, kHeadSize, true>(s, *device)
                                       : TensorCorePlan<T, kHeadSize, false>(s, *device);
        if (plan.has_value()) return *plan;
      }
    }
    return SimtPlan(s);
  }

  static void Launch(const Params& p, const Plan& plan, const Shapes& s, cudaStream_t stream) {
    if constexpr (!std::is_same_v<T, float>) {
      if (plan.tensor_core) {
        if (s.group_size() > 8) {
          LaunchTensorCore<T, kHeadSize, true>(p, plan, s, stream);
        } else {
          LaunchTensorCore<T, kHeadSize, false>(p, plan, s, stream);
        }
      }
    }
    if (!plan.tensor_core) {
      simt::Attend<T, kHeadSize>(p, static_cast<int>(s.num_seqs), s.group_size(), stream);
    }
    if (plan.tensor_core || p.num_partitions > 1) {
      // Launches while the attention kernel drains (it waits for it on the GPU). The
      // tensor-core kernel's pieces per sequence are known on the device only: a row gets the
      // warps of an even share (a longer row's warps take several chunks each).
      const int64_t records_per_row =
          plan.tensor_core ? cuda::CeilDiv(plan.workers, s.num_seqs) + 1 : p.num_partitions;
      const int warps_per_row =
          CombineWarpsPerRow(static_cast<int>(records_per_row), CombineChunk<kHeadSize>());
      const int64_t rows = s.num_seqs * s.num_heads;
      cuda::LaunchProgrammatic(CombinePartitionsKernel<T, kHeadSize>,
                               dim3(cuda::CeilDiv(rows, kCombineWarps / warps_per_row)),
                               dim3(kCombineWarps * 32), 0, stream, p, warps_per_row, rows);
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

ffi::Error PagedAttentionCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                              ffi::AnyBuffer query, ffi::AnyBuffer key_cache,
                              ffi::AnyBuffer value_cache, ffi::AnyBuffer block_tables,
                              ffi::AnyBuffer seq_lens, ffi::AnyBuffer alibi_slopes,
                              ffi::Result<ffi::AnyBuffer> out, float scale, float softcap) {
  Shapes s;
  XLA_EXT_RETURN_IF_ERROR(
      Check(query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes, *out, s));
  if (cuda::DebugChecksEnabled()) {
    XLA_EXT_RETURN_IF_ERROR(
        cuda::DebugCheck(kTarget, stream, SequenceChecks::For(s, block_tables, seq_lens)));
  }
  if (s.num_seqs == 0 || s.num_heads == 0) return ffi::Error::Success();
  // 16-byte row loads and copies: XLA's buffers are aligned; a misaligned view would fault.
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(query.untyped_data()) |
                              reinterpret_cast<uintptr_t>(key_cache.untyped_data()) |
                              reinterpret_cast<uintptr_t>(value_cache.untyped_data());
  if (addresses % 16 != 0) {
    return ArgumentError(kTarget, "query, key_cache, value_cache", "16-byte aligned buffers",
                         "a misaligned buffer");
  }

  const std::optional<cuda::DeviceInfo> device = cuda::CurrentDeviceInfo();
  Plan plan;
  XLA_EXT_RETURN_IF_ERROR(DispatchKernels(
      query.element_type(), s.head_size, [&](auto kernels) { plan = kernels.MakePlan(s, device); }));
  const int64_t records =
      plan.tensor_core ? plan.workers + s.num_seqs : s.num_seqs * plan.num_partitions;
  if (records > INT32_MAX) {  // grid dimensions and record numbers
    return ArgumentError(kTarget, "block_tables", "num_seqs * partitions < 2^31",
                         "shape " + ShapeString(block_tables.dimensions()));
  }

  Params p{};
  p.query = query.untyped_data();
  p.key_cache = key_cache.untyped_data();
  p.value_cache = value_cache.untyped_data();
  p.block_tables = static_cast<const int32_t*>(block_tables.untyped_data());
  p.seq_lens = static_cast<const int32_t*>(seq_lens.untyped_data());
  p.alibi_slopes = s.has_alibi ? static_cast<const float*>(alibi_slopes.untyped_data()) : nullptr;
  p.out = out->untyped_data();
  p.num_seqs = static_cast<int>(s.num_seqs);
  p.num_heads = static_cast<int>(s.num_heads);
  p.num_kv_heads = static_cast<int>(s.num_kv_heads);
  p.num_blocks = static_cast<int>(std::min<int64_t>(s.num_blocks, INT32_MAX));
  p.max_blocks_per_seq = static_cast<int>(s.max_blocks_per_seq);
  p.log2_block_size = s.block_size == 8 ? 3 : s.block_size == 16 ? 4 : 5;
  p.partition_len = plan.partition_len;
  p.num_partitions = static_cast<int>(plan.num_partitions);
  p.scale = scale;
  p.softcap = softcap;

  if (plan.tensor_core) {
    // Records CTA + sequence (balanced_split.cuh), and where each sequence's are.
    p.num_records = static_cast<int>(records);
    std::optional<void*> seq_records = scratch.Allocate(s.num_seqs * sizeof(int2), 16);
    if (!seq_records.has_value()) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        std::string(kTarget) + ": cannot allocate " +
                            std::to_string(s.num_seqs * sizeof(int2)) + " bytes of scratch");
    }
    p.seq_records = static_cast<int2*>(*seq_records);
  } else {
    p.num_records = static_cast<int>(records);
  }
  if (plan.tensor_core || p.num_partitions > 1) {
    cuda::PartialResults partials;
    XLA_EXT_RETURN_IF_ERROR(cuda::AllocatePartials(
        scratch, kTarget, s.num_heads * p.num_records, s.head_size, partials));
    p.partial_out = partials.out;
    p.partial_max = partials.max;
    p.partial_sum = partials.sum;
  }

  XLA_EXT_RETURN_IF_ERROR(DispatchKernels(query.element_type(), s.head_size, [&](auto kernels) {
    kernels.Launch(p, plan, s, stream);
  }));
  return cuda::LastLaunchError(kTarget);
}

// Not command-buffer compatible: the scratch for the partitions comes from the
// ScratchAllocator at every call, which a recorded command buffer cannot repeat.
XLA_FFI_DEFINE_HANDLER(kPagedAttentionCuda, PagedAttentionCuda,
                       Bind(ffi::Ffi::Bind()
                                .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                .Ctx<ffi::ScratchAllocator>()));

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kPagedAttentionCuda, XLA_EXT_NO_TRAITS);

}  // namespace xla_ext::paged_attention
