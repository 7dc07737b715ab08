// CUDA xla_ext.ragged_paged_attention: checks, the choice of kernel, and the launches, all
// kernels from the attention library (kernels/attention):
// - The tiled kernels (tiled_batch.cuh) for f16/bf16 queries and caches of the same dtype on
//   Hopper (the serving case): the batch's (query tile, kv stage) units split evenly over a
//   grid that fills the GPU once, on the device. tiled_warpgroup.cuh (wgmma) for head_dim 64
//   and 128 on compute capability 9.x, tiled_tensor_core.cuh (mma.sync, TMA) for the other
//   head sizes up to 128 and newer GPUs. Their sequences with one query row (decode steps) go
//   to the decode engine (decode_steps.cuh), which splits them in the same way over its share
//   of the GPU, at the same time (gpu_share.cuh). A call whose max_q_len is 1 (decode steps
//   only) runs the decode kernel alone (decode_steps.cuh's DecodeOnlySteps).
// - ragged_simt.cuh: CUDA cores, for everything else (f32, fp8 caches, head_dim 192 and 256,
//   a mask_value whose masked positions must be visited).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <type_traits>

#include "kernels/attention/batch_params.cuh"
#include "kernels/attention/decode_steps.cuh"
#include "kernels/attention/decode_tensor_core.cuh"
#include "kernels/attention/gpu_share.cuh"
#include "kernels/attention/ragged_simt.cuh"
#include "kernels/attention/split_kv.cuh"
#include "kernels/attention/tiled_batch.cuh"
#include "kernels/attention/tiled_tensor_core.cuh"
#include "kernels/attention/tiled_warpgroup.cuh"
#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/debug_checks.cuh"
#include "kernels/ragged_paged_attention/ragged_paged_attention.h"
#include "xla_ext/registry.h"

namespace xla_ext::ragged_paged_attention {

// The ragged kernels of the attention library (kernels/attention), and the decode kernel that
// takes a ragged batch's decode steps.
namespace decode = attention::decode;
namespace simt = attention::ragged::simt;
namespace tensor_core = attention::ragged::tensor_core;
namespace tiled = attention::ragged::tiled;
namespace warpgroup = attention::ragged::warpgroup;
using attention::ragged::BatchParams;
using attention::ragged::CombineKernel;
using attention::ragged::DecodeOnlySteps;
using attention::ragged::DecodeStepParams;
using attention::ragged::DecodeSteps;
using attention::ragged::GpuShare;

namespace {

// XLA_EXT_RAGGED_PAGED_ATTENTION_KERNEL=simt, =tensor_core or =warpgroup selects that kernel
// wherever it applies (the tiled ones on decode steps too), so that tests and benchmarks can
// run each where the handler would choose otherwise.
bool ForceSimt() {
  static const bool force = cuda::EnvIs("XLA_EXT_RAGGED_PAGED_ATTENTION_KERNEL", "simt");
  return force;
}
bool ForceTensorCore() {
  static const bool force = cuda::EnvIs("XLA_EXT_RAGGED_PAGED_ATTENTION_KERNEL", "tensor_core");
  return force;
}
bool ForceWarpgroup() {
  static const bool force = cuda::EnvIs("XLA_EXT_RAGGED_PAGED_ATTENTION_KERNEL", "warpgroup");
  return force;
}

// What the launches need besides the call's parameters. A measuring workspace plans the
// call without launching it (WorkspaceBytes).
struct Call {
  const Shapes& shapes;
  const std::optional<cuda::DeviceInfo>& device;
  cuda::Workspace& workspace;
  cudaStream_t stream;
  bool decode_only;  // max_q_len == 1
};

// After the last Take, before the first launch: whether to launch (not while measuring), or
// the error of a workspace too small for what was taken.
ffi::Error ReadyToLaunch(const Call& call, bool& launch) {
  launch = !call.workspace.measuring();
  return launch ? call.workspace.CheckFits(kTarget, "workspace") : ffi::Error::Success();
}

// The launches for one (q dtype, kv dtype, head_dim).
template <typename T, typename KV, int kHeadDim>
struct Kernels {
  static constexpr bool kHasTensorCore =
      std::is_same_v<T, KV> && !std::is_same_v<T, float> && kHeadDim <= 128;
  static constexpr bool kHasWarpgroup = kHasTensorCore && warpgroup::HasHeadDim(kHeadDim);

