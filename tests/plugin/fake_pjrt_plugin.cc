// A fake PJRT plugin for CPU-only tests of the PJRT shim: GetPjrtApi returns a PJRT_Api of
// version 0.FAKE_PJRT_MINOR and of the 0.75 size (960 bytes) whose platform names read "cuda",
// with an FFI extension (behind another extension) whose register_handler records its calls.
// Client creation always fails with a message that counts the registrations made before it,
// so torch_xla's own start-up shows whether they happened in time, and lists the create
// options it was given (name=value, floats and bools only). Execute and
// UpdateGlobalProcessInfo record the structs they were given, read in this version's layout
// (from 0.76 on: PJRT_ExecuteOptions of 88 bytes, PJRT_ProcessInfo led by struct_size).
//
// The layout is written here from pjrt_c_api.h, apart from the shim's: function slots by
// their position in PJRT_Api (0 PJRT_Error_Destroy, 1 _Message, 2 _GetCode,
// 3 PJRT_Plugin_Initialize, 4 _Attributes, 10 PJRT_Client_Create,
// 12 PJRT_Client_PlatformName, 55 PJRT_LoadedExecutable_Execute,
// 84 PJRT_TopologyDescription_PlatformName, 113 PJRT_Client_UpdateGlobalProcessInfo).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "torch_xla_ext/csrc/pjrt_ffi_extension.h"

struct PjrtError {
  std::string message;
  int code;
};

