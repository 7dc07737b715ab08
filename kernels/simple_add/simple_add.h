// XlaGpuSimpleAdd: out = a + b, elementwise, any shape (empty included), f32, f16 or bf16.
// The target keeps the user's original name verbatim.
#ifndef XLA_EXT_KERNELS_SIMPLE_ADD_SIMPLE_ADD_H_
#define XLA_EXT_KERNELS_SIMPLE_ADD_SIMPLE_ADD_H_

#include <utility>

#include "kernels/common/contract.h"
#include "kernels/common/errors.h"

namespace xla_ext::simple_add {

inline constexpr char kTarget[] = "XlaGpuSimpleAdd";

// The op's contract (kernels/common/contract.h): the dtypes Check accepts.
inline constexpr XlaExtSupportedValues kSupported[] = {
    contract::Supported("dtype", "a", kFloatDTypes),
};

inline ffi::Error Check(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                        const ffi::AnyBuffer& out) {
  XLA_EXT_RETURN_IF_ERROR(CheckFloatType(kTarget, "a", a));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "b", b, a.element_type()));
  XLA_EXT_RETURN_IF_ERROR(CheckDType(kTarget, "out", out, a.element_type()));
  XLA_EXT_RETURN_IF_ERROR(CheckSameShape(kTarget, "b", b, "a", a));
  return CheckSameShape(kTarget, "out", out, "a", a);
}

// Both platforms bind the same signature: two inputs, one result.
template <typename Binding>
auto Bind(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

}  // namespace xla_ext::simple_add

#endif  // XLA_EXT_KERNELS_SIMPLE_ADD_SIMPLE_ADD_H_
