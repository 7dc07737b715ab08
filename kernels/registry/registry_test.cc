// The table a library exports holds exactly what its XLA_EXT_REGISTER_KERNEL lines added, in
// order, and refuses a second handler for the same (target, platform).
#include "xla_ext/registry.h"

#include <cstdio>
#include <cstring>

namespace {

XLA_FFI_Error* HandlerA(XLA_FFI_CallFrame*) { return nullptr; }
XLA_FFI_Error* HandlerB(XLA_FFI_CallFrame*) { return nullptr; }

XLA_EXT_REGISTER_KERNEL("test.a", "Host", HandlerA, XLA_EXT_NO_TRAITS);
XLA_EXT_REGISTER_KERNEL("test.a", "CUDA", HandlerB,
                        XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
XLA_EXT_REGISTER_KERNEL("test.a", "Host", HandlerB, XLA_EXT_NO_TRAITS);  // duplicate

int failures = 0;

void Expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}

}  // namespace

int main() {
  const XlaExtKernelTable* table = xla_ext_kernel_table();
  Expect(table->struct_size == sizeof(XlaExtKernelTable) &&
             table->kernel_struct_size == sizeof(XlaExtKernel) &&
             table->kernels[0].struct_size == sizeof(XlaExtKernel),
         "sizes, the version of the layout");
  Expect(table->ffi_api_major == 0 && table->ffi_api_minor == 1,
         "built against XLA FFI 0.1, the version torch_xla 2.9 accepts");
  Expect(table->num_kernels == 2, "the duplicate is not added");
  Expect(std::strcmp(table->kernels[0].target, "test.a") == 0, "first target");
  Expect(std::strcmp(table->kernels[0].platform, "Host") == 0, "first platform");
  Expect(table->kernels[0].handler == HandlerA, "first handler");
  Expect(table->kernels[1].handler == HandlerB, "second handler");
  Expect(table->kernels[1].traits == XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, "traits");
  Expect(table->error != nullptr &&
             std::strstr(table->error, "duplicate registration of target 'test.a' for "
                                       "platform 'Host'") != nullptr,
         "the duplicate is reported");
  std::printf("%s\n", failures == 0 ? "registry_test: all checks passed" : "registry_test: FAILED");
  return failures == 0 ? 0 : 1;
}
