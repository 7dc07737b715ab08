// The slice of the PJRT C API that the plugin binder touches, declared from its documented
// layout (stable from PJRT 0.75, torch_xla 2.9's, through 0.115, jax 0.11's): the API's version
// and error functions, the extension chain, the FFI extension's register_handler, and the GPU
// custom-call extension (version 2) that registers a legacy custom-call function.
#ifndef TORCH_XLA_EXT_CSRC_PJRT_FFI_EXTENSION_H_
#define TORCH_XLA_EXT_CSRC_PJRT_FFI_EXTENSION_H_

#include <cstddef>
#include <cstdint>

extern "C" {

struct PjrtError;

struct PjrtExtensionBase {
  size_t struct_size;
  int32_t type;  // PJRT_Extension_Type
  PjrtExtensionBase* next;
};

inline constexpr int32_t kPjrtExtensionTypeGpuCustomCall = 0;
inline constexpr int32_t kPjrtExtensionTypeFfi = 5;

struct PjrtErrorDestroyArgs {
  size_t struct_size;
  void* extension_start;
  PjrtError* error;
};

struct PjrtErrorMessageArgs {
  size_t struct_size;
  void* extension_start;
  const PjrtError* error;
  const char* message;  // out
  size_t message_size;  // out
};

struct PjrtApiPrefix {
  size_t struct_size;
  PjrtExtensionBase* extension_start;
  struct {
    size_t struct_size;
    void* extension_start;
    int32_t major_version;
    int32_t minor_version;
  } pjrt_api_version;
  void (*error_destroy)(PjrtErrorDestroyArgs*);
  void (*error_message)(PjrtErrorMessageArgs*);
};

struct PjrtFfiRegisterHandlerArgs {
  size_t struct_size;
  const char* target_name;
  size_t target_name_size;
  void* handler;
  const char* platform_name;
  size_t platform_name_size;
  uint32_t traits;
};

struct PjrtFfiExtension {
  PjrtExtensionBase base;
  void* type_id_register;
  void* user_data_add;
  PjrtError* (*register_handler)(PjrtFfiRegisterHandlerArgs*);
};

// PJRT_Gpu_Register_Custom_Call_Args: api_version 0 registers `handler_execute` as a legacy
// (untyped) custom-call function of platform "CUDA"; 1 registers a typed FFI bundle.
struct PjrtGpuRegisterCustomCallArgs {
  size_t struct_size;
  const char* function_name;
  size_t function_name_size;
  int api_version;
  void* handler_instantiate;
  void* handler_prepare;
  void* handler_initialize;
  void* handler_execute;
};

struct PjrtGpuCustomCallExtension {
  PjrtExtensionBase base;
  PjrtError* (*custom_call)(PjrtGpuRegisterCustomCallArgs*);
};

}  // extern "C"

#endif  // TORCH_XLA_EXT_CSRC_PJRT_FFI_EXTENSION_H_
