// A PJRT plugin that wraps another: torch_xla loads this library as its GPU plugin, and its
// GetPjrtApi() hands back the real plugin's PJRT_Api (path in $TORCH_XLA_EXT_PJRT_PLUGIN,
// set by torch_xla_ext/plugin.py) with one change: the platform name reads "gpu" instead of
// "cuda". torch_xla 2.9 aborts for any client whose platform name upper-cases to "CUDA"
// ("XLA:CUDA is not supported anymore"); under "gpu" its devices are GPU:0..n (a plugin
// device type). Every other entry, extension_start included, is the real plugin's, so the
// FFI extension that registers our handlers is reachable through the returned API.
//
// Only PJRT C API 0.75 (torch_xla 2.9's, jax-cuda12-pjrt==0.7.1's) is accepted: torch_xla's
// XLA would read the argument structs of any other version with its own 0.75 layout.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "torch_xla_ext/csrc/pjrt_ffi_extension.h"

namespace {

constexpr char kPluginPathVariable[] = "TORCH_XLA_EXT_PJRT_PLUGIN";
constexpr char kPresentedPlatformName[] = "gpu";
constexpr int kPjrtMajor = 0;
constexpr int kPjrtMinor = 75;

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

const unsigned char* real_api = nullptr;
unsigned char* wrapped_api = nullptr;  // the real PJRT_Api's bytes, two entries replaced
std::mutex wrap_mutex;

PlatformNameFn RealFunction(size_t offset) {
  PlatformNameFn fn;
  std::memcpy(&fn, real_api + offset, sizeof(fn));
  return fn;
}

// Asks the real plugin first, so its argument checks and errors stay as they are.
PjrtError* PresentPlatformName(size_t offset, PlatformNameArgs* args) {
  if (PjrtError* error = RealFunction(offset)(args)) return error;
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

void Replace(size_t offset, PlatformNameFn fn) {
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
             "jax-cuda12-pjrt 0.7.1's xla_cuda_plugin.so";
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
  if (major != kPjrtMajor || minor != kPjrtMinor) {
    *error = std::string(path) + " speaks PJRT C API " + std::to_string(major) + "." +
             std::to_string(minor) + ", but torch_xla 2.9 speaks " + std::to_string(kPjrtMajor) +
             "." + std::to_string(kPjrtMinor) +
             "; install the matching plugin: pip install 'torch_xla_ext[gpu]' "
             "(jax-cuda12-pjrt==0.7.1)";
    return nullptr;
  }
  if (api->struct_size < kTopologyPlatformNameOffset + sizeof(PlatformNameFn)) {
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
