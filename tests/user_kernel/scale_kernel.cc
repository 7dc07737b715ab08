// A user's own kernel library, built outside kernels/ the way the README shows:
//   g++ -shared -fPIC -std=c++17 $(includes from torch_xla_ext.get_include()) scale_kernel.cc
// out = x * factor, f32, any shape; `factor` is a typed FFI attribute.
//
// ScaleCheck is the call's one check: torch_xla_ext runs it at the call (a bad call raises
// there and records nothing) and the handler runs it again, so both accept the same calls.
#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_ext/registry.h"

namespace ffi = xla::ffi;

namespace {

std::string DtypeName(int32_t dtype) {
  switch (dtype) {
    case XLA_FFI_DataType_F16: return "f16";
    case XLA_FFI_DataType_BF16: return "bf16";
    case XLA_FFI_DataType_F32: return "f32";
    case XLA_FFI_DataType_F64: return "f64";
    case XLA_FFI_DataType_S32: return "s32";
    case XLA_FFI_DataType_S64: return "s64";
    default: return "XLA FFI dtype " + std::to_string(dtype);
  }
}

std::string Dims(const XlaExtOperandShape& operand) {
  std::string text = "[";
  for (uint32_t i = 0; i < operand.rank; ++i) {
    text += (i ? ", " : "") + std::to_string(operand.dims[i]);
  }
  return text + "]";
}

// Operands: x, then the result out (kernel_table.h's order: arguments, then results).
const char* ScaleCheck(const XlaExtCallShape* call) {
  thread_local std::string message;
  if (call->num_operands != 2) {
    message = "expected 1 argument (x) and 1 result (out), got " +
              std::to_string(call->num_operands) + " operands";
    return message.c_str();
  }
  const XlaExtOperandShape& x = call->operands[0];
  const XlaExtOperandShape& out = call->operands[1];
  for (const auto& [name, operand] : {std::pair{"x", x}, std::pair{"out", out}}) {
    if (operand.dtype != XLA_FFI_DataType_F32) {
      message = std::string("argument '") + name + "': expected dtype f32, got " +
                DtypeName(operand.dtype);
      return message.c_str();
    }
  }
  if (Dims(out) != Dims(x)) {
    message = "argument 'out': expected the shape of 'x', " + Dims(x) + ", got " + Dims(out);
    return message.c_str();
  }
  for (uint32_t i = 0; i < call->num_attributes; ++i) {
    const XlaExtScalarAttribute& attribute = call->attributes[i];
    if (std::string(attribute.name) != "factor") continue;
    if (attribute.dtype == XLA_FFI_DataType_F32) return nullptr;
    message = "attribute 'factor': expected a float (f32), got " + DtypeName(attribute.dtype);
    return message.c_str();
  }
  message = "attribute 'factor': expected a float, got no attribute of that name";
  return message.c_str();
}

XlaExtOperandShape ShapeOf(XLA_FFI_DataType dtype, ffi::Span<const int64_t> dims) {
  return XlaExtOperandShape{dtype, static_cast<uint32_t>(dims.size()), dims.begin()};
}

ffi::Error Scale(ffi::Buffer<ffi::F32> x, float factor, ffi::ResultBuffer<ffi::F32> out) {
  const XlaExtOperandShape operands[] = {ShapeOf(XLA_FFI_DataType_F32, x.dimensions()),
                                         ShapeOf(XLA_FFI_DataType_F32, out->dimensions())};
  const XlaExtScalarAttribute attributes[] = {{"factor", XLA_FFI_DataType_F32, factor}};
  const XlaExtCallShape call{2, operands, 1, attributes};
  if (const char* message = ScaleCheck(&call)) {
    return ffi::Error::InvalidArgument(std::string("user.scale: ") + message);
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  for (int64_t i = 0; i < n; ++i) out->typed_data()[i] = x.typed_data()[i] * factor;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kScale, Scale,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Attr<float>("factor")
                           .Ret<ffi::Buffer<ffi::F32>>());

XLA_EXT_REGISTER_KERNEL("user.scale", "Host", kScale, XLA_EXT_NO_TRAITS);
XLA_EXT_REGISTER_CHECK("user.scale", ScaleCheck);
