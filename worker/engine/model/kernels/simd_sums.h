// Horizontal sums of several SIMD accumulators at once, for the CPU kernels.
//
// A kernel that ends each dot product with _mm512_reduce_add_ps pays a chain of dependent
// instructions per sum; one tree of adds sums four accumulators for not much more than one.
// Included by decode_linear.cpp and paged_decode.cpp (built together by cpu_kernel.py, whose build
// key hashes this header too).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace inflightq_simd {

// The 16-lane sums of four accumulators as one 4-lane vector: [sum(a), sum(b), sum(c), sum(d)].
// One tree of adds for all four (pairs of lanes, then across the 128-bit quarters).
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // In each 128-bit quarter: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // In each quarter: [a, b, c, d] summed over its four lanes
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

}  // namespace inflightq_simd
#endif
