// A step's sampled rows (temperature > 0) drawn in one op: temperature, top_k, top_p and min_p, then
// the inverse-CDF draw of one uniform number per row, on the model's bf16 or fp32 logits.
//
// The torch path (sampler.py, sampling_filters.py) runs a dozen ops over [rows, vocab]: an fp32 copy of
// bf16 logits, the division by the temperature, softmax, cumsum, searchsorted, and for top_p a topk or
// a full sort: a visible share of a many-row decode step (see docs/benchmarks.md). Here each row is read
// a few times in place, in parallel over rows, and nothing over the vocabulary is sorted:
//
//   1. y = x / temperature (fp32, torch's rounding), and its max M.
//   2. top_k: the k-th largest y by a 4096-bucket histogram of y's order-preserving bits, then a
//      selection inside the one bucket that holds it. Ties with the k-th are kept (HF's rule).
//   3. w = exp(y - M) for what top_k keeps, 0 for the rest: softmax's numerators.
//   4. top_p: a token is kept when the mass of strictly larger weights is below top_p of the total
//      (sampling_filters._top_p_full's rule, with ties decided by value rather than by a sort's order),
//      found from per-bucket masses and a sort of the one bucket the boundary falls in.
//   5. min_p: weights below min_p times the largest (exp(0) = 1) are dropped.
//   6. The draw: target = u * total; the first token whose running sum passes it, found through sums
//      of BLOCK weights, then within one block. Sums are in double, and the in-block walk adds in the
//      block sum's own order, so the walk always ends inside the block and only on a token of
//      positive weight.
//
// typical_p needs the entropy of what top_k..min_p leave and a sort by distance to it; rows with it
// take the torch path. Built with the other CPU kernels by cpu_kernel.py;
// registered as torch.ops.inflightq.sample_rows; used by worker/engine/sampling/sampler.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rounding.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using inflightq_rounding::widen;

constexpr int64_t BLOCK = 256;
constexpr int64_t SLACK = 16;  // floats of room past a buffer's n: vector stores may write a whole vector
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(v - shift) for n values in place: SLEEF's vector exp from libtorch_cpu (torch's own softmax
// calls it) where the build has the vector width, libm's for the rest.
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
inline void exp_shifted(float* v, int64_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(v + i), s)));
  for (; i < n; ++i) v[i] = std::exp(v[i] - shift);
}
#elif defined(__AVX2__) && defined(__FMA__)
extern "C" __m256 Sleef_expf8_u10(__m256);
inline void exp_shifted(float* v, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(v + i), s)));
  for (; i < n; ++i) v[i] = std::exp(v[i] - shift);
}
#else
inline void exp_shifted(float* v, int64_t n, float shift) {
  for (int64_t i = 0; i < n; ++i) v[i] = std::exp(v[i] - shift);
}
#endif


#if defined(__AVX512F__)
// The lanes of x in `keep`, packed, at out (all 16 lanes are written: buffers have SLACK floats of
// room past their n). Compressing into a register and storing the whole vector, not
// _mm512_mask_compressstoreu_ps: that store to memory is microcoded on AMD Zen 4, many times slower.
inline void store_compressed(float* out, __mmask16 keep, __m512 x) {
  _mm512_storeu_ps(out, _mm512_maskz_compress_ps(keep, x));
}

// acc (8 doubles) + the 16 floats of x, widened: the sums of weights are kept in double.
inline __m512d add_widened(__m512d acc, __m512 x) {
  acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
  return _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
}
#endif

// The values of v[0..n) that are >= floor, into `out` (room for n + SLACK); returns how many, and their sum.
std::pair<int64_t, double> gather_at_least(const float* v, int64_t n, float floor, float* out) {
  int64_t count = 0, i = 0;
  double sum = 0.0;
#if defined(__AVX512F__)
  const __m512 f = _mm512_set1_ps(floor);
  __m512d acc = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(v + i);
    const __mmask16 hit = _mm512_cmp_ps_mask(x, f, _CMP_GE_OQ);
    if (!hit) continue;
    store_compressed(out + count, hit, x);
    count += __builtin_popcount(hit);
    const __m512 kept = _mm512_maskz_mov_ps(hit, x);
    acc = add_widened(acc, kept);
  }
  sum = _mm512_reduce_add_pd(acc);
