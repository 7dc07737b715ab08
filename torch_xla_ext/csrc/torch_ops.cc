// The CPU and CUDA kernels of the torch ops (torch_xla_ext/eager.py registers them): each runs
// the op's XLA FFI handler on the tensors, on torch's current stream, with scratch memory from
// torch's caching allocator.
//
// An eager call is paid for on the host at every layer of every step, so the work that
// depends only on the arguments' shapes, dtypes, devices and scalar values (the argument
// checks, the result shapes, the handler's attributes) is done once per such signature, in
// Python (the op's `describe`), and kept here; a call whose signature is kept runs without
// Python. Data is checked by the handlers at every call.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torch_xla_ext/csrc/eager_runtime.h"
#include "xla/ffi/api/c_api.h"

namespace xla_ext::torch_ops {
namespace {

namespace py = pybind11;

// The signature a kept call is found by: each argument as a tag and its values.
using Signature = std::vector<int64_t>;

struct SignatureHash {
  size_t operator()(const Signature& s) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : s) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

enum Tag : int64_t { kTensor = 1, kDouble, kBool, kInt, kNone, kString, kIntList };

// Appends `args`' signature to `out`; false for an argument it cannot describe (such calls
// are described at every call).
bool AppendSignature(c10::ArrayRef<c10::IValue> args, Signature& out) {
  for (const c10::IValue& v : args) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      out.insert(out.end(), {kTensor, static_cast<int64_t>(t.scalar_type()),
                             static_cast<int64_t>(t.device().type()), t.device().index(),
                             t.is_contiguous(), t.dim()});
      out.insert(out.end(), t.sizes().begin(), t.sizes().end());
    } else if (v.isDouble()) {
      const double d = v.toDouble();
      int64_t bits;  // by its exact bits: -0.0 is not 0.0
      std::memcpy(&bits, &d, sizeof(bits));
      out.insert(out.end(), {kDouble, bits});
    } else if (v.isBool()) {
      out.insert(out.end(), {kBool, v.toBool()});
    } else if (v.isInt()) {
      out.insert(out.end(), {kInt, v.toInt()});
    } else if (v.isNone()) {
      out.push_back(kNone);
    } else if (v.isString()) {
      const std::string& s = v.toStringRef();
      out.insert(out.end(), {kString, static_cast<int64_t>(s.size())});
      for (unsigned char c : s) out.push_back(c);
    } else if (v.isIntList()) {
      const std::vector<int64_t> list = v.toIntVector();
      out.insert(out.end(), {kIntList, static_cast<int64_t>(list.size())});
      out.insert(out.end(), list.begin(), list.end());
    } else {
      return false;
    }
  }
  return true;
}

py::object ToPython(const c10::IValue& v) {
  if (v.isNone()) return py::none();
  if (v.isTensor()) return py::cast(v.toTensor());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isString()) return py::str(v.toStringRef());
  if (v.isIntList()) return py::cast(v.toIntVector());
  throw py::type_error("torch_xla_ext: an argument of type " + v.tagKind() +
                       " cannot be passed to an XLA FFI handler");
}

// The element types the handlers' results come in: XLA FFI DataType -> torch.
c10::ScalarType ScalarTypeOf(int64_t dtype) {
  switch (dtype) {
    case XLA_FFI_DataType_PRED: return c10::ScalarType::Bool;
    case XLA_FFI_DataType_S8: return c10::ScalarType::Char;
    case XLA_FFI_DataType_S16: return c10::ScalarType::Short;
    case XLA_FFI_DataType_S32: return c10::ScalarType::Int;
    case XLA_FFI_DataType_S64: return c10::ScalarType::Long;
    case XLA_FFI_DataType_U8: return c10::ScalarType::Byte;
    case XLA_FFI_DataType_F16: return c10::ScalarType::Half;
    case XLA_FFI_DataType_F32: return c10::ScalarType::Float;
    case XLA_FFI_DataType_F64: return c10::ScalarType::Double;
    case XLA_FFI_DataType_BF16: return c10::ScalarType::BFloat16;
    case XLA_FFI_DataType_F8E4M3FN: return c10::ScalarType::Float8_e4m3fn;
  }
  throw py::value_error("torch_xla_ext: no torch dtype for XLA FFI DataType " +
                        std::to_string(dtype));
}

// What a call of one signature passes to the handler (eager.py's describe makes it).
struct PreparedCall {
  struct Operand {
    int argument;       // the schema argument it is, or -1: `absent` is passed
    at::Tensor absent;  // an empty array for an optional argument given as None
    XLA_FFI_DataType dtype;
  };
  struct Result {
    std::vector<int64_t> shape;
    c10::ScalarType scalar_type;
    XLA_FFI_DataType dtype;
    int written_operand;  // the operand whose buffer it is written into (aliasing), or -1
    bool returned;        // false: the handler's workspace, dropped after the call
  };
  XLA_FFI_Handler* handler = nullptr;
  std::vector<Operand> operands;
  std::vector<Result> results;
  eager::Attributes attributes;
};

