// The kernels' build-time tuning knobs, in one place: each is a macro that a -D flag may
// override, so that another setting can be built and timed without editing a kernel
// (tools/device/tune_paged_attention.sh builds one library per setting). The defaults are the
// settings the kernels' comments give the reasons for; the kernels read only the constants
// below. Settled choices are plain constants in the kernels themselves, not knobs.
#ifndef XLA_EXT_KERNELS_COMMON_TUNING_H_
#define XLA_EXT_KERNELS_COMMON_TUNING_H_

// The decode engine's CUDA-core kernel (kernels/attention/decode_simt.cuh).
#ifndef XLA_EXT_PAGED_ATTENTION_PARTITION  // tokens per CTA
#define XLA_EXT_PAGED_ATTENTION_PARTITION 512
#endif
#ifndef XLA_EXT_PAGED_ATTENTION_UNROLL  // tokens a thread loads before it uses any
#define XLA_EXT_PAGED_ATTENTION_UNROLL 4
#endif

// The decode engine's tensor-core kernel (kernels/attention/decode_tensor_core.cuh).
#ifndef XLA_EXT_PAGED_ATTENTION_KV_HEADS_PER_CTA  // the most kv heads (consumer warps) a CTA takes
#define XLA_EXT_PAGED_ATTENTION_KV_HEADS_PER_CTA 8
#endif
#ifndef XLA_EXT_PAGED_ATTENTION_SHARED_KB  // shared memory a CTA's stage ring may use
#define XLA_EXT_PAGED_ATTENTION_SHARED_KB 200
#endif
#ifndef XLA_EXT_PAGED_ATTENTION_MIN_COPY_BYTES  // bytes a token run's copy should reach (0: pairs)
#define XLA_EXT_PAGED_ATTENTION_MIN_COPY_BYTES 8192
#endif
// The fewest 16-token stages a CTA takes (decode_tensor_core.cuh says why).
#ifndef XLA_EXT_PAGED_ATTENTION_MIN_CTA_STAGES
#define XLA_EXT_PAGED_ATTENTION_MIN_CTA_STAGES 4
#endif
// Consumer warps an SM should hold at least (decode_tensor_core.cuh says why).
#ifndef XLA_EXT_PAGED_ATTENTION_MIN_CONSUMER_WARPS_PER_SM
#define XLA_EXT_PAGED_ATTENTION_MIN_CONSUMER_WARPS_PER_SM 8
#endif

namespace xla_ext::tuning {

inline constexpr int kDecodeSimtPartition = XLA_EXT_PAGED_ATTENTION_PARTITION;
inline constexpr int kDecodeSimtUnroll = XLA_EXT_PAGED_ATTENTION_UNROLL;
inline constexpr int kDecodeKvHeadsPerCta = XLA_EXT_PAGED_ATTENTION_KV_HEADS_PER_CTA;
inline constexpr int kDecodeSharedKb = XLA_EXT_PAGED_ATTENTION_SHARED_KB;
inline constexpr int kDecodeMinCopyBytes = XLA_EXT_PAGED_ATTENTION_MIN_COPY_BYTES;
inline constexpr int kDecodeMinCtaStages = XLA_EXT_PAGED_ATTENTION_MIN_CTA_STAGES;
inline constexpr int kDecodeMinConsumerWarpsPerSm =
    XLA_EXT_PAGED_ATTENTION_MIN_CONSUMER_WARPS_PER_SM;

}  // namespace xla_ext::tuning

#endif  // XLA_EXT_KERNELS_COMMON_TUNING_H_
