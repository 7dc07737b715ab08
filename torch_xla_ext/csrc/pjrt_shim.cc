// A PJRT plugin that wraps another: torch_xla loads this library as its GPU plugin, and its
// GetPjrtApi() hands back the real plugin's PJRT_Api (path in $TORCH_XLA_EXT_PJRT_PLUGIN,
// set by torch_xla_ext/plugin.py) with one change: the platform name reads "gpu" instead of
// "cuda". torch_xla 2.9 aborts for any client whose platform name upper-cases to "CUDA"
// ("XLA:CUDA is not supported anymore"); under "gpu" its devices are GPU:0..n (a plugin
// device type). Every other entry, extension_start included, is the real plugin's, so the
// FFI extension that registers our handlers is reachable through the returned API.
//
// torch_xla 2.9's XLA speaks PJRT C API 0.75 and fills every argument struct in that layout.
// Two plugin versions are accepted:
// - 0.75 (jax-cuda12-pjrt==0.7.1's plugin, CUDA 12), passed through as it is;
// - 0.76 (jax-cuda13-pjrt==0.7.2's, CUDA 13), which differs in two structs a 0.75 caller
//   fills. PJRT_ExecuteOptions gained a last field, call_location (80 -> 88 bytes), and the
//   plugin refuses a smaller struct, so every execution would fail. PJRT_ProcessInfo gained a
//   leading struct_size (40 -> 48 bytes) that the plugin reads unchecked. The shim upgrades
//   both on their way in; every other struct and PJRT_Api itself (960 bytes) are the same.
// Any other version is refused: the plugin would read 0.75 structs with its own layout.
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "torch_xla_ext/csrc/pjrt_ffi_extension.h"

