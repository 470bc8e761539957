// Paged attention for decode steps on CPU: one query token per sequence, K/V read in place.
//
// The plain-torch path gathers every decode's context out of the paged cache (index_select)
// and then runs two batched matmuls over the copy: at many sequences that is a large share of a
// decode step, mostly memory traffic for the copy. This kernel walks
// each sequence's block table and reads each cached K row once for all the query heads that
// share its kv head (grouped-query attention), and its V rows once (the AVX-512 path for up to four
// query heads of a group at a time), with scores and the softmax in the accumulation type (fp32
// for fp32/bf16/fp16, fp64 for fp64) as the torch path does. With AVX512-BF16 a bf16 cache's scores
// take the bf16 dot product on K as it lies (products exact in fp32, fp32 sums, in another order).
// A context's blocks are asked for one block ahead of use, since they lie scattered over the cache.
//
// Built on first use by cpu_kernel.py (torch.utils.cpp_extension) and
// registered as torch.ops.inflightq.paged_decode, beside torch.ops.inflightq.cache_write.

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd_sums.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// One SIMD register of fp32 lanes; `load` widens bf16 (a bf16 is the top half of an fp32).
#if defined(__AVX512F__)
#define INFLIGHTQ_SIMD 1
struct Vec {
  static constexpr int kLanes = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16))};
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  float sum() const { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define INFLIGHTQ_SIMD 1
struct Vec {
  static constexpr int kLanes = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16))};
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#endif

// The SIMD paths: fp32 accumulation over an fp32 or bf16 cache (fp16 and fp64 take the plain loops).
template <typename acc_t, typename scalar_t>
constexpr bool kSimd =
    std::is_same_v<acc_t, float> && (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>);

// q . k over one head. A plain loop under `omp simd reduction` compiles into vector multiplies
// followed by a chain of dependent scalar adds per token and head; here the lanes are summed by a
// shuffle tree once per dot.
template <typename acc_t, typename scalar_t>
inline acc_t dot(const acc_t* q, const scalar_t* k, int64_t n) {
  int64_t d = 0;
  acc_t total = 0;
#ifdef INFLIGHTQ_SIMD
  if constexpr (kSimd<acc_t, scalar_t>) {
    Vec acc = Vec::zero();
    for (; d + Vec::kLanes <= n; d += Vec::kLanes) acc = Vec::fma(Vec::load(q + d), Vec::load(k + d), acc);
    total = acc.sum();
  }
#endif
  for (; d < n; ++d) total += q[d] * static_cast<acc_t>(k[d]);
  return total;
}

// Asks for a block's first n rows of one kv head (K or V) in L1 ahead of use. Once a worker has
// freed and reused blocks for a while, a context's blocks lie scattered over the cache, and the
// hardware prefetcher loses the stream at every block's edge (2 KB of a 64-wide bf16 head), and
// without this the loops stall on those loads.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* rows, int64_t n, int64_t head_dim) {
  const char* bytes = reinterpret_cast<const char*>(rows);
  const int64_t size = n * head_dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t offset = 0; offset < size; offset += 64) _mm_prefetch(bytes + offset, _MM_HINT_T0);
}

// The rows of the block after the one at `start`, in a context of `len` tokens (none past its end).
template <typename scalar_t>
inline void prefetch_next_block(const scalar_t* head, const int64_t* table, int64_t block_size, int64_t start,
                                int64_t len, int64_t head_dim) {
  const int64_t next = start + block_size;
  if (next < len)
    prefetch_rows(head + table[next / block_size] * block_size * head_dim, std::min(block_size, len - next), head_dim);
}