namespace {

constexpr int kSlots = (960 - 40) / 8;
constexpr int kErrorDestroy = 0, kErrorMessage = 1, kErrorGetCode = 2, kPluginInitialize = 3,
              kPluginAttributes = 4, kClientCreate = 10, kClientPlatformName = 12,
              kExecute = 55, kTopologyPlatformName = 84, kUpdateGlobalProcessInfo = 113;
constexpr bool kHasCallLocation = FAKE_PJRT_MINOR >= 76;  // and ProcessInfo's struct_size

struct FakeApi {
  size_t struct_size;
  PjrtExtensionBase* extension_start;
  struct {
    size_t struct_size;
    void* extension_start;
    int major_version;
    int minor_version;
  } version;
  void* functions[kSlots];
};
static_assert(sizeof(FakeApi) == 960, "PJRT_Api of PJRT C API 0.75");

struct PlatformNameArgs {
  size_t struct_size;
  void* extension_start;
  void* client_or_topology;
  const char* platform_name;
  size_t platform_name_size;
};

struct ErrorGetCodeArgs {
  size_t struct_size;
  void* extension_start;
  const PjrtError* error;
  int code;
};

struct PluginAttributesArgs {
  size_t struct_size;
  void* extension_start;
  void* attributes;
  size_t num_attributes;
};

struct Registration {
  std::string target;
  std::string platform;
  void* handler;
  uint32_t traits;
};
std::vector<Registration> registrations;

// Prefixes of PJRT_LoadedExecutable_Execute_Args / PJRT_Client_UpdateGlobalProcessInfo_Args.
struct ExecuteArgs {
  size_t struct_size;
  void* extension_start;
  void* executable;
  const unsigned char* options;
};
struct UpdateGlobalProcessInfoArgs {
  size_t struct_size;
  void* extension_start;
  void* client;
  const unsigned char* process_infos;
  size_t num_process_infos;
};

// What the last Execute saw: PJRT_ExecuteOptions' struct_size, launch_id (byte 48) and, from
// 0.76, call_location (byte 80).
struct SeenExecute {
  size_t options_size;
  int launch_id;
  const char* call_location;
} seen_execute;

// What the last UpdateGlobalProcessInfo saw, per entry: its struct_size (0 before 0.76, where
// there is none), task_id and error_message.
struct SeenProcessInfo {
  size_t struct_size;
  int task_id;
  std::string error_message;
};
std::vector<SeenProcessInfo> seen_process_infos;

template <typename T>
T Read(const unsigned char* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

void ErrorDestroy(PjrtErrorDestroyArgs* args) { delete args->error; }

void ErrorMessage(PjrtErrorMessageArgs* args) {
  args->message = args->error->message.data();
  args->message_size = args->error->message.size();
}

PjrtError* ErrorGetCode(ErrorGetCodeArgs* args) {
  args->code = args->error->code;
  return nullptr;
}

PjrtError* PluginInitialize(void*) { return nullptr; }

PjrtError* PluginAttributes(PluginAttributesArgs* args) {
  args->attributes = nullptr;
  args->num_attributes = 0;
  return nullptr;
}

// PJRT_Client_Create_Args: {struct_size, extension_start, create_options, num_options, ...};
// each PJRT_NamedValue (56 bytes): {struct_size, extension_start, name, name_size, type (an
// int: 3 float, 4 bool), its value at byte 40, value_size}.
std::string CreateOptions(const unsigned char* args) {
  constexpr size_t kNamedValueSize = 56;
  const auto* options = Read<const unsigned char*>(args + 16);
  const size_t count = Read<size_t>(args + 24);
  std::string listed;
  for (size_t i = 0; i < count; ++i) {
    const unsigned char* option = options + i * kNamedValueSize;
    listed += (listed.empty() ? "" : " ") +
              std::string(Read<const char*>(option + 16), Read<size_t>(option + 24)) + "=";
    switch (Read<int>(option + 32)) {
      case 3: listed += std::to_string(Read<float>(option + 40)); break;
      case 4: listed += Read<bool>(option + 40) ? "true" : "false"; break;
      default: listed += "?";
    }
  }
  return listed;
}

PjrtError* ClientCreate(const unsigned char* args) {
  constexpr int kUnimplemented = 12;
  return new PjrtError{"fake PJRT plugin: no devices; " + std::to_string(registrations.size()) +
                           " handlers were registered before PJRT_Client_Create; options: [" +
                           CreateOptions(args) + "]",
                       kUnimplemented};
}

// "cuda", as jax-cuda12-pjrt's plugin answers; a null client or topology is an error.
PjrtError* PlatformName(PlatformNameArgs* args) {
  if (args->client_or_topology == nullptr) {
    constexpr int kInvalidArgument = 3;
    return new PjrtError{"fake PJRT plugin: null client", kInvalidArgument};
  }
  args->platform_name = "cuda";
  args->platform_name_size = 4;
  return nullptr;
}

PjrtError* Execute(ExecuteArgs* args) {
  constexpr size_t kOptionsSize = kHasCallLocation ? 88 : 80;
  const size_t given = Read<size_t>(args->options);
  if (given < kOptionsSize) {  // as the real plugin's ActualStructSizeIsGreaterOrEqual
    constexpr int kInvalidArgument = 3;
    return new PjrtError{"Unexpected PJRT_ExecuteOptions size: expected " +
                             std::to_string(kOptionsSize) + ", got " + std::to_string(given),
                         kInvalidArgument};
  }
  seen_execute = {given, Read<int>(args->options + 48),
                  kHasCallLocation ? Read<const char*>(args->options + 80) : nullptr};
  return nullptr;
}

PjrtError* UpdateGlobalProcessInfo(UpdateGlobalProcessInfoArgs* args) {
  constexpr size_t kEntrySize = kHasCallLocation ? 48 : 40, kFields = kHasCallLocation ? 8 : 0;
  seen_process_infos.clear();
  for (size_t i = 0; i < args->num_process_infos; ++i) {
    const unsigned char* entry = args->process_infos + i * kEntrySize;
    seen_process_infos.push_back(
        {kHasCallLocation ? Read<size_t>(entry) : 0, Read<int>(entry + kFields),
         std::string(Read<const char*>(entry + kFields + 24),
                     Read<size_t>(entry + kFields + 32))});
  }
  return nullptr;
}

PjrtError* RegisterHandler(PjrtFfiRegisterHandlerArgs* args) {
  registrations.push_back({std::string(args->target_name, args->target_name_size),
                           std::string(args->platform_name, args->platform_name_size),
                           args->handler, args->traits});
  return nullptr;
}

PjrtFfiExtension ffi_extension = {
    {sizeof(PjrtFfiExtension), kPjrtExtensionTypeFfi, nullptr}, nullptr, nullptr,
    RegisterHandler};
constexpr int32_t kPjrtExtensionTypeGpuCustomCall = 0;
PjrtExtensionBase other_extension = {sizeof(PjrtExtensionBase), kPjrtExtensionTypeGpuCustomCall,
                                     &ffi_extension.base};

FakeApi MakeApi() {
  FakeApi api{};
  api.struct_size = sizeof(FakeApi);
  api.extension_start = &other_extension;
  api.version = {24, nullptr, 0, FAKE_PJRT_MINOR};
  // Slots nobody calls hold distinct markers, so a test can see each one passed through.
  for (int i = 0; i < kSlots; ++i) api.functions[i] = reinterpret_cast<void*>(0xFA0000 + i);
  api.functions[kErrorDestroy] = reinterpret_cast<void*>(ErrorDestroy);
  api.functions[kErrorMessage] = reinterpret_cast<void*>(ErrorMessage);
  api.functions[kErrorGetCode] = reinterpret_cast<void*>(ErrorGetCode);
  api.functions[kPluginInitialize] = reinterpret_cast<void*>(PluginInitialize);
  api.functions[kPluginAttributes] = reinterpret_cast<void*>(PluginAttributes);
  api.functions[kClientCreate] = reinterpret_cast<void*>(ClientCreate);
  api.functions[kClientPlatformName] = reinterpret_cast<void*>(PlatformName);
  api.functions[kTopologyPlatformName] = reinterpret_cast<void*>(PlatformName);
  api.functions[kExecute] = reinterpret_cast<void*>(Execute);
  api.functions[kUpdateGlobalProcessInfo] = reinterpret_cast<void*>(UpdateGlobalProcessInfo);
  return api;
}

FakeApi fake_api = MakeApi();

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const void* GetPjrtApi() { return &fake_api; }

// What register_handler recorded: the number of calls, and call `i`'s fields.
__attribute__((visibility("default"))) int fake_pjrt_registrations() {
  return static_cast<int>(registrations.size());
}

__attribute__((visibility("default"))) int fake_pjrt_registration(int i, char* target,
                                                                   char* platform,
                                                                   void** handler,
                                                                   uint32_t* traits) {
  if (i < 0 || i >= static_cast<int>(registrations.size())) return -1;
  std::snprintf(target, 256, "%s", registrations[i].target.c_str());
  std::snprintf(platform, 256, "%s", registrations[i].platform.c_str());
  *handler = registrations[i].handler;
  *traits = registrations[i].traits;
  return 0;
}

__attribute__((visibility("default"))) void fake_pjrt_seen_execute(size_t* options_size,
                                                                    int* launch_id,
                                                                    const char** call_location) {
  *options_size = seen_execute.options_size;
  *launch_id = seen_execute.launch_id;
  *call_location = seen_execute.call_location;
}

// Entry `i` of the last UpdateGlobalProcessInfo, or -1 past its end.
__attribute__((visibility("default"))) int fake_pjrt_seen_process_info(int i, size_t* struct_size,
                                                                        int* task_id,
                                                                        char* error_message) {
  if (i < 0 || i >= static_cast<int>(seen_process_infos.size())) return -1;
  *struct_size = seen_process_infos[i].struct_size;
  *task_id = seen_process_infos[i].task_id;
  std::snprintf(error_message, 256, "%s", seen_process_infos[i].error_message.c_str());
  return 0;
}

}  // extern "C"
