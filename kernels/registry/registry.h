// The static handler table of a kernel library (its C ABI: kernel_table.h).
//
// XLA_FFI_REGISTER_HANDLER needs the runtime's XLA_FFI_Api* at load time, and no runtime that
// loads our library exports one. So each handler is added here to a table instead, beside its
// definition, and the library exports one C function returning that table. torch_xla_ext's
// binders push the table into every XLA runtime of the process (torch_xla, PJRT plugins, JAX).
//
// Use from a kernel library (ours, or a user's built outside this tree):
//
//   #include "xla_ext/registry.h"
//   XLA_FFI_DEFINE_HANDLER(kMyAddHost, MyAddHost, ffi::Ffi::Bind()...);
//   XLA_EXT_REGISTER_KERNEL("my_add", "Host", kMyAddHost, XLA_EXT_NO_TRAITS);
//
// and, optionally, the op's contract (kernel_table.h: its supported values, its workspace
// query, its shape check): XLA_EXT_REGISTER_CONTRACT(XlaExtContract{0, "my_add", 1, kSupported,
// nullptr, MyAddCheck}); or, for a target whose contract is only its check,
// XLA_EXT_REGISTER_CHECK("my_add", MyAddCheck). The front ends run the check at the call; the
// handler may call it too, so that both accept the same calls.
//
// then `torch_xla_ext.load_kernels("libmy_kernels.so")`. XLA_EXT_REGISTER_KERNEL puts the
// handler behind DeferringHandler (below), which a call reaches unchanged unless it asks to
// defer a failure.
#ifndef XLA_EXT_REGISTRY_H_
#define XLA_EXT_REGISTRY_H_

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#ifdef __CUDACC__
#include <cuda_runtime_api.h>
#endif

#include "xla_ext/kernel_table.h"

namespace xla_ext::registry {

// One registry per shared object: hidden, so that two kernel libraries in one process never
// share (or interpose) each other's tables.
struct __attribute__((visibility("hidden"))) Registry {
  std::vector<XlaExtKernel> kernels;
  std::vector<XlaExtContract> contracts;
  std::string error;
  XlaExtKernelTable table{};

  static Registry& Get() {
    static Registry registry;
    return registry;
  }

  bool Add(const char* target, const char* platform, XLA_FFI_Handler* handler,
           uint32_t traits) {
    for (const XlaExtKernel& k : kernels) {
      if (std::strcmp(k.target, target) == 0 && std::strcmp(k.platform, platform) == 0) {
        if (error.empty()) {
          error = std::string("duplicate registration of target '") + target +
                  "' for platform '" + platform + "'";
        }
        return false;
      }
    }
    kernels.push_back(XlaExtKernel{sizeof(XlaExtKernel), target, platform, handler, traits});
    return true;
  }

  bool AddContract(const XlaExtContract& contract) {
    if (Contract(contract.target) != nullptr) {
      if (error.empty()) {
        error = std::string("duplicate contract of target '") + contract.target + "'";
      }
      return false;
    }
    contracts.push_back(contract);
    contracts.back().struct_size = sizeof(XlaExtContract);
    return true;
  }

  const XlaExtContract* Contract(const char* target) const {
    for (const XlaExtContract& c : contracts) {
      if (std::strcmp(c.target, target) == 0) return &c;
    }
    return nullptr;
  }

  const XlaExtKernelTable* Table() {
    table.struct_size = sizeof(XlaExtKernelTable);
    table.kernel_struct_size = sizeof(XlaExtKernel);
    table.ffi_api_major = XLA_FFI_API_MAJOR;
    table.ffi_api_minor = XLA_FFI_API_MINOR;
    table.num_kernels = static_cast<uint32_t>(kernels.size());
    table.kernels = kernels.data();
    table.error = error.empty() ? nullptr : error.c_str();
    table.contract_struct_size = sizeof(XlaExtContract);
    table.num_contracts = static_cast<uint32_t>(contracts.size());
    table.contracts = contracts.data();
    return &table;
  }
};

}  // namespace xla_ext::registry