  // A tiled kernel and its grid: CTAs per kv head.
  struct Tiled {
    void (*attend)(tiled::Params);
    int threads;
    int shared_bytes;
    int tile_rows;
    int stage_tokens;
    int ctas_per_sm;
    int workers;
  };

  // Where neither the tiled kernels nor the decode kernel alone apply: the CUDA-core kernel
  // forced, a mask_value whose masked positions must be visited, no Hopper.
  static bool OnlySimtApplies(const BatchParams& p, const Call& call) {
    return ForceSimt() || p.visit_masked || !call.device.has_value() || call.device->major < 9;
  }

  // The tiled kernel for the call, or nullopt where none applies.
  static std::optional<Tiled> ChooseTiled(const BatchParams& p, const Call& call) {
    if (OnlySimtApplies(p, call)) return std::nullopt;
    if constexpr (kHasWarpgroup) {
      // Its producer indexes cache rows (page * page_size + offset) in int.
      if (!ForceTensorCore() && call.device->major == 9 &&
          call.shapes.num_pages * call.shapes.page_size <= INT32_MAX) {
        if (auto tiled = Sized(&warpgroup::AttendKernel<T, kHeadDim>, warpgroup::kThreads,
                               warpgroup::Layout<T, kHeadDim>::kSharedBytes,
                               warpgroup::kTileRows, warpgroup::kStageTokens, p, call)) {
          return tiled;
        }
      }
    }
    if constexpr (kHasTensorCore) {
      return Sized(&tensor_core::AttendKernel<T, kHeadDim>, tensor_core::kThreads,
                   tensor_core::Layout<T, kHeadDim>::kSharedBytes, tensor_core::kTileRows,
                   tensor_core::kStageTokens, p, call);
    }
    return std::nullopt;
  }

  static std::optional<Tiled> Sized(void (*attend)(tiled::Params), int threads, int shared_bytes,
                                    int tile_rows, int stage_tokens, const BatchParams& p,
                                    const Call& call) {
    const Shapes& s = call.shapes;
    if (shared_bytes > call.device->max_shared_bytes || p.group_size > tile_rows) {
      return std::nullopt;
    }
    // Units (tile, stage) of the whole batch stay well inside int.
    const int64_t tile_tokens = tile_rows / p.group_size;
    const int64_t tiles = (s.num_tokens + tile_tokens - 1) / tile_tokens + s.max_num_seqs;
    if (tiles * (s.capacity() / tiled::kMinStageTokens + 2) > INT32_MAX / 2) return std::nullopt;
    const int ctas_per_sm = cuda::CtasPerSm(reinterpret_cast<const void*>(attend), *call.device,
                                            threads, shared_bytes);
    if (ctas_per_sm == 0) return std::nullopt;
    const int workers = static_cast<int>(
        std::max<int64_t>(1, int64_t{call.device->sms} * ctas_per_sm / s.num_kv_heads));
    return Tiled{attend, threads, shared_bytes, tile_rows, stage_tokens, ctas_per_sm, workers};
  }

