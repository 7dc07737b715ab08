// Checks of the data a handler reads as indices (block ids, lengths, slots), written once for
// both platforms. An op's checks are a value type (a "Checks") with
//
//   int64_t num_entries() const;             // how many checks, in the order Host runs them
//   Violation Check(int64_t entry) const;    // entry's verdict (check 0: none); host and device
//   static ffi::Error Describe(const Violation&);   // the message, from the violation alone
//
// The Host handler runs the entries in order and returns the first violation (FirstViolation
// below). The CUDA handlers, when XLA_EXT_DEBUG_CHECKS is on, run the same entries on the
// device and find the same first violation (debug_checks.cuh), so both platforms reject the
// same calls with the same message. A violation carries every number its message needs (the
// bounds too), because a call recorded into a CUDA graph reports it at a later call.
#ifndef XLA_EXT_KERNELS_COMMON_DATA_CHECKS_H_
#define XLA_EXT_KERNELS_COMMON_DATA_CHECKS_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "kernels/common/errors.h"

#ifdef __CUDACC__
#define XLA_EXT_HOST_DEVICE __host__ __device__
#else
#define XLA_EXT_HOST_DEVICE
#endif

namespace xla_ext {

struct Violation {
  int32_t check = 0;       // which check of the op failed; 0: none
  int64_t values[6] = {};  // what Describe() needs: indices, the values read, the bounds
};

// Host: the first entry in order that fails, as the op's error.
template <typename Checks>
ffi::Error FirstViolation(const Checks& checks) {
  for (int64_t entry = 0, n = checks.num_entries(); entry < n; ++entry) {
    const Violation violation = checks.Check(entry);
    if (violation.check != 0) return Checks::Describe(violation);
  }
  return ffi::Error::Success();
}

inline std::string Entry(std::string_view array, int64_t index, int64_t value) {
  return std::string(array) + "[" + std::to_string(index) + "] = " + std::to_string(value);
}

// A slot per token (`Slot`: int32_t or int64_t): below num_slots, or negative to skip the
// token. Shared by reshape_and_cache and kv_cache_update; Names::kOp and Names::kNumSlots
// (what the number of slots is, e.g. "num_blocks * block_size") name them in the message.
template <typename Slot, typename Names>
struct SlotChecks {
  static constexpr int32_t kSlotBeyondCache = 1;

  const Slot* slot_mapping;
  int64_t num_tokens;
  int64_t num_slots;

  XLA_EXT_HOST_DEVICE int64_t num_entries() const { return num_tokens; }

  XLA_EXT_HOST_DEVICE Violation Check(int64_t token) const {
    const int64_t slot = slot_mapping[token];
    if (slot < num_slots) return Violation{};
    return Violation{kSlotBeyondCache, {token, slot, num_slots}};
  }

  static ffi::Error Describe(const Violation& v) {
    return ArgumentError(Names::kOp, "slot_mapping",
                         std::string("slots < ") + Names::kNumSlots + " = " +
                             std::to_string(v.values[2]) + " (negative to skip)",
                         Entry("slot_mapping", v.values[0], v.values[1]));
  }
};

}  // namespace xla_ext

#endif  // XLA_EXT_KERNELS_COMMON_DATA_CHECKS_H_