#if defined(__AVX512F__)
// The scaled scores q . k of every query head of a group against every cached K row of one kv head
// (q: [group][NV * 16] fp32, scores: [group][len]). Four rows at a time, widened once for the whole
// group, and the four dot products of a head summed by one tree (sum4) instead of four
// reductions, one per dot.
template <int NV, typename scalar_t>
void simd_scores(const float* q, int64_t group, const scalar_t* k_head, const int64_t* table, int64_t block_size,
                 int64_t len, float scale, float* scores) {
  constexpr int64_t kDim = NV * 16;
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int64_t start = 0; start < len; start += block_size) {
    prefetch_next_block(k_head, table, block_size, start, len, kDim);
    const int64_t n = std::min(block_size, len - start);
    const scalar_t* k_block = k_head + table[start / block_size] * block_size * kDim;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      __m512 k[4][NV];
      for (int t = 0; t < 4; ++t)
        for (int c = 0; c < NV; ++c) k[t][c] = Vec::load(k_block + (i + t) * kDim + c * 16).v;
      for (int64_t g = 0; g < group; ++g) {
        const float* q_g = q + g * kDim;
        __m512 acc[4];
        const __m512 q0 = _mm512_loadu_ps(q_g);
        for (int t = 0; t < 4; ++t) acc[t] = _mm512_mul_ps(q0, k[t][0]);
        for (int c = 1; c < NV; ++c) {
          const __m512 qc = _mm512_loadu_ps(q_g + c * 16);
          for (int t = 0; t < 4; ++t) acc[t] = _mm512_fmadd_ps(qc, k[t][c], acc[t]);
        }
        const __m128 sums = inflightq_simd::sum4(acc[0], acc[1], acc[2], acc[3]);
        _mm_storeu_ps(scores + g * len + start + i, _mm_mul_ps(sums, scale4));
      }
    }
    for (; i < n; ++i)
      for (int64_t g = 0; g < group; ++g)
        scores[g * len + start + i] = dot(q + g * kDim, k_block + i * kDim, kDim) * scale;
  }
}
#endif

#if defined(__AVX512BF16__)
// The scores of a bf16 cache with AVX512-BF16's dot product: the query's bf16 values (q_bf16:
// [group][NC * 32]) against every cached K row as they lie, 32 pairs per instruction, with no
// widening of K to fp32 first (which took more instructions than the multiplies). Each product of
// two bf16 values is exact in fp32 and the sums are fp32, as on the widened path, in another order.
// Four rows at a time, a head's four sums in one tree (sum4), as simd_scores.
template <int NC>
void bf16_dot_scores(const c10::BFloat16* q_bf16, int64_t group, const c10::BFloat16* k_head, const int64_t* table,
                     int64_t block_size, int64_t len, float scale, float* scores) {
  constexpr int64_t kDim = NC * 32;
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int64_t start = 0; start < len; start += block_size) {
    prefetch_next_block(k_head, table, block_size, start, len, kDim);
    const int64_t n = std::min(block_size, len - start);
    const c10::BFloat16* k_block = k_head + table[start / block_size] * block_size * kDim;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      __m512bh k[4][NC];
      for (int t = 0; t < 4; ++t)
        for (int c = 0; c < NC; ++c) k[t][c] = (__m512bh)_mm512_loadu_si512(k_block + (i + t) * kDim + c * 32);
      for (int64_t g = 0; g < group; ++g) {
        const c10::BFloat16* q_g = q_bf16 + g * kDim;
        __m512 acc[4];
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q_g);
        for (int t = 0; t < 4; ++t) acc[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), k[t][0], q0);
        for (int c = 1; c < NC; ++c) {
          const __m512bh qc = (__m512bh)_mm512_loadu_si512(q_g + c * 32);
          for (int t = 0; t < 4; ++t) acc[t] = _mm512_dpbf16_ps(acc[t], k[t][c], qc);
        }
        const __m128 sums = inflightq_simd::sum4(acc[0], acc[1], acc[2], acc[3]);
        _mm_storeu_ps(scores + g * len + start + i, _mm_mul_ps(sums, scale4));
      }
    }
    for (; i < n; ++i) {
      const c10::BFloat16* k_row = k_block + i * kDim;
      for (int64_t g = 0; g < group; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < NC; ++c)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k_row + c * 32),
                                 (__m512bh)_mm512_loadu_si512(q_bf16 + g * kDim + c * 32));
        scores[g * len + start + i] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  }
}
#endif