  static ffi::Error LaunchTiled(const BatchParams& batch, const Tiled& kernel, const Call& call) {
    if constexpr (kHasTensorCore) {
      const Shapes& s = call.shapes;
      const std::optional<decode::tensor_core::Plan> decode_plan =
          ForceTensorCore() || ForceWarpgroup()
              ? std::nullopt
              : decode::tensor_core::MakePlan<T, kHeadDim, DecodeSteps>(
                    batch.num_kv_heads, batch.group_size,
                    /*kv_interleaved=*/true, 1 << batch.log2_page_size, *call.device);
      tiled::Params tp{};
      static_cast<BatchParams&>(tp) = batch;
      tp.num_records = 2 * kernel.workers;
      tp.tile_rows = kernel.tile_rows;
      tp.tile_tokens = kernel.tile_rows / batch.group_size;
      tp.stage_tokens = kernel.stage_tokens;
      tp.decode_steps_elsewhere = decode_plan.has_value();
      tp.share = Share(kernel, decode_plan, batch, *call.device);
      decode::Params decode_steps{};
      if (decode_plan.has_value()) {
        XLA_EXT_RETURN_IF_ERROR(PrepareDecodeSteps(batch, *decode_plan, call, decode_steps));
      }
      tp.row_pieces = call.workspace.Take<int4>(s.num_tokens);
      const int64_t slots = s.num_kv_heads * tp.num_records * kernel.tile_rows;
      const cuda::PartialResults partials = cuda::TakePartials(call.workspace, slots, kHeadDim);
      tp.partial_out = partials.out;
      tp.partial_max = partials.max;
      tp.partial_sum = partials.sum;
      bool launch = false;
      XLA_EXT_RETURN_IF_ERROR(ReadyToLaunch(call, launch));
      if (!launch) return ffi::Error::Success();

      kernel.attend<<<dim3(static_cast<unsigned>(kernel.workers),
                           static_cast<unsigned>(s.num_kv_heads)),
                      kernel.threads, kernel.shared_bytes, call.stream>>>(tp);
      // Each combine grid strides over its rows and is no larger than the GPU holds at once.
      const auto combine_ctas = [&](auto* combine, int64_t wanted) {
        return static_cast<unsigned>(cuda::OneWaveCtas(reinterpret_cast<const void*>(combine),
                                                       *call.device, tiled::kCombineWarps * 32,
                                                       wanted));
      };
      const int64_t rows = s.num_tokens * s.num_q_heads;
      const int64_t tiled_combine_ctas =
          (rows + tiled::kCombineWarps - 1) / tiled::kCombineWarps;
      if (decode_plan.has_value()) {
        // Beside the tiled kernel (gpu_share.cuh), and one combine for both behind it.
        decode::tensor_core::LaunchAttention<T, kHeadDim>(decode_steps, DecodeSteps{tp},
                                                                   *decode_plan, call.stream);
        const int64_t decode_rows = int64_t{batch.max_num_seqs} * s.num_q_heads;
        auto* combine = &CombineKernel<T, kHeadDim>;
        cuda::LaunchProgrammatic(
            combine, dim3(combine_ctas(combine, std::max(tiled_combine_ctas, decode_rows))),
            dim3(tiled::kCombineWarps * 32), 0, call.stream, tp, decode_steps, decode_rows);
      } else {
        auto* combine = &tiled::CombineKernel<T, kHeadDim>;
        cuda::LaunchProgrammatic(combine, dim3(combine_ctas(combine, tiled_combine_ctas)),
                                 dim3(tiled::kCombineWarps * 32), 0, call.stream, tp);
      }
    }
    return ffi::Error::Success();
  }

  // How the tiled and decode-step kernels share the GPU (gpu_share.cuh). What a unit costs an
  // SM, measured on the H100: the wgmma kernel alone did prefill 4 x 2048's 17408 units of
  // 128 x 128 x 128 (4 flops each) on 128 CTAs in 318.8 us, 3600 flops per ns, but beside
  // the decode kernel 2300-2500 (4 chunks of 256 + 60 decodes: 30 units per CTA in 110.8 us),
  // and the split is made for the two running side by side; the decode kernel's 132 CTAs
  // streamed 32 x 4096's 8192 stages of 64 KB in 184.4 us, 22 bytes per ns.
  static GpuShare Share(const Tiled& kernel,
                        const std::optional<decode::tensor_core::Plan>& decode_plan,
                        const BatchParams& batch, const cuda::DeviceInfo& device) {
    constexpr int64_t kTiledFlopsPerNs = 2400;
    constexpr int64_t kDecodeBytesPerNs = 22;
    GpuShare share{};
    share.sms = device.sms;
    share.tiled_workers = kernel.workers;
    share.tiled_ctas_per_sm = kernel.ctas_per_sm;
    share.tiled_unit_ns = static_cast<int>(int64_t{4} * kernel.tile_rows * kernel.stage_tokens *
                                           kHeadDim / kTiledFlopsPerNs);
    if (decode_plan.has_value()) {
      share.decode_workers = decode_plan->workers;
      share.decode_groups = batch.num_kv_heads / decode_plan->kv_heads_per_cta;
      share.decode_ctas_per_sm = decode_plan->ctas_per_sm;
      share.decode_unit_ns = static_cast<int>(
          int64_t{2} * decode::tensor_core::kStageTokens * decode_plan->kv_heads_per_cta *
          kHeadDim * sizeof(KV) / kDecodeBytesPerNs);
    }
    return share;
  }