// describe()'s tuple: (handler address, [(argument, dtype, absent tensor or None)],
// [(shape, dtype, written operand, returned)],
// [(name, dtype or -1 for a string, value bytes)]).
std::shared_ptr<const PreparedCall> Parse(const py::tuple& description) {
  auto call = std::make_shared<PreparedCall>();
  call->handler = reinterpret_cast<XLA_FFI_Handler*>(description[0].cast<uintptr_t>());
  for (py::handle item : description[1]) {
    auto operand = item.cast<py::tuple>();
    call->operands.push_back(PreparedCall::Operand{
        operand[0].cast<int>(),
        operand[2].is_none() ? at::Tensor() : operand[2].cast<at::Tensor>(),
        static_cast<XLA_FFI_DataType>(operand[1].cast<int>())});
  }
  for (py::handle item : description[2]) {
    auto result = item.cast<py::tuple>();
    const int dtype = result[1].cast<int>();
    call->results.push_back(PreparedCall::Result{result[0].cast<std::vector<int64_t>>(),
                                                 ScalarTypeOf(dtype),
                                                 static_cast<XLA_FFI_DataType>(dtype),
                                                 result[2].cast<int>(),
                                                 result[3].cast<bool>()});
  }
  for (py::handle item : description[3]) {
    auto attribute = item.cast<py::tuple>();
    auto name = attribute[0].cast<std::string>();
    const int dtype = attribute[1].cast<int>();
    auto value = attribute[2].cast<std::string>();  // bytes
    if (dtype < 0) {
      call->attributes.AddString(std::move(name), std::move(value));
    } else {
      call->attributes.AddScalar(std::move(name), static_cast<XLA_FFI_DataType>(dtype),
                                 std::move(value));
    }
  }
  call->attributes.Finish();
  return call;
}

// Scratch from torch's caching allocator on the call's stream, so that it is reused only
// after the call's kernels on that stream (and from a graph's private pool under capture).
class CudaScratch final : public eager::ScratchAllocator {
 public:
  explicit CudaScratch(cudaStream_t stream) : stream_(stream) {}
  ~CudaScratch() override {
    for (void* data : live_) c10::cuda::CUDACachingAllocator::raw_delete(data);
  }
  void* Allocate(size_t size, size_t alignment) override {
    if (size == 0) return nullptr;
    void* data = nullptr;
    try {  // must not unwind through the handler
      data = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(size, stream_);
    } catch (const std::exception&) {
      return nullptr;
    }
    if (alignment > 0 && reinterpret_cast<uintptr_t>(data) % alignment != 0) {
      c10::cuda::CUDACachingAllocator::raw_delete(data);
      return nullptr;
    }
    live_.push_back(data);
    return data;
  }
  void Free(void* data) override {
    for (size_t i = 0; i < live_.size(); ++i) {
      if (live_[i] == data) {
        c10::cuda::CUDACachingAllocator::raw_delete(data);
        live_.erase(live_.begin() + i);
        return;
      }
    }
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> live_;
};

XLA_FFI_Buffer BufferOf(const at::Tensor& t, XLA_FFI_DataType dtype) {
  return XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, dtype, t.data_ptr(), t.dim(),
                        const_cast<int64_t*>(t.sizes().data())};
}

// One op's kept calls, shared by its CPU and CUDA kernels.
class OpState {
 public:
  OpState(py::object describe, py::object error_type, bool write_into_arguments)
      : describe_(std::move(describe)),
        error_type_(std::move(error_type)),
        write_into_arguments_(write_into_arguments) {}

  void Run(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    const size_t num_args = op.schema().arguments().size();
    c10::ArrayRef<c10::IValue> args = torch::jit::last(*stack, num_args);
    Signature signature;
    const bool keep = AppendSignature(args, signature);
    std::shared_ptr<const PreparedCall> call = keep ? Find(signature) : nullptr;
    if (call == nullptr) call = Describe(args, keep ? &signature : nullptr);
    std::vector<at::Tensor> results = Execute(*call, args);
    torch::jit::drop(*stack, num_args);
    if (!op.schema().returns().empty()) {
      for (at::Tensor& t : results) torch::jit::push(*stack, std::move(t));
    }
  }

 private:
  static constexpr size_t kMaxKeptCalls = 512;