#endif
  for (; i < n; ++i)
    if (v[i] >= floor) out[count++] = v[i], sum += v[i];
  return {count, sum};
}

// y[i] = -inf where y[i] < cut.
void drop_below(float* y, int64_t n, float cut) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 c = _mm512_set1_ps(cut), ninf = _mm512_set1_ps(NEG_INF);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(y + i);
    _mm512_storeu_ps(y + i, _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, c, _CMP_LT_OQ), ninf));
  }
#endif
  for (; i < n; ++i)
    if (y[i] < cut) y[i] = NEG_INF;
}

// a[0..n) split around `pivot`: the larger values into `larger`, the smaller into `smaller` (each with
// room for n + SLACK; their order is lost). Branch-free, so a pass costs a few cycles per 16 values
// whatever the data.
struct Split {
  int64_t larger = 0, equal = 0, smaller = 0;
  double larger_sum = 0.0;
};
Split split(const float* a, int64_t n, float pivot, float* larger, float* smaller) {
  Split s;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 p = _mm512_set1_ps(pivot);
  __m512d acc = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(a + i);
    const __mmask16 gt = _mm512_cmp_ps_mask(x, p, _CMP_GT_OQ), lt = _mm512_cmp_ps_mask(x, p, _CMP_LT_OQ);
    store_compressed(larger + s.larger, gt, x);
    s.larger += __builtin_popcount(gt);
    store_compressed(smaller + s.smaller, lt, x);
    s.smaller += __builtin_popcount(lt);
    const __m512 big = _mm512_maskz_mov_ps(gt, x);
    acc = add_widened(acc, big);
  }
  s.larger_sum = _mm512_reduce_add_pd(acc);
#endif
  for (; i < n; ++i) {
    if (a[i] > pivot) {
      larger[s.larger++] = a[i];
      s.larger_sum += a[i];
    } else if (a[i] < pivot) {
      smaller[s.smaller++] = a[i];
    }
  }
  s.equal = n - s.larger - s.smaller;
  return s;
}

// Three buffers a quickselect rotates through: the values it works on, and room for both parts.
struct Buffers {
  float* values;
  float* room[2];
  // The next round works on `part` (one of room[]); the buffer it leaves becomes room.
  void work_on(int part) { std::swap(values, room[part]); }
};

inline float median3(const float* a, int64_t n) {
  const float x = a[0], y = a[n / 2], z = a[n - 1];
  return std::max(std::min(x, y), std::min(std::max(x, y), z));
}

// The k-th largest (1 <= k <= n) of buffers.values[0..n), a quickselect over split(); every buffer
// is overwritten.
float kth_largest_of(Buffers buffers, int64_t n, int64_t k) {
  while (true) {
    const float pivot = median3(buffers.values, n);
    const Split s = split(buffers.values, n, pivot, buffers.room[0], buffers.room[1]);
    if (k <= s.larger) {
      n = s.larger;
      buffers.work_on(0);
    } else if (k <= s.larger + s.equal) {
      return pivot;
    } else {
      k -= s.larger + s.equal;
      n = s.smaller;
      buffers.work_on(1);
    }
  }
}

// The k-th largest of y[0..n) (1 <= k < n), whose largest is `top`. A request's top_k is small next to
// the vocabulary: the values within 8 of the top (a weight ratio of e^-8) usually number k or more,
// and the selection runs among them only.
float kth_largest(const float* y, int64_t n, int64_t k, float top, Buffers buffers) {
  int64_t count = gather_at_least(y, n, top - 8.f, buffers.values).first;
  if (count < k) count = gather_at_least(y, n, NEG_INF, buffers.values).first;
  return kth_largest_of(buffers, count, k);
}

// Of the weights buffers.values[0..n), the least one whose strictly larger weights hold less than
// `limit`: top_p's threshold. Equal weights stand or fall together. A quickselect by mass over
// split(), expected linear; every buffer is overwritten.
float select_by_mass(Buffers buffers, int64_t n, double limit) {
  double above = 0.0;  // the mass of the weights larger than every one still in play
  while (n > 0) {
    const float pivot = median3(buffers.values, n);
    const Split s = split(buffers.values, n, pivot, buffers.room[0], buffers.room[1]);
    if (above + s.larger_sum >= limit) {  // the pivot is dropped; the boundary is among the larger ones
      n = s.larger;
      buffers.work_on(0);
    } else {
      above += s.larger_sum + static_cast<double>(pivot) * static_cast<double>(s.equal);  // the pivot is kept
      if (above >= limit || s.smaller == 0) return pivot;
      n = s.smaller;
      buffers.work_on(1);
    }
  }
  return 0.f;  // not reached: the caller's weights hold the limit
}

