// Registers a kernel library's static table into an XLA runtime: one reached through its
// XLA_FFI_Api (torch_xla's in-process XLA) or one behind a PJRT plugin's FFI extension.
// Every check runs before the first registration, so a refused table registers nothing.
//
// Also registers one function under one target, as a user's `_xla_register_custom_call_target`
// asks: a typed FFI handler through the same two routes, or a legacy custom-call function
// (api_version 1-3) into XLA's CustomCallTargetRegistry, reached inside torch_xla's `_XLAC`
// through the registry's own functions (found by symbol) or, behind a PJRT plugin, through its
// GPU custom-call extension.
#include <cstdio>
#include <cstring>
#include <string>

#include "kernels/common/debug_checks_flag.h"
#include "torch_xla_ext/csrc/pjrt_ffi_extension.h"
#include "xla/ffi/api/c_api.h"

#include "xla_ext/kernel_table.h"

namespace {

int Fail(char* err, size_t err_size, const std::string& message) {
  if (err_size > 0) std::snprintf(err, err_size, "%s", message.c_str());
  return -1;
}

std::string Version(int major, int minor) {
  return std::to_string(major) + "." + std::to_string(minor);
}

bool Selected(const XlaExtKernel& kernel, const char* platform) {
  return platform == nullptr || std::strcmp(kernel.platform, platform) == 0;
}

// The traits a kernel is registered with: none in debug mode, where every call must
// synchronise and report its own violation (so XLA may not record it into a command buffer).
uint32_t Traits(const XlaExtKernel& kernel) {
  return xla_ext::cuda::DebugChecksEnabled() ? 0 : kernel.traits;
}

// The table's i-th kernel: `kernels` has the library's own stride.
const XlaExtKernel& KernelAt(const XlaExtKernelTable* table, uint32_t i) {
  return *reinterpret_cast<const XlaExtKernel*>(
      reinterpret_cast<const char*>(table->kernels) + i * table->kernel_struct_size);
}

// The table's i-th contract: `contracts` has the library's own stride.
const XlaExtContract& ContractAt(const XlaExtKernelTable* table, uint32_t i) {
  return *reinterpret_cast<const XlaExtContract*>(
      reinterpret_cast<const char*>(table->contracts) + i * table->contract_struct_size);
}

// The table is large enough to read (built against this or a later kernel_table.h).
int CheckLayout(const XlaExtKernelTable* table, char* err, size_t err_size) {
  if (table == nullptr) return Fail(err, err_size, "the kernel table is null");
  if (table->struct_size < XLA_EXT_KERNEL_TABLE_STRUCT_SIZE_V1 ||
      table->kernel_struct_size < XLA_EXT_KERNEL_STRUCT_SIZE_V1) {
    return Fail(err, err_size,
                "the kernel table (" + std::to_string(table->struct_size) +
                    " bytes) was built against an older xla_ext/kernel_table.h; rebuild the "
                    "library against this torch_xla_ext's headers (torch_xla_ext.get_include())");
  }
  return 0;
}

// Checks shared by every runtime: the table itself, and its handlers' FFI version against
// the runtime's (same major, minor no newer than the runtime's).
int CheckTable(const XlaExtKernelTable* table, int runtime_major, int runtime_minor, char* err,
               size_t err_size) {
  if (CheckLayout(table, err, err_size) != 0) return -1;
  if (table->error != nullptr) {
    return Fail(err, err_size, std::string("the kernel library refused a registration: ") +
                                   table->error);
  }
  if (table->ffi_api_major != runtime_major || table->ffi_api_minor > runtime_minor) {
    return Fail(err, err_size,
                "the handlers were built against XLA FFI API " +
                    Version(table->ffi_api_major, table->ffi_api_minor) +
                    " but this runtime speaks " + Version(runtime_major, runtime_minor) +
                    "; build them against the FFI headers of jaxlib==0.7.1 (FFI 0.1)");
  }
  return 0;
}

// Registers one typed FFI handler through an XLA_FFI_Api; false with XLA's message in `text`.
bool RegisterFfiHandler(const XLA_FFI_Api* api, const char* target, const char* platform,
                        XLA_FFI_Handler* handler, uint32_t traits, std::string* text) {
  XLA_FFI_Handler_Register_Args args;
  args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
  args.extension_start = nullptr;
  args.name = XLA_FFI_ByteSpan{target, std::strlen(target)};
  args.platform = XLA_FFI_ByteSpan{platform, std::strlen(platform)};
  args.bundle = XLA_FFI_Handler_Bundle{nullptr, nullptr, nullptr, handler};
  args.traits = traits;
  XLA_FFI_Error* error = api->XLA_FFI_Handler_Register(&args);
  if (error == nullptr) return true;
  XLA_FFI_Error_GetMessage_Args message;
  message.struct_size = XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE;
  message.extension_start = nullptr;
  message.error = error;
  api->XLA_FFI_Error_GetMessage(&message);
  *text = message.message;
  XLA_FFI_Error_Destroy_Args destroy;
  destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  destroy.extension_start = nullptr;
  destroy.error = error;
  api->XLA_FFI_Error_Destroy(&destroy);
  return false;
}

// A PJRT error's message; destroys the error.
std::string TakePjrtError(const PjrtApiPrefix* api, PjrtError* error) {
  PjrtErrorMessageArgs message{sizeof(PjrtErrorMessageArgs), nullptr, error, nullptr, 0};
  api->error_message(&message);
  std::string text(message.message, message.message_size);
  PjrtErrorDestroyArgs destroy{sizeof(PjrtErrorDestroyArgs), nullptr, error};
  api->error_destroy(&destroy);
  return text;
}

// The plugin's extension of `type`, or null with the reason in `problem` (also for a PJRT C
// API version whose argument structs we do not know).
const PjrtExtensionBase* FindPjrtExtension(const PjrtApiPrefix* api, int32_t type,
                                           const char* what, std::string* problem) {
  if (api == nullptr) {
    *problem = "the PJRT_Api pointer is null";
    return nullptr;
  }
  const int major = api->pjrt_api_version.major_version;
  const int minor = api->pjrt_api_version.minor_version;
  if (major != 0 || minor < 75) {
    *problem = "PJRT C API " + Version(major, minor) +
               " is not supported; supported are 0.75 and newer 0.x";
    return nullptr;
  }
  for (const PjrtExtensionBase* ext = api->extension_start; ext != nullptr; ext = ext->next) {
    if (ext->type == type) return ext;
  }
  *problem = "the PJRT plugin (API " + Version(major, minor) + ") has no " + what;
  return nullptr;
}

const PjrtFfiExtension* FindFfiExtension(const PjrtApiPrefix* api, std::string* problem) {
  const auto* ffi = reinterpret_cast<const PjrtFfiExtension*>(FindPjrtExtension(
      api, kPjrtExtensionTypeFfi, "FFI extension with register_handler", problem));
  if (ffi != nullptr && (ffi->base.struct_size < sizeof(PjrtFfiExtension) ||
                         ffi->register_handler == nullptr)) {
    *problem = "the PJRT plugin's FFI extension has no register_handler";
    return nullptr;
  }
  return ffi;
}

// Registers one typed FFI handler through a plugin's FFI extension; false with the plugin's
// message in `text`.
bool RegisterPjrtFfiHandler(const PjrtApiPrefix* api, const PjrtFfiExtension* ffi,
                            const char* target, const char* platform, XLA_FFI_Handler* handler,
                            uint32_t traits, std::string* text) {
  PjrtFfiRegisterHandlerArgs args;
  args.struct_size = sizeof(args);
  args.target_name = target;
  args.target_name_size = std::strlen(target);
  args.handler = reinterpret_cast<void*>(handler);
  args.platform_name = platform;
  args.platform_name_size = std::strlen(platform);
  args.traits = traits;
  PjrtError* error = ffi->register_handler(&args);
  if (error == nullptr) return true;
  *text = TakePjrtError(api, error);
  return false;
}

}  // namespace