// The SIMD scores for head sizes whose rows fit in registers (64 and 128, AVX-512); false, having
// done nothing, where the caller must run the plain loop. ``q_raw``: the group's query rows in the
// cache's dtype, which the bf16 dot-product path reads.
template <typename acc_t, typename scalar_t>
bool simd_group_scores(const acc_t* q, const scalar_t* q_raw, int64_t group, const scalar_t* k_head,
                       const int64_t* table, int64_t block_size, int64_t len, int64_t head_dim, acc_t scale,
                       acc_t* scores) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>) {
    if (head_dim == 64) return bf16_dot_scores<2>(q_raw, group, k_head, table, block_size, len, scale, scores), true;
    if (head_dim == 128) return bf16_dot_scores<4>(q_raw, group, k_head, table, block_size, len, scale, scores), true;
  }
#else
  (void)q_raw;
#endif
#if defined(__AVX512F__)
  if constexpr (kSimd<acc_t, scalar_t>) {
    if (head_dim == 64) return simd_scores<4>(q, group, k_head, table, block_size, len, scale, scores), true;
    if (head_dim == 128) return simd_scores<8>(q, group, k_head, table, block_size, len, scale, scores), true;
  }
#endif
  return false;
}

// o_g = sum_t p_g[t] * v_t over a sequence's cached V rows of one kv head, for GC query heads of its
// group at once (p: [GC][len] at a stride of p_stride, o: [GC][NV * lanes]): each V row is read and
// widened once for all of them, and their NV registers each stay in registers across all rows.
// Every head's sum runs over the rows in order, as a loop per head would.
#ifdef INFLIGHTQ_SIMD
template <int NV, int GC, typename scalar_t>
void simd_weighted_rows(const float* p, int64_t p_stride, const scalar_t* v_head, const int64_t* table,
                        int64_t block_size, int64_t len, float* o) {
  constexpr int64_t kDim = NV * Vec::kLanes;
  Vec acc[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = Vec::zero();
  for (int64_t start = 0; start < len; start += block_size) {
    prefetch_next_block(v_head, table, block_size, start, len, kDim);
    const int64_t n = std::min(block_size, len - start);
    const scalar_t* v_block = v_head + table[start / block_size] * block_size * kDim;
    for (int64_t i = 0; i < n; ++i) {
      Vec v[NV];
      for (int c = 0; c < NV; ++c) v[c] = Vec::load(v_block + i * kDim + c * Vec::kLanes);
      for (int g = 0; g < GC; ++g) {
        const Vec w = Vec::set1(p[g * p_stride + start + i]);
        for (int c = 0; c < NV; ++c) acc[g][c] = Vec::fma(w, v[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c].store(o + g * kDim + c * Vec::kLanes);
}

// Every query head of a group, in runs of up to MAX_GC (as many as the registers hold beside a row).
template <int NV, int MAX_GC, typename scalar_t>
void simd_weighted_heads(const float* p, int64_t group, const scalar_t* v_head, const int64_t* table,
                         int64_t block_size, int64_t len, float* o) {
  constexpr int64_t kDim = NV * Vec::kLanes;
  for (int64_t g0 = 0; g0 < group; g0 += MAX_GC) {
    const float* p_run = p + g0 * len;
    float* o_run = o + g0 * kDim;
    const int64_t run = std::min<int64_t>(MAX_GC, group - g0);
    if constexpr (MAX_GC >= 4)
      if (run == 4) {
        simd_weighted_rows<NV, 4>(p_run, len, v_head, table, block_size, len, o_run);
        continue;
      }
    if constexpr (MAX_GC >= 3)
      if (run == 3) {
        simd_weighted_rows<NV, 3>(p_run, len, v_head, table, block_size, len, o_run);
        continue;
      }
    if constexpr (MAX_GC >= 2)
      if (run == 2) {
        simd_weighted_rows<NV, 2>(p_run, len, v_head, table, block_size, len, o_run);
        continue;
      }
    simd_weighted_rows<NV, 1>(p_run, len, v_head, table, block_size, len, o_run);
  }
}
#endif

// The SIMD weighted sums of every query head of a group (p: [group][len], o: [group][head_dim]), for
// head sizes whose registers fit (64 and 128 on AVX-512, 64 on AVX2); false, having done nothing,
// where the caller must run the plain loop.
template <typename acc_t, typename scalar_t>
bool simd_weighted_sums(const acc_t* p, int64_t group, const scalar_t* v_head, const int64_t* table,
                        int64_t block_size, int64_t len, int64_t head_dim, acc_t* o) {
#ifdef INFLIGHTQ_SIMD
  if constexpr (kSimd<acc_t, scalar_t>) {
    // 32 registers with AVX-512: four heads of 64 or two of 128 beside a row; 16 with AVX2: one.
    if (Vec::kLanes == 16 && head_dim == 64)
      return simd_weighted_heads<4, 4>(p, group, v_head, table, block_size, len, o), true;
    if (Vec::kLanes == 16 && head_dim == 128)
      return simd_weighted_heads<8, 2>(p, group, v_head, table, block_size, len, o), true;
    if (Vec::kLanes == 8 && head_dim == 64)
      return simd_weighted_heads<8, 1>(p, group, v_head, table, block_size, len, o), true;
  }
#endif
  return false;
}

// Softmax's numerator in place, s[t] = exp(s[t] - max(s)); returns the sum. exp is SLEEF's vector
// exp (1 ulp), the one torch's own softmax calls, from libtorch_cpu: a scalar libm exp per score
// would be a large share of the kernel's time.
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
inline float simd_exp_in_place(float* s, int64_t n) {
  __m512 peak_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) peak_v = _mm512_max_ps(peak_v, _mm512_loadu_ps(s + t));
  float peak = _mm512_reduce_max_ps(peak_v);
  for (; t < n; ++t) peak = std::max(peak, s[t]);
  const __m512 shift = _mm512_set1_ps(peak);
  __m512 total_v = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
    _mm512_storeu_ps(s + t, e);
    total_v = _mm512_add_ps(total_v, e);
  }
  float total = _mm512_reduce_add_ps(total_v);
  for (; t < n; ++t) total += (s[t] = std::exp(s[t] - peak));
  return total;
}
#elif defined(__AVX2__) && defined(__FMA__)
extern "C" __m256 Sleef_expf8_u10(__m256);
inline float simd_exp_in_place(float* s, int64_t n) {
  __m256 peak_v = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) peak_v = _mm256_max_ps(peak_v, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, peak_v);
  float peak = *std::max_element(lanes, lanes + 8);
  for (; t < n; ++t) peak = std::max(peak, s[t]);
  const __m256 shift = _mm256_set1_ps(peak);
  __m256 total_v = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
    _mm256_storeu_ps(s + t, e);
    total_v = _mm256_add_ps(total_v, e);
  }
  float total = Vec{total_v}.sum();
  for (; t < n; ++t) total += (s[t] = std::exp(s[t] - peak));
  return total;
}
#endif

template <typename acc_t>
inline acc_t exp_in_place(acc_t* s, int64_t n) {
#ifdef INFLIGHTQ_SIMD
  if constexpr (std::is_same_v<acc_t, float>) return simd_exp_in_place(s, n);
#endif
  acc_t peak = -std::numeric_limits<acc_t>::infinity();
  for (int64_t t = 0; t < n; ++t) peak = std::max(peak, s[t]);
  acc_t total = 0;
  for (int64_t t = 0; t < n; ++t) total += (s[t] = std::exp(s[t] - peak));
  return total;
}

template <typename scalar_t>
void paged_decode_kernel(
    const at::Tensor& query,         // [B, Hq, D] contiguous
    const at::Tensor& k_cache,       // [Hkv, slots, D] contiguous
    const at::Tensor& v_cache,       // [Hkv, slots, D] contiguous
    const at::Tensor& block_table,   // [B, max_blocks] int64 contiguous
    const at::Tensor& context_lens,  // [B] int64
    int64_t block_size,
    double scale,
    at::Tensor& out) {               // [B, Hq, D] contiguous
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(0);
  const int64_t num_slots = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const scalar_t* q_ptr = query.const_data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.const_data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.const_data_ptr<scalar_t>();
  const int64_t* table_ptr = block_table.const_data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.const_data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const acc_t scale_acc = static_cast<acc_t>(scale);

  // One task per (sequence, kv head): it owns `group` query heads and reads that head's K/V once.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> q_acc(group * head_dim);
    std::vector<acc_t> o_acc(group * head_dim);
    std::vector<acc_t> scores;
    std::vector<acc_t> inv_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads;
      const int64_t kv_head = task % num_kv_heads;
      const int64_t len = len_ptr[seq];
      const int64_t* table = table_ptr + seq * max_blocks;
      const scalar_t* k_head = k_ptr + kv_head * num_slots * head_dim;
      const scalar_t* v_head = v_ptr + kv_head * num_slots * head_dim;
      const int64_t first_head = kv_head * group;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* q_row = q_ptr + (seq * num_heads + first_head + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q_acc[g * head_dim + d] = static_cast<acc_t>(q_row[d]);
      }
      scores.resize(group * len);

      // Scores: q . k for every cached token, block by block (tokens of a block are contiguous).
      const scalar_t* q_group = q_ptr + (seq * num_heads + first_head) * head_dim;
      const bool simd_scores = simd_group_scores(q_acc.data(), q_group, group, k_head, table, block_size, len,
                                                 head_dim, scale_acc, scores.data());
      for (int64_t start = 0; start < len && !simd_scores; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const scalar_t* k_block = k_head + table[start / block_size] * block_size * head_dim;
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* k_row = k_block + i * head_dim;
          for (int64_t g = 0; g < group; ++g)
            scores[g * len + start + i] = dot(q_acc.data() + g * head_dim, k_row, head_dim) * scale_acc;
        }
      }

      // Softmax per query head, normalised at the end so the weights stay in acc_t; the first V
      // block is asked for meanwhile.
      prefetch_rows(v_head + table[0] * block_size * head_dim, std::min(block_size, len), head_dim);
      std::fill(o_acc.begin(), o_acc.end(), acc_t(0));
      for (int64_t g = 0; g < group; ++g) {
        inv_sum[g] = acc_t(1) / exp_in_place(scores.data() + g * len, len);
      }

      // Weighted sum of V rows per query head (each row read once for the group, or for runs of its
      // query heads on the SIMD paths).
      const bool simd = simd_weighted_sums(scores.data(), group, v_head, table, block_size, len, head_dim, o_acc.data());
      for (int64_t start = 0; start < len && !simd; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const scalar_t* v_block = v_head + table[start / block_size] * block_size * head_dim;
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* v_row = v_block + i * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const acc_t p = scores[g * len + start + i];
            acc_t* o_g = o_acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) o_g[d] += p * static_cast<acc_t>(v_row[d]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* o_row = out_ptr + (seq * num_heads + first_head + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o_row[d] = static_cast<scalar_t>(o_acc[g * head_dim + d] * inv_sum[g]);
      }
    }
  });
}

