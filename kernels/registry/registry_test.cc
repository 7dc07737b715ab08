// The table a library exports holds exactly what its XLA_EXT_REGISTER_KERNEL lines added, in
// order, and refuses a second handler for the same (target, platform); likewise its contracts
// (XLA_EXT_REGISTER_CONTRACT, and XLA_EXT_REGISTER_CHECK's contract of a check alone), which
// the generic workspace query answers from. A call given xla_ext_defer_failure defers its
// failure: in-place results keep their operands' values, the others are 0xFF bytes, the failure
// waits for xla_ext_take_deferred_failure, and calls meanwhile skip their handlers.
#include "xla_ext/registry.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

// The runtime's error, for the fake XLA_FFI_Api below.
struct XLA_FFI_Error {
  std::string message;
};

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

// A handler that checks its frame: operands `flag` (s32[1]) and `source` (f32[4]); results
// `into` (f32[4], written in place into `source` by the caller's aliasing: source + 1) and
// `other` (s32[2]: 7). A negative flag fails the call. It sees exactly one attribute.
std::atomic<int> handler_calls{0};
std::atomic<int64_t> handler_saw_attrs{-1};

XLA_FFI_Error* FailOnNegative(XLA_FFI_CallFrame* frame) {
  ++handler_calls;
  handler_saw_attrs = frame->attrs.size;
  const auto arg = [&](int i) { return static_cast<XLA_FFI_Buffer*>(frame->args.args[i]); };
  const auto ret = [&](int i) { return static_cast<XLA_FFI_Buffer*>(frame->rets.rets[i]); };
  if (frame->attrs.size != 1) {
    XLA_FFI_Error_Create_Args create{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr,
                                     "wrong number of attributes", XLA_FFI_Error_Code_INTERNAL};
    return frame->api->XLA_FFI_Error_Create(&create);
  }
  if (*static_cast<int32_t*>(arg(0)->data) < 0) {
    XLA_FFI_Error_Create_Args create{XLA_FFI_Error_Create_Args_STRUCT_SIZE, nullptr,
                                     "flag: expected >= 0, got -1", XLA_FFI_Error_Code_INVALID_ARGUMENT};
    return frame->api->XLA_FFI_Error_Create(&create);
  }
  for (int i = 0; i < 4; ++i) {
    static_cast<float*>(ret(0)->data)[i] = static_cast<float*>(arg(1)->data)[i] + 1;
  }
  for (int i = 0; i < 2; ++i) static_cast<int32_t*>(ret(1)->data)[i] = 7;
  return nullptr;
}

XLA_FFI_Error* CreateError(XLA_FFI_Error_Create_Args* args) {
  return new XLA_FFI_Error{args->message};
}

void GetMessage(XLA_FFI_Error_GetMessage_Args* args) { args->message = args->error->message.c_str(); }

void DestroyError(XLA_FFI_Error_Destroy_Args* args) { delete args->error; }

// One call of FailOnNegative through the wrapper XLA_EXT_REGISTER_KERNEL registers for it.
struct Call {
  int32_t flag = 0;
  float source[4] = {1, 2, 3, 4};
  float into[4] = {0, 0, 0, 0};
  int32_t other[2] = {0, 0};
  bool defer = true;
  bool aliased = false;  // `into` is `source`'s buffer, as XLA aliases a donated operand

