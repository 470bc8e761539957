// The greedy pick of a step: each row's argmax over the vocabulary, as torch.argmax picks it (the first
// index of the largest value; a NaN counts as the largest, so the first NaN wins).
//
// torch.argmax on CPU walks a row one value at a time, after a bf16 -> fp32 copy of the logits that
// the sampler makes because bf16 argmax is slower still: over a vocabulary of tens of thousands,
// a visible share of a many-row decode step (see docs/benchmarks.md). Here each row is read once
// in 16-value vectors (8 with AVX2; bf16 widened in registers), each lane keeping
// its largest value and that value's first index, then the lanes are merged (the largest value, the
// smallest index among lanes that hold it). Comparisons only, so the pick is torch's exactly.
//
// Built with the other CPU kernels by cpu_kernel.py; registered as
// torch.ops.inflightq.greedy_argmax; used by worker/engine/sampling/sampler.py for all-greedy steps.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rounding.h"

#include <cmath>
#include <cstdint>

namespace {

using inflightq_rounding::widen;
#if defined(__AVX512F__)
using inflightq_rounding::widen16;
#elif defined(__AVX2__)
using inflightq_rounding::widen8;
#endif

// Values [from, n) of a row after its first `from` values, whose largest is `best` (first at `best_index`).
template <typename scalar_t>
int64_t finish_row(const scalar_t* row, int64_t from, int64_t n, float best, int64_t best_index) {
  for (int64_t i = from; i < n; ++i) {
    const float v = widen(row[i]);
    if (std::isnan(v)) return i;
    if (v > best || best_index < 0) best = v, best_index = i;
  }
  return best_index;
}

#if defined(__AVX512F__)
template <typename scalar_t>
int64_t row_argmax(const scalar_t* row, int64_t n) {
  if (n < 16) return finish_row(row, 0, n, 0.f, -1);
  __m512 best = widen16(row);
  __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  if (nan) return __builtin_ctz(nan);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i best_index = index;
  const int64_t vector_end = n / 16 * 16;
  for (int64_t i = 16; i < vector_end; i += 16) {
    const __m512 v = widen16(row + i);
    index = _mm512_add_epi32(index, step);
    nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    if (nan) return i + __builtin_ctz(nan);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: a tie keeps the earlier index
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const int32_t first = _mm512_mask_reduce_min_epi32(holders, best_index);
  return finish_row(row, vector_end, n, top, first);
}
#elif defined(__AVX2__)
// The same in 8-value vectors (AVX2): comparisons as masks, blends for the lanes' largest and its index.
template <typename scalar_t>
int64_t row_argmax(const scalar_t* row, int64_t n) {
  if (n < 8) return finish_row(row, 0, n, 0.f, -1);
  __m256 best = widen8(row);
  int nan = _mm256_movemask_ps(_mm256_cmp_ps(best, best, _CMP_UNORD_Q));
  if (nan) return __builtin_ctz(nan);
  const __m256i step = _mm256_set1_epi32(8);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i best_index = index;
  const int64_t vector_end = n / 8 * 8;
  for (int64_t i = 8; i < vector_end; i += 8) {
    const __m256 v = widen8(row + i);
    index = _mm256_add_epi32(index, step);
    nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    if (nan) return i + __builtin_ctz(nan);
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strictly: a tie keeps the earlier index
    best = _mm256_blendv_ps(best, v, greater);
    best_index = _mm256_blendv_epi8(best_index, index, _mm256_castps_si256(greater));
  }
  alignas(32) float lanes[8];
  alignas(32) int32_t lane_index[8];
  _mm256_store_ps(lanes, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_index), best_index);
  float top = lanes[0];
  int32_t first = lane_index[0];
  for (int lane = 1; lane < 8; ++lane)
    if (lanes[lane] > top || (lanes[lane] == top && lane_index[lane] < first)) top = lanes[lane], first = lane_index[lane];
  return finish_row(row, vector_end, n, top, first);
}
#else
template <typename scalar_t>
int64_t row_argmax(const scalar_t* row, int64_t n) {
  return finish_row(row, 0, n, 0.f, -1);
}
#endif

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2, "greedy_argmax: CPU logits [rows, vocab]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "greedy_argmax: float32 or bfloat16 logits");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), "greedy_argmax: 1 to 2^31 - 1 logits a row");
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* picks = out.data_ptr<int64_t>();
  AT_DISPATCH_SWITCH(x.scalar_type(), "greedy_argmax",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       const float* base = x.const_data_ptr<float>();
                       at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
                         for (int64_t r = r0; r < r1; ++r) picks[r] = row_argmax(base + r * stride, n);
                       });
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       const c10::BFloat16* base = x.const_data_ptr<c10::BFloat16>();
                       at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
                         for (int64_t r = r0; r < r1; ++r) picks[r] = row_argmax(base + r * stride, n);
                       });
                     }));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflightq, m) {
  m.def("greedy_argmax(Tensor logits) -> Tensor");
  m.impl("greedy_argmax", c10::DispatchKey::CPU, TORCH_FN(greedy_argmax));
}
