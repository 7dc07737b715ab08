// The XLA_FFI_Api of eager_runtime.h: a handler's execute stage outside XLA.
#include "torch_xla_ext/csrc/eager_runtime.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

struct XLA_FFI_Error {
  XLA_FFI_Error_Code code;
  std::string message;
};

struct XLA_FFI_ExecutionContext {
  void* stream;
  int32_t device_ordinal;
  xla_ext::eager::ScratchAllocator* scratch;
};

namespace {

XLA_FFI_Error* MakeError(XLA_FFI_Error_Code code, std::string message) {
  return new XLA_FFI_Error{code, std::move(message)};
}

XLA_FFI_Error* Unimplemented(const char* what) {
  return MakeError(XLA_FFI_Error_Code_UNIMPLEMENTED,
                   std::string(what) + " is not available when a handler runs eagerly");
}

XLA_FFI_Error* ErrorCreate(XLA_FFI_Error_Create_Args* args) {
  return MakeError(args->errc, args->message ? args->message : "");
}

void ErrorGetMessage(XLA_FFI_Error_GetMessage_Args* args) {
  args->message = args->error->message.c_str();
}

void ErrorDestroy(XLA_FFI_Error_Destroy_Args* args) { delete args->error; }

XLA_FFI_Error* HandlerRegister(XLA_FFI_Handler_Register_Args*) {
  return Unimplemented("handler registration");
}

XLA_FFI_Error* StreamGet(XLA_FFI_Stream_Get_Args* args) {
  args->stream = args->ctx->stream;
  return nullptr;
}

XLA_FFI_Error* TypeIdRegister(XLA_FFI_TypeId_Register_Args*) { return Unimplemented("TypeId"); }

XLA_FFI_Error* ExecutionContextGet(XLA_FFI_ExecutionContext_Get_Args*) {
  return Unimplemented("user data");
}

XLA_FFI_Error* StateSet(XLA_FFI_State_Set_Args*) { return Unimplemented("state"); }
XLA_FFI_Error* StateGet(XLA_FFI_State_Get_Args*) { return Unimplemented("state"); }

XLA_FFI_Error* DeviceMemoryAllocate(XLA_FFI_DeviceMemory_Allocate_Args* args) {
  args->data = args->ctx->scratch->Allocate(args->size, args->alignment);
  if (args->data == nullptr && args->size > 0) {
    return MakeError(XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                     "failed to allocate " + std::to_string(args->size) + " bytes of scratch");
  }
  return nullptr;
}

XLA_FFI_Error* DeviceMemoryFree(XLA_FFI_DeviceMemory_Free_Args* args) {
  args->ctx->scratch->Free(args->data);
  return nullptr;
}

XLA_FFI_Error* ThreadPoolSchedule(XLA_FFI_ThreadPool_Schedule_Args*) {
  return Unimplemented("the thread pool");
}
XLA_FFI_Error* ThreadPoolNumThreads(XLA_FFI_ThreadPool_NumThreads_Args*) {
  return Unimplemented("the thread pool");
}
XLA_FFI_Error* FutureCreate(XLA_FFI_Future_Create_Args*) { return Unimplemented("futures"); }
XLA_FFI_Error* FutureSetAvailable(XLA_FFI_Future_SetAvailable_Args*) {
  return Unimplemented("futures");
}
XLA_FFI_Error* FutureSetError(XLA_FFI_Future_SetError_Args*) { return Unimplemented("futures"); }

XLA_FFI_Error* RunIdGet(XLA_FFI_RunId_Get_Args* args) {
  args->run_id = 0;
  return nullptr;
}

XLA_FFI_Error* DeviceOrdinalGet(XLA_FFI_DeviceOrdinal_Get_Args* args) {
  args->device_ordinal = args->ctx->device_ordinal;
  return nullptr;
}

const XLA_FFI_Api kEagerApi = {
    XLA_FFI_Api_STRUCT_SIZE,
    nullptr,
    XLA_FFI_Api_Version{XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, XLA_FFI_API_MAJOR,
                        XLA_FFI_API_MINOR},
    nullptr,
    ErrorCreate,
    ErrorGetMessage,
    ErrorDestroy,
    HandlerRegister,
    StreamGet,
    TypeIdRegister,
    ExecutionContextGet,
    StateSet,
    StateGet,
    DeviceMemoryAllocate,
    DeviceMemoryFree,
    ThreadPoolSchedule,
    ThreadPoolNumThreads,
    FutureCreate,
    FutureSetAvailable,
    FutureSetError,
    RunIdGet,
    DeviceOrdinalGet,
};

}  // namespace