extern "C" {

// Reads a table's header for torch_xla_ext._kernels (which so restates no struct layout):
// 0, or -1 with a message in `err` when the table cannot be read.
__attribute__((visibility("default"))) int xla_ext_table_header(
    const XlaExtKernelTable* table, int32_t* ffi_api_major, int32_t* ffi_api_minor,
    uint32_t* num_kernels, const char** error, char* err, size_t err_size) {
  if (CheckLayout(table, err, err_size) != 0) return -1;
  *ffi_api_major = table->ffi_api_major;
  *ffi_api_minor = table->ffi_api_minor;
  *num_kernels = table->num_kernels;
  *error = table->error;
  return 0;
}

// Reads kernel i (< num_kernels) of a table xla_ext_table_header accepted.
__attribute__((visibility("default"))) void xla_ext_table_kernel(
    const XlaExtKernelTable* table, uint32_t i, const char** target, const char** platform,
    void** handler, uint32_t* traits) {
  const XlaExtKernel& kernel = KernelAt(table, i);
  *target = kernel.target;
  *platform = kernel.platform;
  *handler = reinterpret_cast<void*>(kernel.handler);
  *traits = kernel.traits;
}

// The ops' contracts of a table xla_ext_table_header accepted: none where the library was
// built against a kernel_table.h before them (a smaller table or contract struct).
__attribute__((visibility("default"))) uint32_t xla_ext_table_num_contracts(
    const XlaExtKernelTable* table) {
  if (table->struct_size < XLA_EXT_KERNEL_TABLE_STRUCT_SIZE_V2 ||
      table->contract_struct_size < XLA_EXT_CONTRACT_STRUCT_SIZE_V1) {
    return 0;
  }
  return table->num_contracts;
}

// Reads contract i (< xla_ext_table_num_contracts): its target and its supported values
// (`num_supported` XlaExtSupportedValues).
__attribute__((visibility("default"))) void xla_ext_table_contract(
    const XlaExtKernelTable* table, uint32_t i, const char** target, uint32_t* num_supported,
    const XlaExtSupportedValues** supported) {
  const XlaExtContract& contract = ContractAt(table, i);
  *target = contract.target;
  *num_supported = contract.num_supported;
  *supported = contract.supported;
}

// The shape check of contract i (< xla_ext_table_num_contracts): NULL where it has none, or
// where the library was built before contracts held one (a version-1 contract struct).
__attribute__((visibility("default"))) XlaExtCheckFn xla_ext_table_contract_check(
    const XlaExtKernelTable* table, uint32_t i) {
  if (table->contract_struct_size < XLA_EXT_CONTRACT_STRUCT_SIZE_V2) return nullptr;
  return ContractAt(table, i).check;
}

// The struct size and version of a runtime's XLA_FFI_Api.
__attribute__((visibility("default"))) void xla_ext_ffi_api_version(
    const XLA_FFI_Api* api, size_t* struct_size, int32_t* major, int32_t* minor) {
  *struct_size = api->struct_size;
  *major = api->api_version.major_version;
  *minor = api->api_version.minor_version;
}

// The version of a PJRT plugin's C API (what its GetPjrtApi returned).
__attribute__((visibility("default"))) void xla_ext_pjrt_api_version(const void* pjrt_api,
                                                                     int32_t* major,
                                                                     int32_t* minor) {
  const auto* api = static_cast<const PjrtApiPrefix*>(pjrt_api);
  *major = api->pjrt_api_version.major_version;
  *minor = api->pjrt_api_version.minor_version;
}

// Returns the number of kernels registered, or -1 with a message in `err`.
// `platform` ("Host", "CUDA") selects kernels; null registers every one.
__attribute__((visibility("default"))) int xla_ext_bind_ffi_api(
    const XLA_FFI_Api* api, const XlaExtKernelTable* table, const char* platform, char* err,
    size_t err_size) {
  if (api == nullptr) return Fail(err, err_size, "the XLA_FFI_Api pointer is null");
  if (api->struct_size < XLA_FFI_Api_STRUCT_SIZE) {
    return Fail(err, err_size,
                "the runtime's XLA_FFI_Api is " + std::to_string(api->struct_size) +
                    " bytes, smaller than the " + std::to_string(XLA_FFI_Api_STRUCT_SIZE) +
                    " bytes of FFI API " + Version(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR));
  }
  if (CheckTable(table, api->api_version.major_version, api->api_version.minor_version, err,
                 err_size) != 0) {
    return -1;
  }
  int registered = 0;
  for (uint32_t i = 0; i < table->num_kernels; ++i) {
    const XlaExtKernel& kernel = KernelAt(table, i);
    if (!Selected(kernel, platform)) continue;
    std::string text;
    if (!RegisterFfiHandler(api, kernel.target, kernel.platform, kernel.handler,
                            Traits(kernel), &text)) {
      return Fail(err, err_size,
                  std::string("registering ") + kernel.target + " for " + kernel.platform +
                      " failed after " + std::to_string(registered) + " others: " + text);
    }
    ++registered;
  }
  return registered;
}

// Same, through a PJRT plugin's FFI extension (`pjrt_api` is what its GetPjrtApi returned).
// The plugin's XLA accepts FFI 0.1 handlers from PJRT 0.75 on.
__attribute__((visibility("default"))) int xla_ext_bind_pjrt_plugin(
    const void* pjrt_api, const XlaExtKernelTable* table, const char* platform, char* err,
    size_t err_size) {
  const auto* api = static_cast<const PjrtApiPrefix*>(pjrt_api);
  std::string problem;
  const PjrtFfiExtension* ffi = FindFfiExtension(api, &problem);
  if (ffi == nullptr) return Fail(err, err_size, problem);
  if (CheckTable(table, XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR, err, err_size) != 0) return -1;
  int registered = 0;
  for (uint32_t i = 0; i < table->num_kernels; ++i) {
    const XlaExtKernel& kernel = KernelAt(table, i);
    if (!Selected(kernel, platform)) continue;
    std::string text;
    if (!RegisterPjrtFfiHandler(api, ffi, kernel.target, kernel.platform, kernel.handler,
                                Traits(kernel), &text)) {
      return Fail(err, err_size,
                  std::string("registering ") + kernel.target + " for " + kernel.platform +
                      " in the PJRT plugin failed after " + std::to_string(registered) +
                      " others: " + text);
    }
    ++registered;
  }
  return registered;
}

// One typed FFI handler under `target` for `platform`, through an XLA_FFI_Api: 0, or -1 with
// XLA's message in `err` (a target already taken by another handler, for one).
__attribute__((visibility("default"))) int xla_ext_register_ffi_handler(
    const XLA_FFI_Api* api, const char* target, const char* platform, void* handler,
    uint32_t traits, char* err, size_t err_size) {
  std::string text;
  if (!RegisterFfiHandler(api, target, platform, reinterpret_cast<XLA_FFI_Handler*>(handler),
                          traits, &text)) {
    return Fail(err, err_size, text);
  }
  return 0;
}

// Same, through a PJRT plugin's FFI extension.
__attribute__((visibility("default"))) int xla_ext_pjrt_register_ffi_handler(
    const void* pjrt_api, const char* target, const char* platform, void* handler,
    uint32_t traits, char* err, size_t err_size) {
  const auto* api = static_cast<const PjrtApiPrefix*>(pjrt_api);
  std::string problem;
  const PjrtFfiExtension* ffi = FindFfiExtension(api, &problem);
  if (ffi == nullptr) return Fail(err, err_size, problem);
  if (!RegisterPjrtFfiHandler(api, ffi, target, platform,
                              reinterpret_cast<XLA_FFI_Handler*>(handler), traits, &problem)) {
    return Fail(err, err_size, problem);
  }
  return 0;
}

// A legacy custom-call function under `target` in a PJRT plugin's registry (platform "CUDA"),
// through its GPU custom-call extension. XLA ends the process when a target is registered
// twice with different functions: the caller (torch_xla_ext/binders) refuses that first.
__attribute__((visibility("default"))) int xla_ext_pjrt_register_legacy_target(
    const void* pjrt_api, const char* target, void* function, char* err, size_t err_size) {
  const auto* api = static_cast<const PjrtApiPrefix*>(pjrt_api);
  std::string problem;
  const auto* ext = reinterpret_cast<const PjrtGpuCustomCallExtension*>(FindPjrtExtension(
      api, kPjrtExtensionTypeGpuCustomCall, "GPU custom-call extension", &problem));
  if (ext == nullptr) return Fail(err, err_size, problem);
  if (ext->base.struct_size < sizeof(PjrtGpuCustomCallExtension) || ext->custom_call == nullptr) {
    return Fail(err, err_size, "the PJRT plugin's GPU custom-call extension has no custom_call");
  }
  PjrtGpuRegisterCustomCallArgs args{};
  args.struct_size = sizeof(args);
  args.function_name = target;
  args.function_name_size = std::strlen(target);
  args.api_version = 0;  // untyped: the legacy ABIs
  args.handler_execute = function;
  if (PjrtError* error = ext->custom_call(&args)) {
    return Fail(err, err_size, TakePjrtError(api, error));
  }
  return 0;
}

// XLA's CustomCallTargetRegistry inside a runtime that links XLA statically (torch_xla's
// `_XLAC`), driven through its own functions, whose addresses the caller found by symbol:
// `global` is xla::CustomCallTargetRegistry::Global(), `lookup` its Lookup(symbol, platform)
// and `reg` its Register(symbol, address, platform). Both take std::string, built here with
// the same C++ ABI (libstdc++, _GLIBCXX_USE_CXX11_ABI=1) as torch_xla's.
using RegistryGlobalFn = void* (*)();
using RegistryLookupFn = void* (*)(const void* self, const std::string& symbol,
                                   const std::string& platform);
using RegistryRegisterFn = void (*)(void* self, const std::string& symbol, void* address,
                                    const std::string& platform);

// The function registered under `target` for `platform`, or null.
__attribute__((visibility("default"))) void* xla_ext_registry_lookup(void* global, void* lookup,
                                                                    const char* target,
                                                                    const char* platform) {
  void* registry = reinterpret_cast<RegistryGlobalFn>(global)();
  return reinterpret_cast<RegistryLookupFn>(lookup)(registry, target, platform);
}

// Registers `function` under `target` for `platform`: 0, or -1 with a message in `err` when
// the target already has another function (XLA itself would end the process).
__attribute__((visibility("default"))) int xla_ext_registry_register(
    void* global, void* lookup, void* reg, const char* target, void* function,
    const char* platform, char* err, size_t err_size) {
  void* registry = reinterpret_cast<RegistryGlobalFn>(global)();
  void* existing = reinterpret_cast<RegistryLookupFn>(lookup)(registry, target, platform);
  if (existing == function) return 0;
  if (existing != nullptr) {
    char text[256];
    std::snprintf(text, sizeof(text), "%s already has another function (%p) for %s", target,
                  existing, platform);
    return Fail(err, err_size, text);
  }
  reinterpret_cast<RegistryRegisterFn>(reg)(registry, target, function, platform);
  return 0;
}

}  // extern "C"
