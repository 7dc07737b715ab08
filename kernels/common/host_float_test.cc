// host_float.h against the compiler's own IEEE half (_Float16) over every f16 value and
// their rounding midpoints, and bf16 round-to-nearest-even against a double computation.
#include "host_float.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

using xla_ext::host::BFloat16;
using xla_ext::host::FromFloat;
using xla_ext::host::Half;
using xla_ext::host::ToFloat;

namespace {

uint16_t NativeHalfBits(float x) {
  _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

float NativeHalfToFloat(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// bf16 by rounding the exact f32 value to 8 mantissa bits, ties to even, through double.
uint16_t ReferenceBf16(float x) {
  if (std::isnan(x) || std::isinf(x)) return FromFloat<BFloat16>(x).bits;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t truncated = bits & 0xffff0000u;
  float low, high_f;
  std::memcpy(&low, &truncated, 4);
  const uint32_t next = truncated + 0x10000u;
  std::memcpy(&high_f, &next, 4);
  // Past the largest finite bf16 the next value is infinity; measure against 2^128 instead.
  const double high = std::isinf(high_f) ? std::copysign(std::ldexp(1.0, 128), x) : high_f;
  const double dl = std::fabs(static_cast<double>(x) - low);
  const double dh = std::fabs(high - x);
  if (dl < dh) return truncated >> 16;
  if (dh < dl) return next >> 16;
  return ((truncated >> 16) & 1u) ? next >> 16 : truncated >> 16;
}

bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0;
}

}  // namespace

int main() {
  int failures = 0;
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float f = ToFloat(Half{static_cast<uint16_t>(bits)});
    if (!SameFloat(f, NativeHalfToFloat(static_cast<uint16_t>(bits)))) {
      if (failures++ < 5) std::fprintf(stderr, "f16 0x%04x -> %g\n", bits, f);
    }
    if (!std::isnan(f) && FromFloat<Half>(f).bits != bits) {
      if (failures++ < 5) std::fprintf(stderr, "f16 round trip 0x%04x\n", bits);
    }
    // Midpoint to the next f16 value: must round to even like the hardware.
    const float next = NativeHalfToFloat(static_cast<uint16_t>(bits + 1));
    const float mid = static_cast<float>((static_cast<double>(f) + next) / 2);
    if (!std::isnan(f) && !std::isnan(next) && !std::isinf(f) &&
        FromFloat<Half>(mid).bits != NativeHalfBits(mid)) {
      if (failures++ < 5) std::fprintf(stderr, "f16 midpoint after 0x%04x\n", bits);
    }
    const float b = ToFloat(BFloat16{static_cast<uint16_t>(bits)});
    if (!std::isnan(b) && FromFloat<BFloat16>(b).bits != bits) {
      if (failures++ < 5) std::fprintf(stderr, "bf16 round trip 0x%04x\n", bits);
    }
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t bits = any_bits(rng);
    float x;
    std::memcpy(&x, &bits, 4);
    if (std::isnan(x)) continue;
    if (FromFloat<Half>(x).bits != NativeHalfBits(x)) {
      if (failures++ < 5) std::fprintf(stderr, "f16 of %a\n", x);
    }
    if (FromFloat<BFloat16>(x).bits != ReferenceBf16(x)) {
      if (failures++ < 5) std::fprintf(stderr, "bf16 of %a\n", x);
    }
  }
  std::printf("host_float_test: %d mismatches\n", failures);
  return failures == 0 ? 0 : 1;
}
