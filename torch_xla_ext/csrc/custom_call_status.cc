// The two functions a legacy custom-call function (api_version 2 or 3) calls to report its
// outcome: XlaCustomCallStatusSetSuccess and XlaCustomCallStatusSetFailure, declared by XLA's
// xla/service/custom_call_status.h. Users' kernels leave them undefined and expect the process
// to have them, but neither runtime of torch_xla exports them: torch_xla's `_XLAC` and the CUDA
// PJRT plugin keep their own copies local. This library is loaded with RTLD_GLOBAL, so that a
// user's library (loaded after `import torch_xla_ext`, which happens at `import torch_xla`
// once the wheel is installed) resolves them here.
//
// XlaCustomCallStatus_ is XLA's `struct { std::optional<std::string> message; }`: the string
// (pointer, size, inline buffer) in bytes 0-31, the engaged flag at byte 32. That is the layout
// xla::CustomCallStatusGetMessage reads in both torch_xla 2.9's `_XLAC` and jax-cuda13-pjrt
// 0.7.2's plugin (checked by disassembly), and both use the system libstdc++ with the C++11
// string ABI and its allocator, as this library does, so a message written here is read and
// freed there.
#include <cstring>
#include <optional>
#include <string>

struct XlaCustomCallStatus_ {
  std::optional<std::string> message;
};
static_assert(sizeof(XlaCustomCallStatus_) == 40, "XLA's status is 40 bytes on x86-64");

extern "C" {

__attribute__((visibility("default"))) void XlaCustomCallStatusSetSuccess(
    XlaCustomCallStatus_* status) {
  status->message.reset();
}

// As XLA's: the message ends at its first NUL or after message_len bytes.
__attribute__((visibility("default"))) void XlaCustomCallStatusSetFailure(
    XlaCustomCallStatus_* status, const char* message, size_t message_len) {
  status->message.emplace(message == nullptr ? "" : message,
                          message == nullptr ? 0 : strnlen(message, message_len));
}

}  // extern "C"
