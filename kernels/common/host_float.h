// f16 and bf16 on the CPU: conversions to and from f32, rounding to nearest even as the GPU
// and PyTorch do, so Host handlers give the same bits as the reference.
#ifndef XLA_EXT_KERNELS_COMMON_HOST_FLOAT_H_
#define XLA_EXT_KERNELS_COMMON_HOST_FLOAT_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/common/errors.h"
#include "xla/ffi/api/ffi.h"

namespace xla_ext::host {

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

inline float BitsToFloat(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float ToFloat(float x) { return x; }

inline float ToFloat(BFloat16 x) { return BitsToFloat(uint32_t{x.bits} << 16); }

inline float ToFloat(Half x) {
  const uint32_t sign = uint32_t{x.bits & 0x8000u} << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1f;
  const uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24.
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return sign ? -magnitude : magnitude;
}

template <typename T>
T FromFloat(float x);

template <>
inline float FromFloat<float>(float x) { return x; }

template <>
inline BFloat16 FromFloat<BFloat16>(float x) {
  uint32_t bits = FloatToBits(x);
  if (std::isnan(x)) return BFloat16{static_cast<uint16_t>((bits >> 16) | 0x40u)};
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(bits >> 16)};
}

template <>
inline Half FromFloat<Half>(float x) {
  const uint32_t bits = FloatToBits(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits >= 0x7f800000u) {  // inf or nan
    return Half{static_cast<uint16_t>(sign | 0x7c00u | (abs_bits > 0x7f800000u ? 0x200u : 0u))};
  }
  if (abs_bits >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow
  if (abs_bits < 0x38800000u) {  // result is subnormal or zero: round |x| * 2^24 to an integer
    const float scaled = BitsToFloat(abs_bits) * 16777216.0f;
    return Half{static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)))};
  }
  uint32_t rounded = abs_bits + 0xfffu + ((abs_bits >> 13) & 1u);
  return Half{static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
}

// Calls fn(T{}) with T the host element type of a float dtype (f32, f16 or bf16); any other
// dtype is an error naming `op` (Check() rejects those first: reaching it is a bug).
template <typename Fn>
::xla::ffi::Error DispatchFloat(std::string_view op, ::xla::ffi::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case ::xla::ffi::DataType::F32: fn(float{}); break;
    case ::xla::ffi::DataType::F16: fn(Half{}); break;
    case ::xla::ffi::DataType::BF16: fn(BFloat16{}); break;
    default: return NoKernelError(op, "dtype", DTypeName(dtype));
  }
  return ::xla::ffi::Error::Success();
}

}  // namespace xla_ext::host

#endif  // XLA_EXT_KERNELS_COMMON_HOST_FLOAT_H_
