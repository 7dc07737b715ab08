// Error messages every handler uses: name the op, the argument, what was expected and what
// was given.
#ifndef XLA_EXT_KERNELS_COMMON_ERRORS_H_
#define XLA_EXT_KERNELS_COMMON_ERRORS_H_

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <sstream>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace xla_ext {

namespace ffi = ::xla::ffi;

inline const char* DTypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::S32: return "s32";
    case ffi::DataType::S64: return "s64";
    case ffi::DataType::S8: return "s8";
    case ffi::DataType::U8: return "u8";
    case ffi::DataType::PRED: return "pred";
    case ffi::DataType::F8E4M3FN: return "f8e4m3fn";
    default: return "another dtype";
  }
}

inline std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

// "<op>: argument '<arg>': expected <expected>, got <actual>"
inline ffi::Error ArgumentError(std::string_view op, std::string_view arg,
                                std::string_view expected, std::string_view actual) {
  std::ostringstream out;
  out << op << ": argument '" << arg << "': expected " << expected << ", got " << actual;
  return ffi::Error::InvalidArgument(out.str());
}

inline ffi::Error CheckRank(std::string_view op, std::string_view arg,
                            const ffi::AnyBuffer& buffer, size_t rank) {
  if (buffer.dimensions().size() == rank) return ffi::Error::Success();
  return ArgumentError(op, arg, "rank " + std::to_string(rank),
                       "rank " + std::to_string(buffer.dimensions().size()) + " " +
                           ShapeString(buffer.dimensions()));
}

inline ffi::Error CheckDType(std::string_view op, std::string_view arg,
                             const ffi::AnyBuffer& buffer, ffi::DataType dtype) {
  if (buffer.element_type() == dtype) return ffi::Error::Success();
  return ArgumentError(op, arg, std::string("dtype ") + DTypeName(dtype),
                       std::string("dtype ") + DTypeName(buffer.element_type()));
}

// `buffer` has the shape of `reference`; the message (built only on a mismatch) names both.
inline ffi::Error CheckSameShape(std::string_view op, std::string_view arg,
                                 const ffi::AnyBuffer& buffer, std::string_view reference_arg,
                                 const ffi::AnyBuffer& reference) {
  const auto dims = buffer.dimensions();
  const auto want = reference.dimensions();
  if (dims.size() == want.size() && std::equal(dims.begin(), dims.end(), want.begin())) {
    return ffi::Error::Success();
  }
  return ArgumentError(op, arg,
                       "shape " + ShapeString(want) + " (the shape of '" +
                           std::string(reference_arg) + "')",
                       "shape " + ShapeString(dims));
}

// The workspace result of a CUDA handler that takes its scratch from one (cuda::Workspace):
// bytes, a u8 vector. The Host handlers bind it too (the two platforms' calls are the same).
inline ffi::Error CheckWorkspace(std::string_view op, const ffi::AnyBuffer& workspace) {
  ffi::Error dtype = CheckDType(op, "workspace", workspace, ffi::DataType::U8);
  if (dtype.failure()) return dtype;
  return CheckRank(op, "workspace", workspace, 1);
}

// The dtypes of the ops' float arguments (as XLA_FFI_DataType values, for the ops' contracts).
inline constexpr int64_t kFloatDTypes[] = {XLA_FFI_DataType_F32, XLA_FFI_DataType_F16,
                                           XLA_FFI_DataType_BF16};

// The dtypes a KV cache may hold: the float dtypes, and f8e4m3fn.
inline constexpr int64_t kCacheDTypes[] = {XLA_FFI_DataType_F32, XLA_FFI_DataType_F16,
                                           XLA_FFI_DataType_BF16, XLA_FFI_DataType_F8E4M3FN};

inline bool IsFloatType(ffi::DataType dtype) {
  return std::find(std::begin(kFloatDTypes), std::end(kFloatDTypes),
                   static_cast<int64_t>(dtype)) != std::end(kFloatDTypes);
}

inline ffi::Error CheckFloatType(std::string_view op, std::string_view arg,
                                 const ffi::AnyBuffer& buffer) {
  if (IsFloatType(buffer.element_type())) return ffi::Error::Success();
  return ArgumentError(op, arg, "dtype f32, f16 or bf16",
                       std::string("dtype ") + DTypeName(buffer.element_type()));
}

// A value Check() accepted but no kernel was built for: reported, never run on another kernel.
inline ffi::Error NoKernelError(std::string_view op, std::string_view what,
                                std::string_view value) {
  return ffi::Error::Internal(std::string(op) + ": no kernel for " + std::string(what) + " " +
                              std::string(value));
}

}  // namespace xla_ext

// Returns the error from the enclosing handler when `expr` is not Success.
#define XLA_EXT_RETURN_IF_ERROR(expr)            \
  do {                                           \
    ::xla::ffi::Error xla_ext_error_ = (expr);   \
    if (xla_ext_error_.failure()) return xla_ext_error_; \
  } while (0)

#endif  // XLA_EXT_KERNELS_COMMON_ERRORS_H_