  // The decode kernel alone, for a batch of decode steps only (max_q_len = 1), or nullopt
  // where it does not apply (a tiled kernel forced, or OnlySimtApplies): the kernels of the
  // tiled path then run instead.
  static std::optional<decode::tensor_core::Plan> DecodeOnlyPlan(const BatchParams& batch,
                                                                 const Call& call) {
    if constexpr (kHasTensorCore) {
      if (!call.decode_only || ForceTensorCore() || ForceWarpgroup() ||
          OnlySimtApplies(batch, call)) {
        return std::nullopt;
      }
      return decode::tensor_core::MakePlan<T, kHeadDim, DecodeOnlySteps>(
          batch.num_kv_heads, batch.group_size, /*kv_interleaved=*/true,
          1 << batch.log2_page_size, *call.device);
    }
    return std::nullopt;
  }

  static ffi::Error LaunchDecodeOnly(const BatchParams& batch,
                                     const decode::tensor_core::Plan& plan, const Call& call) {
    if constexpr (kHasTensorCore) {
      decode::Params d{};
      XLA_EXT_RETURN_IF_ERROR(PrepareDecodeSteps(batch, plan, call, d));
      // One arrival counter per (sequence, kv head); past them, the combine kernel merges.
      d.fused_combine = int64_t{batch.max_num_seqs} * batch.num_kv_heads <=
                        decode::tensor_core::kMaxPieceArrivals;
      bool launch = false;
      XLA_EXT_RETURN_IF_ERROR(ReadyToLaunch(call, launch));
      if (!launch) return ffi::Error::Success();
      const DecodeOnlySteps steps{batch};
      decode::tensor_core::LaunchAttention<T, kHeadDim>(d, steps, plan, call.stream);
      if (!d.fused_combine) {
        decode::LaunchCombine<T, kHeadDim>(d, steps,
                                           int64_t{batch.max_num_seqs} * batch.num_q_heads,
                                           call.stream);
      }
    }
    return ffi::Error::Success();
  }

  // The decode-step kernel's parameters and its part of the workspace (decode_steps.cuh).
  static ffi::Error PrepareDecodeSteps(const BatchParams& batch,
                                       const decode::tensor_core::Plan& plan,
                                       const Call& call, decode::Params& d) {
    d = DecodeStepParams(batch);
    const int64_t records = decode::tensor_core::NumRecords(plan, batch.max_num_seqs);
    if (records > INT32_MAX) {
      return ArgumentError(kTarget, "kv_lens", "max_num_seqs + CTAs < 2^31",
                           std::to_string(batch.max_num_seqs) + " sequences");
    }
    d.num_records = static_cast<int>(records);
    d.seq_records = call.workspace.Take<int2>(batch.max_num_seqs);
    const int64_t slots = int64_t{batch.num_q_heads} * d.num_records;
    const cuda::PartialResults partials = cuda::TakePartials(call.workspace, slots, kHeadDim);
    d.partial_out = partials.out;
    d.partial_max = partials.max;
    d.partial_sum = partials.sum;
    return ffi::Error::Success();
  }

  template <int kHeads>
  static void LaunchAttend(const simt::Params& p, const simt::Plan& plan, const Shapes& s,
                           cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>(s.num_tokens),
                    static_cast<unsigned>(s.num_kv_heads * plan.head_chunks),
                    static_cast<unsigned>(plan.num_partitions));
    simt::AttendKernel<T, KV, kHeadDim, kHeads>
        <<<grid, simt::kThreads, 0, stream>>>(p, plan.head_chunks);
  }