// --- A call's failure, deferred ---------------------------------------------------------------
//
// Why. A call that fails makes XLA fail its whole execution, and the runtime then drops every
// buffer the execution was given to update in place: a KV cache written by a step whose
// metadata was bad is lost, though the handler refused the data before writing anything. A
// caller that can raise the failure later itself (torch_xla_ext's torch_xla front end) asks
// for the failure to be deferred instead, with the attribute
//
//   xla_ext_defer_failure = array<i64: o_0, o_1, ...>
//
// o_i: the operand that result i updates in place, or -1. Such a call, when its handler
// fails, or when it comes while an earlier failure is still held:
// - leaves each in-place result as its operand was (copying it where XLA gave the result a
//   buffer of its own), so the caches keep their values from before the call;
// - fills its other results with 0xFF bytes (NaN, or -1): they are garbage, and the caller
//   declares them dead;
// - records the failure for xla_ext_take_deferred_failure() and returns success.
// The handler itself never sees the attribute. A call without it runs as before.
//
// While a failure is held, a deferring call skips its handler and leaves its results as a
// failed call does: so the calls after a failed one in the same execution (the next layers of
// a step) write nothing either.
namespace xla_ext::registry {

inline constexpr char kDeferFailureAttr[] = "xla_ext_defer_failure";

// The failures deferred by this shared object's calls since the last take.
struct __attribute__((visibility("hidden"))) DeferredFailures {
  std::mutex mu;
  std::string first;  // the first one's message
  uint64_t calls = 0;  // calls that failed or were skipped
  std::atomic<bool> held{false};

  static DeferredFailures& Get() {
    static DeferredFailures failures;
    return failures;
  }

  void Record(std::string message) {
    std::lock_guard<std::mutex> lock(mu);
    if (calls++ == 0) first = std::move(message);
    held.store(true, std::memory_order_release);
  }

  // Counts a call that skips its handler because a failure is held, and says whether one is.
  // The check and the count are one step under the lock: a take between them would otherwise
  // leave the skipped call to record a new failure without a message.
  bool CountSkipIfHeld() {
    if (!held.load(std::memory_order_acquire)) return false;
    std::lock_guard<std::mutex> lock(mu);
    if (calls == 0) return false;
    ++calls;
    return true;
  }

