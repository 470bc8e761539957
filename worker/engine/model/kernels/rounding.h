// Conversions between the model's dtype and fp32 for the CPU kernels, with torch's rounding.
//
// c10's BFloat16 conversions are scalar (a NaN branch per value); these are the same rounding
// (to nearest even, NaN kept quiet) written so the compiler vectorizes the loops that use them.
// Included by the kernels beside it (built together by cpu_kernel.py, whose build key hashes this
// header too).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
// The same on 16 lanes. widen16: 16 bf16 values as fp32 (each the top half of an fp32).
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }

// bf16_bits on 16 lanes: round to nearest even, NaN -> 0x7FC0; the bits in each lane's low half.
inline __m512i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// round_to<BFloat16> on 16 lanes.
inline __m512 bf16_round16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16)); }
#elif defined(__AVX2__)
// widen8: 8 bf16 values as fp32 (AVX2).
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
#endif

}  // namespace inflightq_rounding
