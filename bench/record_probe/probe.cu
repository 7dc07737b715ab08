// A probe, not part of the library: can an FFI custom call cost what a native XLA op costs
// inside a command buffer? XLA records a command-buffer-compatible FFI call by stream-capturing
// its handler into a child graph, and a child graph node gets no programmatic (PDL) edges.
// jaxlib 0.11.2's FFI (API 0.4, record extension 0.1, "still under development") adds a
// Record stage: the handler gives XLA a kernel (cubin + name) and its arguments, and XLA adds a
// kernel node, with PDL edges when the call has the attribute uses_pdl=true. The same kernel
// and checks as XlaGpuSimpleAdd's f32 path, under the target xla_ext_probe.add_record.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

#include "add_cubin.h"  // kAddCubin: add_kernel.cu as a cubin (build.sh)
#include "add_kernel.cuh"
#include "xla/ffi/api/ffi.h"
#include "xla/ffi/api/record_api.h"

namespace ffi = xla::ffi;
// ffi.h (0.11.2) names no record context for header-only handlers; these are record_api.h's.
using RecordContext = ffi::internal::RecordContextBase<ffi::internal::ErrorPolicy>;
using RecordExtension = ffi::internal::RecordExtensionBase<RecordContext>;

namespace {

constexpr int kThreads = 256;
std::atomic<int> execute_calls{0}, record_creates{0}, record_updates{0};

// XlaGpuSimpleAdd's grid (256 threads per CTA, a float4 each), or `ctas` CTAs sharing the work.
struct Grid {
  int32_t ctas, threads;
};
Grid GridFor(int64_t n, int32_t ctas) {
  const int64_t vectors = std::max<int64_t>(n / 4, 1);
  if (ctas <= 0) {
    return {static_cast<int32_t>(std::min<int64_t>((vectors + kThreads - 1) / kThreads, 1 << 20)),
            kThreads};
  }
  const int64_t threads = (vectors + ctas - 1) / ctas;
  return {ctas, static_cast<int32_t>(std::clamp<int64_t>((threads + 31) / 32 * 32, 32, 1024))};
}

ffi::Error CheckShapes(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                       ffi::ResultBuffer<ffi::F32> out) {
  if (a.element_count() != b.element_count() || a.element_count() != out->element_count()) {
    return ffi::Error::InvalidArgument("xla_ext_probe: a, b and out must have the same size");
  }
  return ffi::Error::Success();
}

// Outside a command buffer (and when XLA runs the thunk directly), the handler launches.
ffi::Error Execute(cudaStream_t stream, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                   ffi::ResultBuffer<ffi::F32> out, bool uses_pdl, int32_t ctas) {
  if (ffi::Error error = CheckShapes(a, b, out); error.failure()) return error;
  ++execute_calls;
  const int64_t n = a.element_count();
  const Grid grid = GridFor(n, ctas);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid.ctas);
  config.blockDim = dim3(grid.threads);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = uses_pdl ? 1 : 0;
  cudaLaunchKernelEx(&config, xla_ext_probe_add, a.typed_data(), b.typed_data(),
                     out->typed_data(), n);
  if (cudaError_t error = cudaGetLastError(); error != cudaSuccess) {
    return ffi::Error::Internal(cudaGetErrorString(error));
  }
  return ffi::Error::Success();
}

// In a command buffer: a kernel node on create, new arguments for it on update.
ffi::Error Record(RecordContext record, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                  ffi::ResultBuffer<ffi::F32> out, bool uses_pdl, int32_t ctas) {
  if (ffi::Error error = CheckShapes(a, b, out); error.failure()) return error;
  const int64_t n = a.element_count();
  const Grid grid = GridFor(n, ctas);
  const std::array<ffi::KernelArg, 4> args{
      ffi::DevicePointer{a.untyped_data()}, ffi::DevicePointer{b.untyped_data()},
      ffi::DevicePointer{out->untyped_data()}, ffi::HostValue{&n, sizeof(n)}};
  if (record.action() == ffi::RecordAction::kCreate) {
    ++record_creates;
    const XLA_FFI_LaunchDims dims{{grid.ctas, 1, 1}, {grid.threads, 1, 1}, {0, 0, 0}};
    auto command = record.CreateLaunch("xla_ext_probe_add", kAddCubin, sizeof(kAddCubin),
                                       ffi::SourceFormat::kCubin, dims, 0, uses_pdl, args);
    return command.has_error() ? command.error() : ffi::Error::Success();
  }
  ++record_updates;
  return record.UpdateLaunch(record.commands()[0], args);
}

// Both stages bind the same operands and attributes, after their context.
template <typename Binding>
auto BindOperands(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<bool>("uses_pdl")
      .template Attr<int32_t>("ctas");
}

XLA_FFI_DEFINE_HANDLER(kExecute, Execute,
                       BindOperands(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(
    kRecord, Record, BindOperands(ffi::Ffi::BindRecord().Ctx<ffi::Extension<RecordExtension>>()));

ffi::Error Nothing(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }
XLA_FFI_DEFINE_HANDLER(kNothing, Nothing, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

std::atomic<int> registered{0};  // 0: not yet, 1: under way, 2: done, -1: failed
char register_error[512];

}  // namespace

// jax.ffi.register_ffi_target (and PJRT's GPU extension under it) passes no Record handler,
// so this handler, registered the usual way and run once, registers the full bundle through
// the FFI API of the XLA that calls it. A workaround for a probe, not a registration path.
extern "C" XLA_FFI_Error* XlaExtProbeBootstrap(XLA_FFI_CallFrame* frame) {
  if (frame->extension_start == nullptr && frame->stage == XLA_FFI_ExecutionStage_EXECUTE) {
    int expected = 0;
    if (registered.compare_exchange_strong(expected, 1)) {
      XLA_FFI_Handler_Register_Args args{};
      args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;
      const char* name = "xla_ext_probe.add_record";
      args.name = {name, std::strlen(name)};
      args.platform = {"CUDA", 4};
      args.bundle = {nullptr, nullptr, nullptr, kExecute, kRecord};
      args.traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
      if (XLA_FFI_Error* error = frame->api->XLA_FFI_Handler_Register(&args)) {
        XLA_FFI_Error_GetDetails_Args details{};
        details.struct_size = XLA_FFI_Error_GetDetails_Args_STRUCT_SIZE;
        details.error = error;
        frame->api->XLA_FFI_Error_GetDetails(&details);
        std::snprintf(register_error, sizeof(register_error), "%s", details.message);
        registered = -1;
      } else {
        registered = 2;
      }
    }
  }
  return kNothing(frame);  // answers XLA's metadata query too
}

// The same handler without a Record stage: XLA traces it into a child graph.
extern "C" XLA_FFI_Error* XlaExtProbeExecute(XLA_FFI_CallFrame* frame) { return kExecute(frame); }
extern "C" int XlaExtProbeRegistered() { return registered; }
extern "C" const char* XlaExtProbeRegisterError() { return register_error; }
// 0: Execute calls, 1: kernel nodes created, 2: kernel nodes updated.
extern "C" int XlaExtProbeCount(int which) {
  return which == 0   ? execute_calls.load()
         : which == 1 ? record_creates.load()
                      : record_updates.load();
}
