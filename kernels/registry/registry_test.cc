// The table a library exports holds exactly what its XLA_EXT_REGISTER_KERNEL lines added, in
// order, and refuses a second handler for the same (target, platform); likewise its contracts
// (XLA_EXT_REGISTER_CONTRACT, and XLA_EXT_REGISTER_CHECK's contract of a check alone), which
// the generic workspace query answers from.
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

constexpr int64_t kSizes[] = {8, 16};
constexpr XlaExtSupportedValues kSupported[] = {{"size", "x", 2, kSizes}};

// The bytes a call needs: here its first operand's first dimension, plus attribute "extra".
int64_t WorkspaceBytes(int device, const XlaExtCallShape* call) {
  int64_t extra = 0;
  for (uint32_t i = 0; i < call->num_attributes; ++i) {
    if (std::strcmp(call->attributes[i].name, "extra") == 0) {
      extra = static_cast<int64_t>(call->attributes[i].value);
    }
  }
  return device == -1 ? call->operands[0].dims[0] + extra : 0;
}

XLA_EXT_REGISTER_CONTRACT(XlaExtContract{0, "test.a", 1, kSupported, WorkspaceBytes});
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{0, "test.b", 1, kSupported, nullptr});
XLA_EXT_REGISTER_CONTRACT(XlaExtContract{0, "test.a", 0, nullptr, nullptr});  // duplicate

// Accepts a call whose first operand has rank 1.
const char* CheckRankOne(const XlaExtCallShape* call) {
  return call->operands[0].rank == 1 ? nullptr : "argument 'x': expected rank 1";
}

XLA_EXT_REGISTER_CHECK("test.checked", CheckRankOne);

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
         "the duplicate is reported (the first refusal)");

  Expect(table->contract_struct_size == sizeof(XlaExtContract) && table->num_contracts == 3,
         "contracts: the duplicate is not added");
  Expect(table->contract_struct_size >= XLA_EXT_CONTRACT_STRUCT_SIZE_V2 &&
             table->contracts[0].check == nullptr && table->contracts[1].check == nullptr,
         "a contract without a check");
  Expect(table->contracts[0].struct_size == sizeof(XlaExtContract) &&
             std::strcmp(table->contracts[0].target, "test.a") == 0 &&
             table->contracts[0].num_supported == 1 &&
             table->contracts[0].supported[0].values[1] == 16,
         "the first contract and its supported values");
  const int64_t dims[] = {24, 3};
  const XlaExtOperandShape operand{XLA_FFI_DataType_F32, 2, dims};
  const XlaExtScalarAttribute extra{"extra", XLA_FFI_DataType_S32, 2.0};
  const XlaExtCallShape call{1, &operand, 1, &extra};
  Expect(xla_ext_workspace_bytes("test.a", -1, &call) == 26,
         "the workspace query answers through the target's contract");
  Expect(xla_ext_workspace_bytes("test.b", -1, &call) == -1 &&
             xla_ext_workspace_bytes("test.c", -1, &call) == -1,
         "no workspace query: a contract without one, or no contract");
  const XlaExtContract& checked = table->contracts[2];
  Expect(std::strcmp(checked.target, "test.checked") == 0 && checked.num_supported == 0 &&
             checked.workspace_bytes == nullptr && checked.check == CheckRankOne,
         "XLA_EXT_REGISTER_CHECK registers a contract holding only the check");
  const XlaExtOperandShape vector{XLA_FFI_DataType_F32, 1, dims};
  const XlaExtCallShape rank_one{1, &vector, 0, nullptr};
  Expect(checked.check(&rank_one) == nullptr && checked.check(&call) != nullptr &&
             std::strstr(checked.check(&call), "argument 'x'") != nullptr,
         "the check accepts and refuses calls by their shapes");
  std::printf("%s\n", failures == 0 ? "registry_test: all checks passed" : "registry_test: FAILED");
  return failures == 0 ? 0 : 1;
}
