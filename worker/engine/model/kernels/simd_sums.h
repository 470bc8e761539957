// Horizontal sums of several SIMD accumulators at once, for the CPU kernels.
//
// A kernel that ends each dot product with _mm512_reduce_add_ps pays a chain of dependent
// instructions per sum; one tree of adds sums four accumulators for not much more than one.
// Included by decode_linear.cpp and paged_decode.cpp (built together by cpu_kernel.py, whose build
// key hashes this header too).
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace inflightq_simd {

#if defined(__AVX512F__)

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

#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same for four 8-lane accumulators (AVX2): [sum(a), sum(b), sum(c), sum(d)].
inline __m128 sum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  // In each 128-bit half: [a0+a1, a2+a3, b0+b1, b2+b3] and the same for c, d; then their pairs summed
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

}  // namespace inflightq_simd