namespace xla_ext::eager {

void* HostScratch::Allocate(size_t size, size_t alignment) {
  alignment = std::max(alignment, sizeof(void*));
  void* data = nullptr;
  return posix_memalign(&data, alignment, size) == 0 ? data : nullptr;
}

void HostScratch::Free(void* data) { std::free(data); }

void Attributes::AddScalar(std::string name, XLA_FFI_DataType dtype, std::string bytes) {
  entries_.push_back(Entry{std::move(name), false, dtype, std::move(bytes)});
}

void Attributes::AddString(std::string name, std::string value) {
  entries_.push_back(Entry{std::move(name), true, XLA_FFI_DataType_INVALID, std::move(value)});
}

void Attributes::Finish() {
  std::sort(entries_.begin(), entries_.end(),
            [](const Entry& a, const Entry& b) { return a.name < b.name; });
  const size_t n = entries_.size();
  types_.resize(n);
  names_.resize(n);
  strings_.resize(n);
  name_ptrs_.resize(n);
  scalars_.resize(n);
  values_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    Entry& e = entries_[i];
    names_[i] = XLA_FFI_ByteSpan{e.name.data(), e.name.size()};
    name_ptrs_[i] = &names_[i];
    if (e.is_string) {
      strings_[i] = XLA_FFI_ByteSpan{e.bytes.data(), e.bytes.size()};
      types_[i] = XLA_FFI_AttrType_STRING;
      values_[i] = &strings_[i];
    } else {
      scalars_[i] = XLA_FFI_Scalar{e.dtype, e.bytes.data()};
      types_[i] = XLA_FFI_AttrType_SCALAR;
      values_[i] = &scalars_[i];
    }
  }
  frame_ = XLA_FFI_Attrs{XLA_FFI_Attrs_STRUCT_SIZE, nullptr, static_cast<int64_t>(n),
                         types_.data(), name_ptrs_.data(), values_.data()};
}

std::string Call(XLA_FFI_Handler* handler, void* stream, int32_t device_ordinal,
                 std::vector<XLA_FFI_Buffer>& args, std::vector<XLA_FFI_Buffer>& rets,
                 const Attributes& attributes, ScratchAllocator& scratch) {
  XLA_FFI_ExecutionContext ctx{stream, device_ordinal, &scratch};
  const size_t num_args = args.size(), num_rets = rets.size();
  std::vector<XLA_FFI_ArgType> arg_types(num_args, XLA_FFI_ArgType_BUFFER);
  std::vector<XLA_FFI_RetType> ret_types(num_rets, XLA_FFI_RetType_BUFFER);
  std::vector<void*> arg_ptrs(num_args), ret_ptrs(num_rets);
  for (size_t i = 0; i < num_args; ++i) arg_ptrs[i] = &args[i];
  for (size_t i = 0; i < num_rets; ++i) ret_ptrs[i] = &rets[i];

  XLA_FFI_CallFrame frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.api = &kEagerApi;
  frame.ctx = &ctx;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args = XLA_FFI_Args{XLA_FFI_Args_STRUCT_SIZE, nullptr, static_cast<int64_t>(num_args),
                            arg_types.data(), arg_ptrs.data()};
  frame.rets = XLA_FFI_Rets{XLA_FFI_Rets_STRUCT_SIZE, nullptr, static_cast<int64_t>(num_rets),
                            ret_types.data(), ret_ptrs.data()};
  frame.attrs = attributes.frame();
  if (XLA_FFI_Error* error = handler(&frame)) {
    std::string message = std::move(error->message);
    delete error;
    return message.empty() ? "the handler failed without a message" : message;
  }
  return "";
}

}  // namespace xla_ext::eager
