// XLA_EXT_DEBUG_CHECKS: the CUDA handlers' debug mode. Without it a CUDA handler cannot see
// the data it indexes with (block ids, lengths, slots) without synchronising, so it skips or
// clamps bad entries silently (each op's header says how). With it, a handler first runs its
// op's data checks (data_checks.h: the entries the Host handler checks, in the same order) in
// one small kernel, synchronises the stream, and returns the Host handler's error for the
// first violation before it launches anything else: the caches stay unchanged.
//
// Cost: off, one branch on a bool read once per process. On, per call: one single-CTA launch
// reading the checked entries once, and a stream synchronisation.
//
// A call captured into a CUDA graph (cudaStreamIsCapturing; e.g. torch.cuda.graph around the
// torch CUDA op) cannot synchronise: its check kernel is captured too and, at each replay,
// records the first violation it finds; the next call that is not captured (of any op on the
// device) reports it. The replayed main kernel still runs on that data, with its skip/clamp
// behaviour. In debug mode no handler is registered as command-buffer compatible
// (debug_checks_flag.h), yet XLA captured a torch.compile'd step's calls on the H200; so
// torch_xla_ext turns XLA's command buffers off under torch_xla too (plugin.xla_flags).
#ifndef XLA_EXT_KERNELS_COMMON_DEBUG_CHECKS_CUH_
#define XLA_EXT_KERNELS_COMMON_DEBUG_CHECKS_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "kernels/common/cuda_utils.cuh"
#include "kernels/common/data_checks.h"
#include "kernels/common/debug_checks_flag.h"
#include "xla/ffi/api/ffi.h"