// The smallest weight top_p keeps, of weights w in [0, 1] (0: already dropped). The nucleus is
// usually among the weights above 1e-4 of the largest (which is 1): those are gathered and selected
// among; when they hold less than the limit, every positive weight is.
float top_p_threshold(const float* w, int64_t n, double limit, Buffers buffers) {
  auto [count, gathered] = gather_at_least(w, n, 1e-4f, buffers.values);
  if (gathered < limit)
    std::tie(count, gathered) = gather_at_least(w, n, std::numeric_limits<float>::denorm_min(), buffers.values);
  if (gathered < limit) return 0.f;  // rounding left the mass short of the limit: keep every token
  return select_by_mass(buffers, count, limit);
}

// y = x / temperature (a NaN as -inf: never drawn) into y; returns the largest.
template <typename scalar_t>
float tempered(const scalar_t* x, int64_t n, float temperature, float* y) {
  float top = NEG_INF;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(temperature), ninf = _mm512_set1_ps(NEG_INF);
  __m512 best = ninf;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_div_ps(inflightq_rounding::widen16(x + i), t);
    v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), ninf);
    _mm512_storeu_ps(y + i, v);
    best = _mm512_max_ps(best, v);
  }
  top = _mm512_reduce_max_ps(best);
#endif
  for (; i < n; ++i) {
    float v = widen(x[i]) / temperature;
    if (v != v) v = NEG_INF;
    y[i] = v;
    top = std::max(top, v);
  }
  return top;
}

// Zeroes the weights below `keep` and returns each BLOCK's sum (and the total) in double.
double block_sums(float* w, int64_t n, float keep, std::vector<double>& sums) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  sums.assign(blocks, 0.0);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = std::min(n, (b + 1) * BLOCK);
    int64_t i = b * BLOCK;
    double sum = 0.0;
#if defined(__AVX512F__)
    const __m512 k = _mm512_set1_ps(keep);
    __m512d acc = _mm512_setzero_pd();
    for (; i + 16 <= end; i += 16) {
      const __m512 v = _mm512_loadu_ps(w + i);
      const __m512 kept = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, k, _CMP_GE_OQ), v);
      _mm512_storeu_ps(w + i, kept);
      acc = add_widened(acc, kept);
    }
    sum = _mm512_reduce_add_pd(acc);
#endif
    for (; i < end; ++i) {
      if (w[i] < keep) w[i] = 0.f;
      sum += w[i];
    }
    sums[b] = sum;
    total += sum;
  }
  return total;
}

// A row's working memory, allocated once per thread and reused: the weights, the candidates the
// filters look at, and the draw's block sums.
struct Scratch {
  std::unique_ptr<float[]> w, selection[3];
  int64_t capacity = 0;
  std::vector<double> sums;
  void fit(int64_t n) {
    if (n <= capacity) return;
    w.reset(new float[n + SLACK]);
    for (auto& buffer : selection) buffer.reset(new float[n + SLACK]);
    capacity = n;
  }
  Buffers buffers() { return {selection[0].get(), {selection[1].get(), selection[2].get()}}; }
};