void paged_decode(
    const at::Tensor& query,
    const at::Tensor& k_cache,
    const at::Tensor& v_cache,
    const at::Tensor& block_table,
    const at::Tensor& context_lens,
    int64_t block_size,
    double scale,
    at::Tensor out) {
  TORCH_CHECK(query.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be [B, Hq, D] and contiguous");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be [Hkv, slots, D]");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(query.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(k_cache.size(2) == query.size(2), "head dims differ");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.size(0) == query.size(0),
              "block_table must be int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.numel() == query.size(0),
              "context_lens must be int64 [B]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == query.scalar_type(),
              "out must be like query");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  // A bad block id would read outside the cache: check every one in use before touching memory.
  const at::Tensor lens = context_lens.contiguous();
  const int64_t* len_ptr = lens.const_data_ptr<int64_t>();
  const int64_t* table_ptr = block_table.const_data_ptr<int64_t>();
  const int64_t max_blocks = block_table.size(1);
  const int64_t num_blocks = k_cache.size(1) / block_size;
  for (int64_t seq = 0; seq < query.size(0); ++seq) {
    const int64_t len = len_ptr[seq];
    TORCH_CHECK(len >= 1 && len <= max_blocks * block_size, "context length ", len, " out of range for sequence ", seq);
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = table_ptr[seq * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    paged_decode_kernel<scalar_t>(query, k_cache, v_cache, block_table, lens, block_size, scale, out);
  });
}