namespace xla_ext::cuda {

// Where a check kernel writes the first violation it found. It lives in mapped pinned host
// memory: the host reads it once the stream is synchronised, with no copy to enqueue (or to
// capture into a graph).
struct DebugRecord {
  Violation violation;  // violation.check != 0: holds a violation (written last)
  uintptr_t describe;   // the op's Checks::Describe: a host function the device only copies
};

inline constexpr int kDebugCheckThreads = 1024;

// One CTA visits every entry of `checks`; the thread holding the smallest violating entry (the
// one the Host handler reports) writes it to `record`, unless the record still holds one.
template <typename Checks>
__global__ void __launch_bounds__(kDebugCheckThreads)
    FirstViolationKernel(Checks checks, DebugRecord* record, uintptr_t describe) {
  __shared__ unsigned long long first;
  if (threadIdx.x == 0) first = ~0ull;
  __syncthreads();
  Violation mine;
  int64_t my_entry = -1;
  // A thread's entries rise, so the first violation it meets is its smallest.
  for (int64_t entry = threadIdx.x, n = checks.num_entries(); entry < n; entry += blockDim.x) {
    mine = checks.Check(entry);
    if (mine.check != 0) {
      my_entry = entry;
      atomicMin(&first, static_cast<unsigned long long>(entry));
      break;
    }
  }
  __syncthreads();
  if (my_entry < 0 || static_cast<unsigned long long>(my_entry) != first) return;
  volatile DebugRecord* out = record;
  if (out->violation.check != 0) return;
  for (int i = 0; i < 6; ++i) out->violation.values[i] = mine.values[i];
  out->describe = describe;
  __threadfence_system();  // the host may see `check` only after the rest
  out->violation.check = mine.check;
}

// A device's records: `direct` for calls that synchronise (one at a time, under `mu`),
// `captured` for calls captured into graphs, whose replays write it.
struct DebugRecords {
  std::mutex mu;
  DebugRecord* direct = nullptr;
  DebugRecord* captured = nullptr;
};

// The current device's records, allocated at its first checked call; null if that failed.
inline DebugRecords* CurrentDebugRecords() {
  constexpr int kMaxDevices = 64;
  static std::once_flag allocated[kMaxDevices];
  static DebugRecords records[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    return nullptr;
  }
  std::call_once(allocated[device], [device] {
    // The first checked call may be one being captured, where pinned allocations are
    // otherwise refused (and would invalidate the capture).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    void* memory = nullptr;
    if (cudaHostAlloc(&memory, 2 * sizeof(DebugRecord),
                      cudaHostAllocMapped | cudaHostAllocPortable) == cudaSuccess) {
      std::memset(memory, 0, 2 * sizeof(DebugRecord));
      void* on_device = nullptr;
      if (cudaHostGetDevicePointer(&on_device, memory, 0) == cudaSuccess && on_device == memory) {
        records[device].direct = static_cast<DebugRecord*>(memory);
        records[device].captured = records[device].direct + 1;
      }
    }
    cudaGetLastError();  // a failure is reported by the null records, not by the next launch
    cudaThreadExchangeStreamCaptureMode(&mode);
  });
  return records[device].direct != nullptr ? &records[device] : nullptr;
}

// The violation `record` holds, as its op's error, and the record emptied; nullopt if none.
inline std::optional<::xla::ffi::Error> TakeViolation(DebugRecord* record) {
  volatile DebugRecord* in = record;
  Violation violation;
  violation.check = in->violation.check;
  if (violation.check == 0) return std::nullopt;
  std::atomic_thread_fence(std::memory_order_acquire);
  for (int i = 0; i < 6; ++i) violation.values[i] = in->violation.values[i];
  const auto describe = reinterpret_cast<::xla::ffi::Error (*)(const Violation&)>(in->describe);
  in->violation.check = 0;
  return describe(violation);
}

inline ::xla::ffi::Error DebugCheckFailure(std::string_view op, std::string_view what) {
  return ::xla::ffi::Error::Internal(std::string(op) + ": XLA_EXT_DEBUG_CHECKS: " +
                                     std::string(what) + ": " +
                                     cudaGetErrorString(cudaGetLastError()));
}

// Runs `checks` on the device before the op's own launches (see the top of this file). Returns
// the op's error for the first violation, or for one that a replayed graph recorded earlier.
template <typename Checks>
::xla::ffi::Error DebugCheck(std::string_view op, cudaStream_t stream, const Checks& checks) {
  DebugRecords* records = CurrentDebugRecords();
  if (records == nullptr) {
    return ::xla::ffi::Error::Internal(std::string(op) +
                                       ": XLA_EXT_DEBUG_CHECKS: no pinned host memory for the "
                                       "check results on the current device");
  }
  const uintptr_t describe = reinterpret_cast<uintptr_t>(&Checks::Describe);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    return DebugCheckFailure(op, "cannot tell whether the stream is being captured");
  }
  if (capture != cudaStreamCaptureStatusNone) {
    FirstViolationKernel<Checks>
        <<<1, kDebugCheckThreads, 0, stream>>>(checks, records->captured, describe);
    return LastLaunchError(op);
  }
  std::lock_guard<std::mutex> lock(records->mu);
  FirstViolationKernel<Checks><<<1, kDebugCheckThreads, 0, stream>>>(checks, records->direct,
                                                                       describe);
  XLA_EXT_RETURN_IF_ERROR(LastLaunchError(op));
  if (cudaStreamSynchronize(stream) != cudaSuccess) {
    return DebugCheckFailure(op, "synchronising the stream after the checks");
  }
  // A replay's violation happened before this call: it comes first.
  if (std::optional<::xla::ffi::Error> replayed = TakeViolation(records->captured)) {
    TakeViolation(records->direct);
    return ::xla::ffi::Error(*replayed->errc(),
                             replayed->message() +
                                 " (found when a CUDA graph replayed a captured call; reported "
                                 "at the next call not captured, this call of " +
                                 std::string(op) + ")");
  }
  if (std::optional<::xla::ffi::Error> found = TakeViolation(records->direct)) return *found;
  return ::xla::ffi::Error::Success();
}

}  // namespace xla_ext::cuda

#endif  // XLA_EXT_KERNELS_COMMON_DEBUG_CHECKS_CUH_