  uint64_t Take(char* message, size_t size) {
    std::lock_guard<std::mutex> lock(mu);
    const uint64_t taken = calls;
    if (taken > 0 && size > 0) std::snprintf(message, size, "%s", first.c_str());
    calls = 0;
    first.clear();
    held.store(false, std::memory_order_release);
    return taken;
  }
};

constexpr bool IsCudaPlatform(std::string_view platform) { return platform == "CUDA"; }

// 0 for a dtype whose buffers are not whole bytes per element (not ffi::ByteWidth, which
// counts the sub-byte types as one byte each): such a call fails instead of deferring.
inline size_t ByteWidth(XLA_FFI_DataType dtype) {
  switch (dtype) {
    case XLA_FFI_DataType_PRED: case XLA_FFI_DataType_S8: case XLA_FFI_DataType_U8:
    case XLA_FFI_DataType_F8E4M3FN: case XLA_FFI_DataType_F8E5M2:
      return 1;
    case XLA_FFI_DataType_S16: case XLA_FFI_DataType_U16: case XLA_FFI_DataType_F16:
    case XLA_FFI_DataType_BF16:
      return 2;
    case XLA_FFI_DataType_S32: case XLA_FFI_DataType_U32: case XLA_FFI_DataType_F32:
      return 4;
    case XLA_FFI_DataType_S64: case XLA_FFI_DataType_U64: case XLA_FFI_DataType_F64:
    case XLA_FFI_DataType_C64:
      return 8;
    case XLA_FFI_DataType_C128:
      return 16;
    default:
      return 0;
  }
}

inline size_t SizeBytes(const XLA_FFI_Buffer& buffer) {
  size_t bytes = ByteWidth(buffer.dtype);
  for (int64_t i = 0; i < buffer.rank; ++i) bytes *= static_cast<size_t>(buffer.dims[i]);
  return bytes;
}

// Where each result of a deferring call comes from: an operand's buffer, or none (-1).
struct InPlaceOperands {
  const int64_t* operand = nullptr;
  size_t size = 0;
  int64_t Of(int64_t result) const {
    return static_cast<size_t>(result) < size ? operand[result] : -1;
  }
};

// The index of the deferring attribute among the frame's attributes, or -1; and its value.
inline int64_t FindDeferAttr(const XLA_FFI_Attrs& attrs, InPlaceOperands* in_place) {
  const size_t length = sizeof(kDeferFailureAttr) - 1;
  for (int64_t i = 0; i < attrs.size; ++i) {
    const XLA_FFI_ByteSpan* name = attrs.names[i];
    if (name->len != length || std::memcmp(name->ptr, kDeferFailureAttr, length) != 0) continue;
    if (attrs.types[i] != XLA_FFI_AttrType_ARRAY) return -1;
    const auto* array = static_cast<const XLA_FFI_Array*>(attrs.attrs[i]);
    if (array->dtype != XLA_FFI_DataType_S64) return -1;
    *in_place = InPlaceOperands{static_cast<const int64_t*>(array->data), array->size};
    return i;
  }
  return -1;
}

// Whether the results can be left as a failed call leaves them (see the top): buffers of
// known widths, in-place operands that are buffers of the same size.
inline bool CanLeaveResults(const XLA_FFI_CallFrame& frame, const InPlaceOperands& in_place) {
  for (int64_t i = 0; i < frame.rets.size; ++i) {
    if (frame.rets.types[i] != XLA_FFI_RetType_BUFFER) return false;
    const auto* result = static_cast<const XLA_FFI_Buffer*>(frame.rets.rets[i]);
    if (ByteWidth(result->dtype) == 0) return false;
    const int64_t operand = in_place.Of(i);
    if (operand < 0) continue;
    if (operand >= frame.args.size || frame.args.types[operand] != XLA_FFI_ArgType_BUFFER ||
        SizeBytes(*static_cast<const XLA_FFI_Buffer*>(frame.args.args[operand])) !=
            SizeBytes(*result)) {
      return false;
    }
  }
  return true;
}

inline std::string TakeErrorMessage(const XLA_FFI_Api* api, XLA_FFI_Error* error) {
  XLA_FFI_Error_GetMessage_Args message{XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE, nullptr,
                                        error, nullptr};
  api->XLA_FFI_Error_GetMessage(&message);
  std::string text = message.message != nullptr ? message.message : "";
  XLA_FFI_Error_Destroy_Args destroy{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr, error};
  api->XLA_FFI_Error_Destroy(&destroy);
  return text;
}

// The stream of a CUDA call that may defer its failure (into `stream`): false where it cannot
// (this file built without nvcc, or a call captured into a CUDA graph, whose replays would
// repeat what the capture did, a skip included: it fails as it would without the attribute).
template <bool kOnCuda>
bool CanDefer(const XLA_FFI_CallFrame& frame, void** stream) {
  if constexpr (kOnCuda) {
#ifdef __CUDACC__
    XLA_FFI_Stream_Get_Args args{XLA_FFI_Stream_Get_Args_STRUCT_SIZE, nullptr, frame.ctx,
                                 nullptr};
    if (XLA_FFI_Error* error = frame.api->XLA_FFI_Stream_Get(&args)) {
      TakeErrorMessage(frame.api, error);
      return false;
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(static_cast<cudaStream_t>(args.stream), &capture) !=
        cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    *stream = args.stream;
    return capture == cudaStreamCaptureStatusNone;
#else
    (void)frame;
    (void)stream;
    return false;
#endif
  }
  return true;
}

// Leaves the results as a failed call does (see the top): in-place ones as their operands,
// the others 0xFF bytes; on `stream` for CUDA.
template <bool kOnCuda>
bool LeaveResults(const XLA_FFI_CallFrame& frame, const InPlaceOperands& in_place,
                  void* stream) {
  for (int64_t i = 0; i < frame.rets.size; ++i) {
    auto* result = static_cast<XLA_FFI_Buffer*>(frame.rets.rets[i]);
    const size_t bytes = SizeBytes(*result);
    const int64_t operand = in_place.Of(i);
    const void* source =
        operand >= 0 ? static_cast<const XLA_FFI_Buffer*>(frame.args.args[operand])->data
                     : nullptr;
    if (bytes == 0 || source == result->data) continue;
    if constexpr (kOnCuda) {
#ifdef __CUDACC__
      const cudaError_t status =
          source != nullptr
              ? cudaMemcpyAsync(result->data, source, bytes, cudaMemcpyDeviceToDevice,
                                static_cast<cudaStream_t>(stream))
              : cudaMemsetAsync(result->data, 0xFF, bytes, static_cast<cudaStream_t>(stream));
      if (status != cudaSuccess) return false;
#endif
    } else if (source != nullptr) {
      std::memcpy(result->data, source, bytes);
    } else {
      std::memset(result->data, 0xFF, bytes);
    }
  }
  (void)stream;
  return true;
}

// What XLA_EXT_REGISTER_KERNEL registers for HANDLER (see the top of this part).
template <XLA_FFI_Handler* kHandler, bool kOnCuda>
XLA_FFI_Error* DeferringHandler(XLA_FFI_CallFrame* frame) {
  InPlaceOperands in_place;
  const int64_t at = FindDeferAttr(frame->attrs, &in_place);
  if (at < 0) return kHandler(frame);
  // The handler's frame: the attribute taken out (the others stay sorted by name).
  constexpr int64_t kMaxAttrs = 64;
  const int64_t num_attrs = frame->attrs.size - 1;
  if (num_attrs > kMaxAttrs) return kHandler(frame);  // the handler refuses the extra one
  XLA_FFI_AttrType types[kMaxAttrs];
  XLA_FFI_ByteSpan* names[kMaxAttrs];
  void* values[kMaxAttrs];
  for (int64_t i = 0, j = 0; i <= num_attrs; ++i) {
    if (i == at) continue;
    types[j] = frame->attrs.types[i];
    names[j] = frame->attrs.names[i];
    values[j++] = frame->attrs.attrs[i];
  }
  XLA_FFI_CallFrame own = *frame;
  own.attrs.size = num_attrs;
  own.attrs.types = types;
  own.attrs.names = names;
  own.attrs.attrs = values;
  void* stream = nullptr;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE || !CanLeaveResults(*frame, in_place) ||
      !CanDefer<kOnCuda>(*frame, &stream)) {
    return kHandler(&own);
  }
  DeferredFailures& failures = DeferredFailures::Get();
  std::string message;
  const bool skipped = failures.CountSkipIfHeld();
  if (!skipped) {
    XLA_FFI_Error* error = kHandler(&own);
    if (error == nullptr) return nullptr;
    message = TakeErrorMessage(frame->api, error);
  }
  if (!LeaveResults<kOnCuda>(*frame, in_place, stream)) {
    if (skipped) message = "a call skipped after an earlier failure";
    message += " (and leaving the call's results as a failed call does failed too)";
    XLA_FFI_Error_Create_Args create{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr,
                                     message.c_str(), XLA_FFI_Error_Code_INTERNAL};
    return frame->api->XLA_FFI_Error_Create(&create);
  }
  if (!skipped) failures.Record(std::move(message));
  return nullptr;
}

}  // namespace xla_ext::registry

