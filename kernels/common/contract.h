// An op's contract in C++ (xla_ext/kernel_table.h's XlaExtContract): the lists of values its
// sizes and dtypes may take, declared once in the op's header, and the helpers that make its
// checks, its error messages, its kernels' dispatch and its workspace query from those lists.
#ifndef XLA_EXT_KERNELS_COMMON_CONTRACT_H_
#define XLA_EXT_KERNELS_COMMON_CONTRACT_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/c_api.h"
#include "xla_ext/kernel_table.h"

namespace xla_ext::contract {

template <size_t N>
constexpr bool Contains(const int64_t (&values)[N], int64_t value) {
  for (int64_t v : values) {
    if (v == value) return true;
  }
  return false;
}

// "8, 16 or 32", as the handlers' error messages list the values.
template <size_t N>
std::string OneOf(const int64_t (&values)[N]) {
  std::string text;
  for (size_t i = 0; i < N; ++i) {
    text += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::to_string(values[i]);
  }
  return text;
}

template <size_t N>
constexpr XlaExtSupportedValues Supported(const char* name, const char* argument,
                                          const int64_t (&values)[N]) {
  return XlaExtSupportedValues{name, argument, static_cast<uint32_t>(N), values};
}

template <const auto& kValues, typename Fn, size_t... I>
bool DispatchIndexed(int64_t value, Fn& fn, std::index_sequence<I...>) {
  return ((value == kValues[I] &&
           (fn(std::integral_constant<int, static_cast<int>(kValues[I])>{}), true)) ||
          ...);
}

// Calls fn(std::integral_constant<int, value>{}) where `value` is one of kValues, so that the
// kernels are instantiated for exactly the values the contract lists; false for another value.
template <const auto& kValues, typename Fn>
bool Dispatch(int64_t value, Fn&& fn) {
  return DispatchIndexed<kValues>(value, fn, std::make_index_sequence<std::size(kValues)>{});
}

// A workspace query's operand i as a buffer without data, for the handler's checks.
inline XLA_FFI_Buffer OperandBuffer(const XlaExtCallShape& call, uint32_t i) {
  const XlaExtOperandShape& operand = call.operands[i];
  return XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr,
                        static_cast<XLA_FFI_DataType>(operand.dtype), nullptr,
                        static_cast<int64_t>(operand.rank), const_cast<int64_t*>(operand.dims)};
}

// A workspace query's attribute `name`, or `missing` where the call has none of that name.
inline double Attribute(const XlaExtCallShape& call, const char* name, double missing) {
  for (uint32_t i = 0; i < call.num_attributes; ++i) {
    if (std::strcmp(call.attributes[i].name, name) == 0) return call.attributes[i].value;
  }
  return missing;
}

}  // namespace xla_ext::contract

#endif  // XLA_EXT_KERNELS_COMMON_CONTRACT_H_