// Writes a step's K/V ([1, Hkv, T, D], any strides with unit stride along D) into the caches'
// slots ([Hkv, slots, D]). index_copy_ does the same but its fixed cost per call, two calls per
// layer per step, adds up to a visible share of a many-sequence step.
template <typename scalar_t>
void write_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  const int64_t heads = src.size(1), tokens = src.size(2), dim = src.size(3);
  const int64_t sh = src.stride(1), st = src.stride(2);
  const int64_t num_slots = cache.size(1);
  const scalar_t* s = src.const_data_ptr<scalar_t>();
  scalar_t* c = cache.data_ptr<scalar_t>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t t = 0; t < tokens; ++t)
      std::memcpy(c + (h * num_slots + slots[t]) * dim, s + h * sh + t * st, dim * sizeof(scalar_t));
}

// key/value: transformers' layout [1, Hkv, T, D], or the fused layer's token-major [T, Hkv, D].
void cache_write(const at::Tensor& key_in, const at::Tensor& value_in, at::Tensor k_cache, at::Tensor v_cache,
                 const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_in.device().is_cpu(), "cache_write runs on CPU tensors");
  const bool token_major = key_in.dim() == 3;
  const at::Tensor key = token_major ? key_in.transpose(0, 1).unsqueeze(0) : key_in;
  const at::Tensor value = token_major ? value_in.transpose(0, 1).unsqueeze(0) : value_in;
  TORCH_CHECK(key.dim() == 4 && key.size(0) == 1 && key.sizes() == value.sizes(),
              "key/value must be [1, Hkv, T, D] or [T, Hkv, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [Hkv, slots, D]");
  TORCH_CHECK(k_cache.size(0) == key.size(1) && k_cache.size(2) == key.size(3), "key/value and caches differ in shape");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type(),
              "key/value and caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(2),
              "slot_mapping must be int64 [T]");
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.const_data_ptr<int64_t>();
  // A bad slot would write outside the cache: check them all before writing any.
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot_ptr[t] >= 0 && slot_ptr[t] < k_cache.size(1), "slot ", slot_ptr[t], " outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "cache_write", [&] {
    write_rows<scalar_t>(k, k_cache, slot_ptr);
    write_rows<scalar_t>(v, v_cache, slot_ptr);
  });
}

}  // namespace

TORCH_LIBRARY(inflightq, m) {
  m.def("cache_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.impl("cache_write", c10::DispatchKey::CPU, TORCH_FN(cache_write));
  m.def(
      "paged_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor context_lens, "
      "int block_size, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