// Takes the failures this shared object's calls deferred since the last take: the number of
// calls that failed or were skipped (0: none), and the first failure's message into
// `message` (`size` bytes, NUL-terminated).
extern "C" __attribute__((weak, visibility("default"))) uint64_t xla_ext_take_deferred_failure(
    char* message, size_t size) {
  return ::xla_ext::registry::DeferredFailures::Get().Take(message, size);
}

// Weak, so that every translation unit including this header may define it and the linker
// keeps one per shared object.
extern "C" __attribute__((weak, visibility("default"))) const XlaExtKernelTable*
xla_ext_kernel_table(void) {
  return ::xla_ext::registry::Registry::Get().Table();
}

// The generic workspace query of this shared object (kernel_table.h), weak as the table is.
extern "C" __attribute__((weak, visibility("default"))) int64_t xla_ext_workspace_bytes(
    const char* target, int device, const XlaExtCallShape* call) {
  const XlaExtContract* contract = ::xla_ext::registry::Registry::Get().Contract(target);
  if (contract == nullptr || contract->workspace_bytes == nullptr) return -1;
  return contract->workspace_bytes(device, call);
}

// An op's contract (an XlaExtContract; its struct_size is filled in), once per target.
#define XLA_EXT_REGISTER_CONTRACT(...) XLA_EXT_REGISTER_CONTRACT_(__COUNTER__, __VA_ARGS__)
#define XLA_EXT_REGISTER_CONTRACT_(N, ...) XLA_EXT_REGISTER_CONTRACT__(N, __VA_ARGS__)
#define XLA_EXT_REGISTER_CONTRACT__(N, ...)                                      \
  __attribute__((unused)) static const bool xla_ext_contract_registered_##N##_ = \
      ::xla_ext::registry::Registry::Get().AddContract(__VA_ARGS__)

