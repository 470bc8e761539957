// Conversions between the model's dtype and fp32 for the CPU kernels, with torch's rounding.
//
// c10's BFloat16 conversions are scalar (a NaN branch per value); these are the same rounding
// (to nearest even, NaN kept quiet) written so the compiler vectorizes the loops that use them.
// Included by rms_norm.cpp, decoder_layer_ops.cpp and decode_linear.cpp (built together by
// attention/cpu_kernel.py, whose build key hashes this header too).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace inflightq_rounding {

inline float widen(c10::BFloat16 v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v.x) << 16); }
inline float widen(float v) { return v; }
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen_bf16_bits(uint16_t v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16); }

inline uint16_t bf16_bits(float v) {  // round to nearest even, NaN kept quiet (as c10::BFloat16)
  const uint32_t bits = __builtin_bit_cast(uint32_t, v);
  return v != v ? 0x7FC0u : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

template <typename scalar_t>
inline scalar_t narrow(float v) {
  return static_cast<scalar_t>(v);
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float v) {
  c10::BFloat16 out;
  out.x = bf16_bits(v);
  return out;
}

template <typename scalar_t>
inline float round_to(float v) {  // v rounded to scalar_t, as a float
  return widen(narrow<scalar_t>(v));
}

}  // namespace inflightq_rounding