namespace {

constexpr char kPluginPathVariable[] = "TORCH_XLA_EXT_PJRT_PLUGIN";
constexpr char kPresentedPlatformName[] = "gpu";
constexpr int kPjrtMajor = 0;
constexpr int kCallerMinor = 75;           // torch_xla 2.9's
constexpr int kUpgradedPluginMinor = 76;  // accepted, with two structs upgraded
constexpr char kInstallHint[] =
    "install a matching plugin: pip install 'torch_xla_ext[gpu]' (jax-cuda12-pjrt==0.7.1, "
    "CUDA 12) or 'torch_xla_ext[gpu-cuda13]' (jax-cuda13-pjrt==0.7.2, CUDA 13)";

// PJRT_Client_PlatformName_Args and PJRT_TopologyDescription_PlatformName_Args share this
// layout: {struct_size, extension_start, client or topology, platform_name, its size}.
struct PlatformNameArgs {
  size_t struct_size;
  void* extension_start;
  void* client_or_topology;
  const char* platform_name;  // out
  size_t platform_name_size;  // out
};
using PlatformNameFn = PjrtError* (*)(PlatformNameArgs*);

// Byte offsets in PJRT_Api (append-only while the major version is 0): 40 bytes of
// struct_size, extension_start and PJRT_Api_Version, then one pointer per function in
// pjrt_c_api.h's order; PJRT_Client_PlatformName is the 13th, and
// PJRT_TopologyDescription_PlatformName the 85th. Checked against the symbols of
// jax-cuda12-pjrt 0.7.1's plugin, whose PJRT_Api (0.75) is 960 bytes.
constexpr size_t kClientPlatformNameOffset = 40 + 8 * 12;
constexpr size_t kTopologyPlatformNameOffset = 40 + 8 * 84;
// PJRT_LoadedExecutable_Execute (56th) and PJRT_Client_UpdateGlobalProcessInfo (114th), from
// the headers of XLA 92f7b59 (torch_xla 2.9's) and 0fccb8a (jax 0.7.2's).
constexpr size_t kExecuteOffset = 40 + 8 * 55;
constexpr size_t kUpdateGlobalProcessInfoOffset = 40 + 8 * 113;

// The prefixes of PJRT_LoadedExecutable_Execute_Args and
// PJRT_Client_UpdateGlobalProcessInfo_Args that hold the structs to upgrade.
struct ExecuteArgsPrefix {
  size_t struct_size;
  void* extension_start;
  void* executable;
  unsigned char* options;  // PJRT_ExecuteOptions*
};
struct UpdateGlobalProcessInfoArgs {
  size_t struct_size;
  void* extension_start;
  void* client;
  unsigned char* process_infos;  // PJRT_ProcessInfo[num_process_infos]
  size_t num_process_infos;
};
constexpr size_t kExecuteOptionsSize076 = 88;  // 0.75's 80 bytes, then call_location
constexpr size_t kProcessInfoSize075 = 40;
constexpr size_t kProcessInfoSize076 = 48;  // struct_size, then 0.75's 40 bytes
using ArgsFn = PjrtError* (*)(void*);

const unsigned char* real_api = nullptr;
unsigned char* wrapped_api = nullptr;  // the real PJRT_Api's bytes, two (0.76: four) entries replaced
std::mutex wrap_mutex;

template <typename Fn>
Fn Real(size_t offset) {
  Fn fn;
  std::memcpy(&fn, real_api + offset, sizeof(fn));
  return fn;
}

// Asks the real plugin first, so its argument checks and errors stay as they are.
PjrtError* PresentPlatformName(size_t offset, PlatformNameArgs* args) {
  if (PjrtError* error = Real<PlatformNameFn>(offset)(args)) return error;
  args->platform_name = kPresentedPlatformName;
  args->platform_name_size = sizeof(kPresentedPlatformName) - 1;
  return nullptr;
}

PjrtError* ClientPlatformName(PlatformNameArgs* args) {
  return PresentPlatformName(kClientPlatformNameOffset, args);
}

PjrtError* TopologyPlatformName(PlatformNameArgs* args) {
  return PresentPlatformName(kTopologyPlatformNameOffset, args);
}

// Runs the plugin's Execute with the caller's options copied into a 0.76 PJRT_ExecuteOptions
// (call_location null: none given), then gives the caller its own options pointer back.
PjrtError* ExecuteWithUpgradedOptions(void* raw_args) {
  auto* args = static_cast<ExecuteArgsPrefix*>(raw_args);
  const auto execute = Real<ArgsFn>(kExecuteOffset);
  size_t given = 0;
  if (args->options != nullptr) std::memcpy(&given, args->options, sizeof(given));
  if (args->options == nullptr || given >= kExecuteOptionsSize076) return execute(raw_args);
  alignas(8) unsigned char upgraded[kExecuteOptionsSize076] = {};
  std::memcpy(upgraded, args->options, std::min(given, kExecuteOptionsSize076));
  std::memcpy(upgraded, &kExecuteOptionsSize076, sizeof(size_t));
  unsigned char* const original = args->options;
  args->options = upgraded;
  PjrtError* error = execute(raw_args);
  args->options = original;
  return error;
}

// The caller's 0.75 PJRT_ProcessInfo entries, each given the leading struct_size of 0.76.
PjrtError* UpdateGlobalProcessInfoWithUpgradedInfos(void* raw_args) {
  auto* args = static_cast<UpdateGlobalProcessInfoArgs*>(raw_args);
  std::vector<unsigned char> upgraded(args->num_process_infos * kProcessInfoSize076);
  for (size_t i = 0; i < args->num_process_infos; ++i) {
    unsigned char* entry = upgraded.data() + i * kProcessInfoSize076;
    std::memcpy(entry, &kProcessInfoSize076, sizeof(size_t));
    std::memcpy(entry + sizeof(size_t), args->process_infos + i * kProcessInfoSize075,
                kProcessInfoSize075);
  }
  unsigned char* const original = args->process_infos;
  args->process_infos = upgraded.data();
  PjrtError* error = Real<ArgsFn>(kUpdateGlobalProcessInfoOffset)(raw_args);
  args->process_infos = original;
  return error;
}

template <typename Fn>
void Replace(size_t offset, Fn fn) {
  std::memcpy(wrapped_api + offset, &fn, sizeof(fn));
}

// Returns the wrapped PJRT_Api, loading the real plugin on the first success; or null with
// the reason in `error`.
const void* Wrap(std::string* error) {
  std::lock_guard<std::mutex> lock(wrap_mutex);
  if (wrapped_api != nullptr) return wrapped_api;
  const char* path = std::getenv(kPluginPathVariable);
  if (path == nullptr || *path == '\0') {
    *error = std::string("$") + kPluginPathVariable +
             " is not set; it names the PJRT plugin to wrap. torch_xla_ext.plugin sets it when "
             "PJRT_DEVICE=GPU selects this plugin; elsewhere set it to the path of "
             "jax-cuda12-pjrt 0.7.1's or jax-cuda13-pjrt 0.7.2's xla_cuda_plugin.so";
    return nullptr;
  }
  void* plugin = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (plugin == nullptr) {
    *error = std::string("cannot load the PJRT plugin ") + path + " ($" + kPluginPathVariable +
             "): " + dlerror();
    return nullptr;
  }
  auto get_api = reinterpret_cast<const void* (*)()>(dlsym(plugin, "GetPjrtApi"));
  const auto* api = get_api ? static_cast<const PjrtApiPrefix*>(get_api()) : nullptr;
  if (api == nullptr) {
    *error = std::string(path) + (get_api ? ": GetPjrtApi() returned null"
                                          : " exports no GetPjrtApi: it is not a PJRT plugin");
    return nullptr;
  }
  const int major = api->pjrt_api_version.major_version;
  const int minor = api->pjrt_api_version.minor_version;
  if (major != kPjrtMajor || (minor != kCallerMinor && minor != kUpgradedPluginMinor)) {
    *error = std::string(path) + " speaks PJRT C API " + std::to_string(major) + "." +
             std::to_string(minor) + ", but torch_xla 2.9 speaks " + std::to_string(kPjrtMajor) +
             "." + std::to_string(kCallerMinor) +
             " (0.76 is adapted to it); " + kInstallHint;
    return nullptr;
  }
  if (api->struct_size < kUpdateGlobalProcessInfoOffset + sizeof(ArgsFn)) {
    *error = std::string(path) + ": its PJRT_Api is " + std::to_string(api->struct_size) +
             " bytes, too small for PJRT C API 0.75 (960 bytes)";
    return nullptr;
  }
  real_api = reinterpret_cast<const unsigned char*>(api);
  // Never freed: torch_xla keeps the PJRT_Api for the life of the process, and so does
  // the dlopen of the real plugin.
  wrapped_api = static_cast<unsigned char*>(std::malloc(api->struct_size));
  std::memcpy(wrapped_api, real_api, api->struct_size);
  Replace(kClientPlatformNameOffset, ClientPlatformName);
  Replace(kTopologyPlatformNameOffset, TopologyPlatformName);
  if (minor == kUpgradedPluginMinor) {
    Replace(kExecuteOffset, ExecuteWithUpgradedOptions);
    Replace(kUpdateGlobalProcessInfoOffset, UpdateGlobalProcessInfoWithUpgradedInfos);
  }
  return wrapped_api;
}

}  // namespace

extern "C" {

// The PJRT plugin entry point. It cannot return an error, so a refusal is printed to
// stderr and null returned; torch_xla_ext.plugin calls xla_ext_pjrt_shim_load first and
// raises TorchXlaExtError with the same message.
__attribute__((visibility("default"))) const void* GetPjrtApi() {
  std::string error;
  const void* api = Wrap(&error);
  if (api == nullptr) std::fprintf(stderr, "torch_xla_ext PJRT shim: %s\n", error.c_str());
  return api;
}

// Same as GetPjrtApi, with the reason for a null result written to `err`.
__attribute__((visibility("default"))) const void* xla_ext_pjrt_shim_load(char* err,
                                                                          size_t err_size) {
  std::string error;
  const void* api = Wrap(&error);
  if (api == nullptr && err_size > 0) std::snprintf(err, err_size, "%s", error.c_str());
  return api;
}

}  // extern "C"