// A target's shape check (an XlaExtCheckFn), as a contract that declares nothing else. A
// target with supported values or a workspace query gives its check in its one contract.
#define XLA_EXT_REGISTER_CHECK(TARGET, CHECK) \
  XLA_EXT_REGISTER_CONTRACT(XlaExtContract{0, TARGET, 0, nullptr, nullptr, CHECK})

#define XLA_EXT_REGISTER_KERNEL(TARGET, PLATFORM, HANDLER, TRAITS) \
  XLA_EXT_REGISTER_KERNEL_(TARGET, PLATFORM, HANDLER, TRAITS, __COUNTER__)
#define XLA_EXT_REGISTER_KERNEL_(TARGET, PLATFORM, HANDLER, TRAITS, N) \
  XLA_EXT_REGISTER_KERNEL__(TARGET, PLATFORM, HANDLER, TRAITS, N)
#ifdef XLA_EXT_REGISTER_WITH_XLA_FFI_API
// Linked into torch_xla's _XLAC by patches/ (XLA in-process): also register directly with
// XLA's own FFI registry, as XLA_FFI_REGISTER_HANDLER does.
#include "xla/ffi/api/api.h"
#define XLA_EXT_REGISTER_KERNEL__(TARGET, PLATFORM, HANDLER, TRAITS, N)          \
  XLA_EXT_ADD_TO_TABLE_(TARGET, PLATFORM, HANDLER, TRAITS, N);                  \
  XLA_FFI_REGISTER_HANDLER(XLA_FFI_GetApi(), TARGET, PLATFORM, HANDLER,         \
                           static_cast<XLA_FFI_Handler_Traits>(TRAITS))
#else
#define XLA_EXT_REGISTER_KERNEL__(TARGET, PLATFORM, HANDLER, TRAITS, N) \
  XLA_EXT_ADD_TO_TABLE_(TARGET, PLATFORM, HANDLER, TRAITS, N)
#endif
#define XLA_EXT_ADD_TO_TABLE_(TARGET, PLATFORM, HANDLER, TRAITS, N)                   \
  __attribute__((unused)) static const bool xla_ext_kernel_registered_##N##_ =      \
      ::xla_ext::registry::Registry::Get().Add(                                     \
          TARGET, PLATFORM,                                                          \
          ::xla_ext::registry::DeferringHandler<                                     \
              HANDLER, ::xla_ext::registry::IsCudaPlatform(PLATFORM)>,                \
          TRAITS)

#endif  // XLA_EXT_REGISTRY_H_