  static ffi::Error Launch(const BatchParams& batch, const Call& call) {
    if (const std::optional<decode::tensor_core::Plan> plan = DecodeOnlyPlan(batch, call)) {
      return LaunchDecodeOnly(batch, *plan, call);
    }
    if (const std::optional<Tiled> tiled = ChooseTiled(batch, call)) {
      return LaunchTiled(batch, *tiled, call);
    }
    simt::Params p{};
    static_cast<BatchParams&>(p) = batch;
    const Shapes& s = call.shapes;
    const simt::Plan plan = simt::MakePlan(batch, call.device);
    p.num_partitions = plan.num_partitions;
    p.partition_len = plan.partition_len;
    if (plan.num_partitions > 1) {
      const int64_t slots = s.num_tokens * s.num_q_heads * plan.num_partitions;
      const cuda::PartialResults partials = cuda::TakePartials(call.workspace, slots, kHeadDim);
      p.partial_out = partials.out;
      p.partial_max = partials.max;
      p.partial_sum = partials.sum;
    }
    bool launch = false;
    XLA_EXT_RETURN_IF_ERROR(ReadyToLaunch(call, launch));
    if (!launch) return ffi::Error::Success();
    switch (plan.heads_per_cta) {
      case 1: LaunchAttend<1>(p, plan, s, call.stream); break;
      case 2: LaunchAttend<2>(p, plan, s, call.stream); break;
      case 4: LaunchAttend<4>(p, plan, s, call.stream); break;
      case 8: LaunchAttend<8>(p, plan, s, call.stream); break;
      default:
        return NoKernelError(kTarget, "query heads per CTA",
                             std::to_string(plan.heads_per_cta));
    }
    if (plan.num_partitions > 1) {
      const int64_t rows = s.num_tokens * s.num_q_heads;
      simt::CombineKernel<T, kHeadDim>
          <<<static_cast<unsigned>((rows + simt::kWarps - 1) / simt::kWarps), simt::kThreads, 0,
             call.stream>>>(p, rows);
    }
    return ffi::Error::Success();
  }
};

// Kernels are built for every head_dim of the contract (kHeadDims).
template <typename T, typename KV, typename Fn>
ffi::Error DispatchHeadDim(int64_t head_dim, Fn&& fn) {
  ffi::Error result = ffi::Error::Success();
  if (!contract::Dispatch<kHeadDims>(head_dim, [&](auto dim) {
        result = fn(Kernels<T, KV, decltype(dim)::value>{});
      })) {
    return NoKernelError(kTarget, "head_dim", std::to_string(head_dim));
  }
  return result;
}

// Calls fn(Kernels<T, KV, head_dim>{}) for the element types of q and kv_pages.
template <typename Fn>
ffi::Error Dispatch(ffi::DataType q_type, bool fp8_kv, int64_t head_dim, Fn&& fn) {
  switch (q_type) {
    case ffi::DataType::F32:
      if (fp8_kv) break;
      return DispatchHeadDim<float, float>(head_dim, fn);
    case ffi::DataType::F16:
      return fp8_kv ? DispatchHeadDim<__half, __nv_fp8_e4m3>(head_dim, fn)
                    : DispatchHeadDim<__half, __half>(head_dim, fn);
    case ffi::DataType::BF16:
      return fp8_kv ? DispatchHeadDim<__nv_bfloat16, __nv_fp8_e4m3>(head_dim, fn)
                    : DispatchHeadDim<__nv_bfloat16, __nv_bfloat16>(head_dim, fn);
    default:
      break;
  }
  return NoKernelError(kTarget, "q dtype",
                       std::string(DTypeName(q_type)) + " with kv_pages " +
                           (fp8_kv ? "f8e4m3fn" : "of the same dtype"));
}

// The batch's parameters but for the buffers' addresses.
BatchParams MakeBatchParams(const Shapes& s, const Attrs& a) {
  BatchParams p{};
  p.num_tokens = static_cast<int>(s.num_tokens);
  p.num_q_heads = static_cast<int>(s.num_q_heads);
  p.num_kv_heads = static_cast<int>(s.num_kv_heads);
  p.group_size = static_cast<int>(s.group_size());
  p.num_pages = static_cast<int>(std::min<int64_t>(s.num_pages, INT32_MAX));
  p.log2_page_size = 0;
  while ((int64_t{1} << p.log2_page_size) < s.page_size) ++p.log2_page_size;
  p.pages_per_seq = static_cast<int>(s.pages_per_seq);
  p.max_num_seqs = static_cast<int>(std::min<int64_t>(s.max_num_seqs, INT32_MAX));
  p.score_scale = a.sm_scale * a.k_scale;
  p.sliding_window = a.sliding_window;
  p.soft_cap = a.soft_cap;
  p.mask_value = a.mask_value;
  p.visit_masked = !(a.mask_value <= kNegligibleMaskValue);
  p.v_scale = a.v_scale;
  return p;
}

ffi::Error RaggedPagedAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_pages,
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
  XLA_EXT_RETURN_IF_ERROR(CheckWorkspace(kTarget, *workspace));
  if (cuda::DebugChecksEnabled()) {
    XLA_EXT_RETURN_IF_ERROR(cuda::DebugCheck(
        kTarget, stream, DataChecks::For(s, attrs, kv_lens, page_indices, cu_q_lens, num_seqs)));
  }
  if (s.num_tokens == 0 || s.num_q_heads == 0) return ffi::Error::Success();
  // 16-byte row loads: XLA's buffers are aligned; a misaligned view would fault.
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(q.untyped_data()) |
                              reinterpret_cast<uintptr_t>(kv_pages.untyped_data()) |
                              reinterpret_cast<uintptr_t>(out->untyped_data()) |
                              reinterpret_cast<uintptr_t>(workspace->untyped_data());
  if (addresses % 16 != 0) {
    return ArgumentError(kTarget, "q, kv_pages, out, workspace", "16-byte aligned buffers",
                         "a misaligned buffer");
  }

