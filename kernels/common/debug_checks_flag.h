// Whether XLA_EXT_DEBUG_CHECKS turns on the CUDA handlers' debug mode (debug_checks.cuh): set
// to anything but "" or "0"; read once per process. The binder reads it too: in debug mode it
// registers no handler as command-buffer compatible, so that XLA launches every call as it
// comes, each call synchronises, and a violation is reported by the call that read it.
#ifndef XLA_EXT_KERNELS_COMMON_DEBUG_CHECKS_FLAG_H_
#define XLA_EXT_KERNELS_COMMON_DEBUG_CHECKS_FLAG_H_

#include <cstdlib>
#include <cstring>

namespace xla_ext::cuda {

inline bool DebugChecksEnabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("XLA_EXT_DEBUG_CHECKS");
    return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

}  // namespace xla_ext::cuda

#endif  // XLA_EXT_KERNELS_COMMON_DEBUG_CHECKS_FLAG_H_
