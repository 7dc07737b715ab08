// A minimal XLA runtime for running one FFI handler on caller-owned memory: what lets the
// torch.library CPU and CUDA implementations execute exactly the handlers XLA runs.
//
// It implements the parts of XLA_FFI_Api a handler's execute stage uses: errors, the stream
// (the caller's, e.g. torch's current stream) and scratch memory (through the caller's
// allocator, e.g. torch's caching allocator). The rest answers "unimplemented".
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"

extern "C" {

// A scalar attribute (dtype is an XLA_FFI_DataType, value points at it) or, with dtype -1,
// a string of `size` bytes.
typedef struct XlaExtEagerAttr {
  const char* name;
  int32_t dtype;
  const void* value;
  size_t size;
} XlaExtEagerAttr;

typedef void* (*XlaExtAllocFn)(void* user, size_t size, size_t alignment);
typedef void (*XlaExtFreeFn)(void* user, void* data, size_t size);

}  // extern "C"

struct XLA_FFI_Error {
  XLA_FFI_Error_Code code;
  std::string message;
};

struct XLA_FFI_ExecutionContext {
  void* stream;
  int32_t device_ordinal;
  XlaExtAllocFn alloc;
  XlaExtFreeFn free;
  void* alloc_user;
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
  const XLA_FFI_ExecutionContext* ctx = args->ctx;
  args->data = ctx->alloc(ctx->alloc_user, args->size, args->alignment);
  if (args->data == nullptr && args->size > 0) {
    return MakeError(XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
                     "failed to allocate " + std::to_string(args->size) + " bytes of scratch");
  }
  return nullptr;
}

XLA_FFI_Error* DeviceMemoryFree(XLA_FFI_DeviceMemory_Free_Args* args) {
  args->ctx->free(args->ctx->alloc_user, args->data, args->size);
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

void* HostAlloc(void*, size_t size, size_t alignment) {
  alignment = alignment < sizeof(void*) ? sizeof(void*) : alignment;
  void* data = nullptr;
  return posix_memalign(&data, alignment, size) == 0 ? data : nullptr;
}

void HostFree(void*, void* data, size_t) { std::free(data); }

// Buffers packed as one int64 array, each as: XLA_FFI_DataType, data address, rank, dims
// (one allocation for the caller per call, however many buffers). The dims stay in `packed`.
std::vector<XLA_FFI_Buffer> Buffers(int count, const int64_t*& packed) {
  std::vector<XLA_FFI_Buffer> out(count);
  for (int i = 0; i < count; ++i) {
    const int64_t rank = packed[2];
    out[i] = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr,
                            static_cast<XLA_FFI_DataType>(packed[0]),
                            reinterpret_cast<void*>(static_cast<intptr_t>(packed[1])), rank,
                            const_cast<int64_t*>(packed + 3)};
    packed += 3 + rank;
  }
  return out;
}

}  // namespace

extern "C" {

// Runs `handler` (execute stage) once. `stream` is the platform stream handed to the handler
// (null on the CPU); `alloc`/`free` provide scratch memory (null: the C heap). Attributes must
// be sorted by name, as XLA passes them. Returns 0, or -1 with the handler's message in `err`.
__attribute__((visibility("default"))) int xla_ext_eager_call(
    XLA_FFI_Handler* handler, void* stream, int32_t device_ordinal, int32_t num_args,
    int32_t num_rets, const int64_t* buffers, int32_t num_attrs, const XlaExtEagerAttr* attrs, XlaExtAllocFn alloc, XlaExtFreeFn free,
    void* alloc_user, char* err, size_t err_size) {
  XLA_FFI_ExecutionContext ctx{stream, device_ordinal, alloc ? alloc : HostAlloc,
                               free ? free : HostFree, alloc_user};

  std::vector<XLA_FFI_Buffer> arg_buffers = Buffers(num_args, buffers);
  std::vector<XLA_FFI_Buffer> ret_buffers = Buffers(num_rets, buffers);
  std::vector<XLA_FFI_ArgType> arg_types(num_args, XLA_FFI_ArgType_BUFFER);
  std::vector<XLA_FFI_RetType> ret_types(num_rets, XLA_FFI_RetType_BUFFER);
  std::vector<void*> arg_ptrs(num_args), ret_ptrs(num_rets);
  for (int i = 0; i < num_args; ++i) arg_ptrs[i] = &arg_buffers[i];
  for (int i = 0; i < num_rets; ++i) ret_ptrs[i] = &ret_buffers[i];

  std::vector<XLA_FFI_AttrType> attr_types(num_attrs);
  std::vector<XLA_FFI_ByteSpan> names(num_attrs), strings(num_attrs);
  std::vector<XLA_FFI_ByteSpan*> name_ptrs(num_attrs);
  std::vector<XLA_FFI_Scalar> scalars(num_attrs);
  std::vector<void*> attr_ptrs(num_attrs);
  for (int i = 0; i < num_attrs; ++i) {
    names[i] = XLA_FFI_ByteSpan{attrs[i].name, std::strlen(attrs[i].name)};
    name_ptrs[i] = &names[i];
    if (attrs[i].dtype < 0) {
      strings[i] = XLA_FFI_ByteSpan{static_cast<const char*>(attrs[i].value), attrs[i].size};
      attr_types[i] = XLA_FFI_AttrType_STRING;
      attr_ptrs[i] = &strings[i];
    } else {
      scalars[i] = XLA_FFI_Scalar{static_cast<XLA_FFI_DataType>(attrs[i].dtype),
                                  const_cast<void*>(attrs[i].value)};
      attr_types[i] = XLA_FFI_AttrType_SCALAR;
      attr_ptrs[i] = &scalars[i];
    }
  }

  XLA_FFI_CallFrame frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.api = &kEagerApi;
  frame.ctx = &ctx;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args = XLA_FFI_Args{XLA_FFI_Args_STRUCT_SIZE, nullptr, num_args, arg_types.data(),
                            arg_ptrs.data()};
  frame.rets = XLA_FFI_Rets{XLA_FFI_Rets_STRUCT_SIZE, nullptr, num_rets, ret_types.data(),
                            ret_ptrs.data()};
  frame.attrs = XLA_FFI_Attrs{XLA_FFI_Attrs_STRUCT_SIZE, nullptr, num_attrs, attr_types.data(),
                              name_ptrs.data(), attr_ptrs.data()};
  if (XLA_FFI_Error* error = handler(&frame)) {
    if (err_size > 0) std::snprintf(err, err_size, "%s", error->message.c_str());
    delete error;
    return -1;
  }
  return 0;
}

}  // extern "C"