  BatchParams p = MakeBatchParams(s, attrs);
  p.q = q.untyped_data();
  p.kv_pages = kv_pages.untyped_data();
  p.kv_lens = static_cast<const int32_t*>(kv_lens.untyped_data());
  p.page_indices = static_cast<const int32_t*>(page_indices.untyped_data());
  p.cu_q_lens = static_cast<const int32_t*>(cu_q_lens.untyped_data());
  p.num_seqs = static_cast<const int32_t*>(num_seqs.untyped_data());
  p.out = out->untyped_data();

  const std::optional<cuda::DeviceInfo> device = cuda::CurrentDeviceInfo();
  cuda::Workspace scratch(workspace->untyped_data(), workspace->size_bytes());
  const Call call{s, device, scratch, stream, max_q_len == 1};
  XLA_EXT_RETURN_IF_ERROR(Dispatch(q.element_type(), s.fp8_kv, s.head_dim,
                                   [&](auto kernels) { return kernels.Launch(p, call); }));
  return cuda::LastLaunchError(kTarget);
}

// The contract's workspace query (kernel_table.h): the call's operands are the handler's, in
// its binding order (q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs), and its
// attributes by name.
int64_t WorkspaceBytes(int device, const XlaExtCallShape* call) {
  constexpr uint32_t kOperands = 6;
  if (call->num_operands != kOperands) return 0;
  XLA_FFI_Buffer b[kOperands];
  for (uint32_t i = 0; i < kOperands; ++i) b[i] = contract::OperandBuffer(*call, i);
  const auto attribute = [&](const char* name) {
    return contract::Attribute(*call, name, std::nan(""));
  };
  const Attrs attrs{static_cast<float>(attribute("sm_scale")),
                    static_cast<int32_t>(contract::Attribute(*call, "sliding_window", -1)),
                    static_cast<float>(attribute("soft_cap")),
                    static_cast<float>(attribute("mask_value")),
                    static_cast<float>(attribute("k_scale")),
                    static_cast<float>(attribute("v_scale")),
                    static_cast<int32_t>(contract::Attribute(*call, "max_q_len", 0))};
  const ffi::AnyBuffer q(&b[0]);
  Shapes s;
  if (Check(q, ffi::AnyBuffer(&b[1]), ffi::AnyBuffer(&b[2]), ffi::AnyBuffer(&b[3]),
            ffi::AnyBuffer(&b[4]), ffi::AnyBuffer(&b[5]), q, attrs, s)
          .failure() ||
      s.num_tokens == 0 || s.num_q_heads == 0) {
    return 0;  // the handler rejects it (a missing attribute too), or launches nothing
  }
  const BatchParams p = MakeBatchParams(s, attrs);
  return cuda::WorkspaceBytes(device, [&](const auto& info, auto& workspace) {
    const Call plan_only{s, info, workspace, nullptr, attrs.max_q_len == 1};
    return Dispatch(q.element_type(), s.fp8_kv, s.head_dim,
                    [&](auto kernels) { return kernels.Launch(p, plan_only); });
  });
}

// Not in a CUDA graph's way: no host synchronisation, and its scratch is the workspace result
// (XLA's own buffer), not an allocation at every call.
XLA_FFI_DEFINE_HANDLER(kRaggedPagedAttentionCuda, RaggedPagedAttentionCuda,
                       Bind(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace

XLA_EXT_REGISTER_KERNEL(kTarget, "CUDA", kRaggedPagedAttentionCuda,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{
    0, kTarget, static_cast<uint32_t>(std::size(kSupported)), kSupported, WorkspaceBytes});

}  // namespace xla_ext::ragged_paged_attention