  std::shared_ptr<const PreparedCall> Find(const Signature& signature) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = kept_.find(signature);
    return it == kept_.end() ? nullptr : it->second;
  }

  // Checks the arguments in Python (a bad argument raises there, and nothing is kept).
  std::shared_ptr<const PreparedCall> Describe(c10::ArrayRef<c10::IValue> args,
                                               const Signature* signature) {
    std::shared_ptr<const PreparedCall> call;
    {
      py::gil_scoped_acquire gil;
      py::tuple values(args.size());
      for (size_t i = 0; i < args.size(); ++i) values[i] = ToPython(args[i]);
      call = Parse(describe_(*values).cast<py::tuple>());
    }
    if (signature != nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_.size() >= kMaxKeptCalls) kept_.clear();
      kept_[*signature] = call;
    }
    return call;
  }

  std::vector<at::Tensor> Execute(const PreparedCall& call, c10::ArrayRef<c10::IValue> args) {
    std::vector<at::Tensor> operands;
    operands.reserve(call.operands.size());
    for (const PreparedCall::Operand& o : call.operands) {
      operands.push_back(o.argument < 0 ? o.absent : args[o.argument].toTensor().contiguous());
    }
    const c10::Device device = operands.at(0).device();
    c10::DeviceGuard device_guard(device);  // the handler launches on the tensors' device
    std::vector<at::Tensor> results;
    results.reserve(call.results.size());
    for (const PreparedCall::Result& r : call.results) {
      if (r.written_operand >= 0) {
        // The handler reads and writes one buffer: XLA's aliasing, done by hand. A functional
        // call writes into a copy; describe() checked that an in-place target is contiguous.
        at::Tensor& target = operands[r.written_operand];
        if (!write_into_arguments_) target = target.clone();
        results.push_back(target);
      } else {
        results.push_back(
            at::empty(r.shape, at::TensorOptions().dtype(r.scalar_type).device(device)));
      }
    }
    std::vector<XLA_FFI_Buffer> arg_buffers, ret_buffers;
    arg_buffers.reserve(operands.size());
    ret_buffers.reserve(results.size());
    for (size_t i = 0; i < operands.size(); ++i) {
      arg_buffers.push_back(BufferOf(operands[i], call.operands[i].dtype));
    }
    for (size_t i = 0; i < results.size(); ++i) {
      ret_buffers.push_back(BufferOf(results[i], call.results[i].dtype));
    }
    std::string error;
    if (device.is_cuda()) {
      cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
      CudaScratch scratch(stream);
      error = eager::Call(call.handler, stream, device.index(), arg_buffers, ret_buffers,
                          call.attributes, scratch);
    } else {
      eager::HostScratch scratch;
      error = eager::Call(call.handler, nullptr, 0, arg_buffers, ret_buffers, call.attributes,
                          scratch);
    }
    if (!error.empty()) {
      py::gil_scoped_acquire gil;
      PyErr_SetString(error_type_.ptr(), error.c_str());
      throw py::error_already_set();
    }
    std::vector<at::Tensor> returned;
    returned.reserve(results.size());
    for (size_t i = 0; i < results.size(); ++i) {
      if (call.results[i].returned) returned.push_back(std::move(results[i]));
    }
    return returned;
  }

  // Never destroyed (see Register), so these need no GIL at exit.
  py::object describe_;
  py::object error_type_;
  const bool write_into_arguments_;
  std::mutex mutex_;
  std::unordered_map<Signature, std::shared_ptr<const PreparedCall>, SignatureHash> kept_;
};

class EagerKernel final : public c10::OperatorKernel {
 public:
  explicit EagerKernel(std::shared_ptr<OpState> state) : state_(std::move(state)) {}
  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    state_->Run(op, stack);
  }

 private:
  std::shared_ptr<OpState> state_;
};

// Makes our handlers the CPU and CUDA kernels of `namespace::name`. `describe(*arguments)`
// checks a call's arguments and returns what Parse reads; handler errors are raised as
// `error_type`.
void Register(const std::string& ns, const std::string& name, py::object describe,
              py::object error_type, bool write_into_arguments) {
  // Kept for the life of the process: the registrations must outlive every call.
  static auto* libraries = new std::vector<std::unique_ptr<torch::Library>>();
  auto state = std::make_shared<OpState>(std::move(describe), std::move(error_type),
                                         write_into_arguments);
  // The dispatcher owns the kernels and may destroy them at exit: one reference more keeps
  // the state, and its Python objects, alive.
  new std::shared_ptr<OpState>(state);
  for (c10::DispatchKey key : {c10::DispatchKey::CPU, c10::DispatchKey::CUDA}) {
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__,
                                                    __LINE__);
    library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                    std::make_unique<EagerKernel>(state)));
    libraries->push_back(std::move(library));
  }
}

}  // namespace
}  // namespace xla_ext::torch_ops

PYBIND11_MODULE(libxla_ext_torch, m) {
  m.doc() = "CPU and CUDA kernels of torch_xla_ext's torch ops (torch_xla_ext/eager.py)";
  m.def("register", &xla_ext::torch_ops::Register, pybind11::arg("namespace"),
        pybind11::arg("name"), pybind11::arg("describe"), pybind11::arg("error_type"),
        pybind11::arg("write_into_arguments"));
}
