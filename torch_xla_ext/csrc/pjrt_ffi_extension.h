// The slice of the PJRT C API that the plugin binder touches, declared from its documented
// layout (stable from PJRT 0.75, torch_xla 2.9's, through 0.115, jax 0.11's): the API's version
// and error functions, the extension chain, and the FFI extension's register_handler.
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

}  // extern "C"

#endif  // TORCH_XLA_EXT_CSRC_PJRT_FFI_EXTENSION_H_