template <typename scalar_t>
int64_t sample_row(const scalar_t* x, int64_t n, float temperature, int64_t top_k, double top_p, float min_p,
                   double u, Scratch& scratch) {
  scratch.fit(n);
  float* w = scratch.w.get();
  const float top = tempered(x, n, temperature, w);
  if (top == NEG_INF) return 0;  // nothing drawable (every logit NaN or -inf): stay in range
  if (top == std::numeric_limits<float>::infinity())
    return std::find(w, w + n, top) - w;  // an infinite logit takes all the mass
  if (top_k > 0 && top_k < n) drop_below(w, n, kth_largest(w, n, top_k, top, scratch.buffers()));
  exp_shifted(w, n, top);  // softmax's numerators; -inf -> 0
  float keep = min_p > 0.f ? min_p : 0.f;  // min_p: w >= min_p * max(w), and max(w) = exp(0) = 1
  std::vector<double>& sums = scratch.sums;
  if (top_p < 1.0) {
    const double total = block_sums(w, n, 0.f, sums);
    // Filters apply in order on what the previous ones left: min_p compares with the same largest
    // weight whatever top_p dropped, so the larger of the two thresholds is the same as one then the other.
    keep = std::max(keep, top_p_threshold(w, n, top_p * total, scratch.buffers()));
  }
  const double total = block_sums(w, n, keep, sums);
  const double target = u * total;
  double before = 0.0;
  const int64_t blocks = static_cast<int64_t>(sums.size());
  for (int64_t b = 0; b < blocks; ++b) {
    if (before + sums[b] > target || b == blocks - 1) {
      // The walk adds one by one, the block sum added in lanes: the last kept token of the block
      // stands for the last ~1e-16 of its mass that the two roundings may disagree on.
      const int64_t end = std::min(n, (b + 1) * BLOCK);
      int64_t last = -1;
      double local = 0.0;
      for (int64_t i = b * BLOCK; i < end; ++i) {
        if (w[i] <= 0.f) continue;
        last = i;
        local += w[i];
        if (before + local > target) return i;
      }
      if (last >= 0) return last;
    }
    before += sums[b];
  }
  for (int64_t i = n - 1; i > 0; --i)  // rounding ran past the last block's mass: the last kept token
    if (w[i] > 0.f) return i;
  return 0;
}

// One sampled row's settings, a row of the float64 `settings` tensor (one tensor, not five: at one
// row the op's cost is of the order of building its arguments in Python).
enum Setting { TEMPERATURE, TOP_K, TOP_P, MIN_P, UNIFORM, SETTINGS };

template <typename scalar_t>
void sample_all(const at::Tensor& x, const int64_t* id, const double* settings, int64_t m, int64_t* picks) {
  const scalar_t* base = x.const_data_ptr<scalar_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    // Per thread and kept across calls (the pool's threads live as long as the process): a step
    // does not allocate four vocabulary-sized buffers again.
    thread_local Scratch scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const double* s = settings + r * SETTINGS;
      // The temperature and min_p as the torch path holds them (fp32 tensors), top_p as a double.
      picks[r] = sample_row(base + id[r] * stride, n, static_cast<float>(s[TEMPERATURE]),
                            static_cast<int64_t>(s[TOP_K]), s[TOP_P], static_cast<float>(s[MIN_P]), s[UNIFORM],
                            scratch);
    }
  });
}

// logits [rows, vocab] (fp32 or bf16, rows may be strided); row_ids [m] int64: the rows to draw for;
// settings [m, 5] float64: each one's temperature (> 0), top_k (0: off), top_p (1: off), min_p (0: off)
// and its number u in [0, 1). Returns the m tokens.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& row_ids, const at::Tensor& settings) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2, "sample_rows: CPU logits [rows, vocab]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "sample_rows: float32 or bfloat16 logits");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), "sample_rows: 1 to 2^31 - 1 logits a row");
  const int64_t m = row_ids.numel();
  TORCH_CHECK(row_ids.dim() == 1 && row_ids.scalar_type() == at::kLong, "sample_rows: row_ids, int64 [m]");
  TORCH_CHECK(settings.dim() == 2 && settings.size(0) == m && settings.size(1) == SETTINGS &&
                  settings.scalar_type() == at::kDouble,
              "sample_rows: settings, float64 [m, 5], one row per sampled row");
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const at::Tensor ids = row_ids.contiguous(), values = settings.contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const double* s = values.const_data_ptr<double>();
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(id[r] >= 0 && id[r] < x.size(0), "sample_rows: row id out of range");
    TORCH_CHECK(s[r * SETTINGS + TEMPERATURE] > 0.0, "sample_rows: temperature must be > 0");
    TORCH_CHECK(s[r * SETTINGS + UNIFORM] >= 0.0 && s[r * SETTINGS + UNIFORM] < 1.0, "sample_rows: u in [0, 1)");
  }
  at::Tensor out = at::empty({m}, logits.options().dtype(at::kLong));
  int64_t* picks = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat)
    sample_all<float>(x, id, s, m, picks);
  else
    sample_all<c10::BFloat16>(x, id, s, m, picks);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflightq, m) {
  m.def("sample_rows(Tensor logits, Tensor row_ids, Tensor settings) -> Tensor");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
}