  XLA_FFI_Error* Run(const XLA_FFI_Api* api) {
    int64_t one = 1, four = 4, two = 2;
    XLA_FFI_Buffer flag_buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_S32, &flag, 1, &one};
    XLA_FFI_Buffer source_buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_F32, source, 1, &four};
    XLA_FFI_Buffer into_buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_F32,
                               aliased ? source : into, 1, &four};
    XLA_FFI_Buffer other_buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_S32, other, 1, &two};
    XLA_FFI_ArgType arg_types[] = {XLA_FFI_ArgType_BUFFER, XLA_FFI_ArgType_BUFFER};
    void* args[] = {&flag_buffer, &source_buffer};
    XLA_FFI_RetType ret_types[] = {XLA_FFI_RetType_BUFFER, XLA_FFI_RetType_BUFFER};
    void* rets[] = {&into_buffer, &other_buffer};
    // Sorted by name, as XLA passes them: "scale" after "aaa..." and before "xla_ext_...".
    const int64_t in_place[] = {1, -1};
    XLA_FFI_Array defer_value{XLA_FFI_DataType_S64, 2, const_cast<int64_t*>(in_place)};
    XLA_FFI_Scalar scale{XLA_FFI_DataType_F32, nullptr};
    float scale_value = 1;
    scale.value = &scale_value;
    XLA_FFI_ByteSpan scale_name{"scale", 5};
    XLA_FFI_ByteSpan defer_name{"xla_ext_defer_failure", 21};
    XLA_FFI_AttrType attr_types[] = {XLA_FFI_AttrType_SCALAR, XLA_FFI_AttrType_ARRAY};
    XLA_FFI_ByteSpan* names[] = {&scale_name, &defer_name};
    void* attrs[] = {&scale, &defer_value};
    XLA_FFI_CallFrame frame{};
    frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
    frame.api = api;
    frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
    frame.args = XLA_FFI_Args{XLA_FFI_Args_STRUCT_SIZE, nullptr, 2, arg_types, args};
    frame.rets = XLA_FFI_Rets{XLA_FFI_Rets_STRUCT_SIZE, nullptr, 2, ret_types, rets};
    frame.attrs = XLA_FFI_Attrs{XLA_FFI_Attrs_STRUCT_SIZE, nullptr, defer ? 2 : 1, attr_types,
                                names, attrs};
    return ::xla_ext::registry::DeferringHandler<FailOnNegative, false>(&frame);
  }
};

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
  Expect(table->kernels[0].handler == ::xla_ext::registry::DeferringHandler<HandlerA, false>,
         "first handler, wrapped to defer failures on request");
  Expect(table->kernels[1].handler == ::xla_ext::registry::DeferringHandler<HandlerB, true>,
         "second handler, wrapped for CUDA");
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

  XLA_FFI_Api api{};
  api.XLA_FFI_Error_Create = CreateError;
  api.XLA_FFI_Error_GetMessage = GetMessage;
  api.XLA_FFI_Error_Destroy = DestroyError;
  char message[256] = {};

  Call plain;
  plain.defer = false;
  plain.flag = -1;
  XLA_FFI_Error* error = plain.Run(&api);
  Expect(error != nullptr && error->message == "flag: expected >= 0, got -1" &&
             xla_ext_take_deferred_failure(message, sizeof(message)) == 0,
         "without the attribute, the handler's error goes to XLA, deferred nowhere");
  delete error;

  Call ok;
  Expect(ok.Run(&api) == nullptr && ok.into[0] == 2 && ok.into[3] == 5 && ok.other[1] == 7 &&
             handler_saw_attrs == 1,
         "a deferring call that succeeds: the handler's results; it sees its own attributes");
  Expect(xla_ext_take_deferred_failure(message, sizeof(message)) == 0, "nothing deferred");

  Call failed;
  failed.flag = -1;
  Expect(failed.Run(&api) == nullptr, "a deferred failure returns success to XLA");
  Expect(failed.into[0] == 1 && failed.into[3] == 4,
         "an in-place result in a buffer of its own gets its operand's values");
  Expect(failed.other[0] == -1 && failed.other[1] == -1, "another result is 0xFF bytes");

  Call skipped;
  skipped.aliased = true;
  const int calls_before = handler_calls;
  Expect(skipped.Run(&api) == nullptr && handler_calls == calls_before &&
             skipped.source[0] == 1 && skipped.other[0] == -1,
         "while a failure is held, a call skips its handler; its in-place operand is unchanged");
  Expect(xla_ext_take_deferred_failure(message, sizeof(message)) == 2 &&
             std::strcmp(message, "flag: expected >= 0, got -1") == 0,
         "the take: two calls, the first one's message");
  Expect(xla_ext_take_deferred_failure(message, sizeof(message)) == 0, "taken once");

  Call after;
  after.aliased = true;
  Expect(after.Run(&api) == nullptr && after.source[0] == 2 && after.other[0] == 7,
         "after the take, calls run again");

  // A take while another thread's calls skip: each take reports the failure recorded before it,
  // never a failure without a message that a skip raced into being after the take.
  std::atomic<bool> stop{false};
  std::thread other_calls([&] {
    while (!stop.load()) {
      Call call;
      call.aliased = true;
      call.Run(&api);
    }
  });
  int empty_messages = 0;
  for (int i = 0; i < 100000; ++i) {
    Call fails;
    fails.flag = -1;
    fails.Run(&api);
    message[0] = '\0';
    if (xla_ext_take_deferred_failure(message, sizeof(message)) > 0 &&
        std::strcmp(message, "flag: expected >= 0, got -1") != 0) {
      ++empty_messages;
    }
  }
  stop.store(true);
  other_calls.join();
  Expect(empty_messages == 0, "concurrent takes and skips: every take has the failure's message");
  xla_ext_take_deferred_failure(message, sizeof(message));

  std::printf("%s\n", failures == 0 ? "registry_test: all checks passed" : "registry_test: FAILED");
  return failures == 0 ? 0 : 1;
}
