// A step's LoRA deltas for one projection group (q/k/v, o, gate/up or down) as one op: each row with
// its own adapter's A and B, rows of several adapters and of none in one call.
//
//   lora_rows(y, x, slots, table, bounds, weights_dtype): for each row i with slots[i] = s >= 0 and
//   each projection p of the group (its columns bounds[2p]:bounds[2p+1] of y), with the weights of
//   table row s*P+p: A [r, in] and Bt [r, out_p] (B transposed; of weights_dtype, fp32 or y's dtype;
//   the sums in fp32 either way) and its scale:
//     y[i, lo:hi] += narrow((Bt.T @ (A @ x[i])) * scale)
//   in place, in PEFT's order (B(Ax), then the scale), the delta rounded to y's dtype before the add
//   as lora.py's torch path rounds it. Rows with slot -1 are left alone. Bt may come tiled,
//   [out/16, r, 16] (16 columns of every rank row after another), which the vector path reads as one
//   stream where [r, out] is r streams.
//
// The table is int64 [adapters * P, 5]: A's address (0 where the adapter leaves p out), Bt's address,
// r, 1 where Bt is tiled, and the scale's fp32 bits. lora.py builds it from the adapters' tensors and
// holds them while a step may call this, checking their shapes, dtype and layout as it builds. A
// table instead of lists of tensors because a decode step calls this four times a layer, and turning
// the lists into C++ arguments cost more than the arithmetic at a few rows.
//
// The rows of each adapter are taken together, in blocks: a block reads its adapter's r x (in + out)
// weights once for all its rows, and no row touches another adapter's. The torch alternatives (a mask
// over every adapter's columns, or padded batched matmuls) either multiply every row by every adapter
// or spend a handful of ops per projection, and at decode sizes an op's dispatch costs more than its
// arithmetic. Built with the other CPU kernels by cpu_kernel.py; registered as
// torch.ops.inflightq.lora_rows; used by worker/engine/model/lora.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rounding.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace inflightq_rounding;

constexpr int64_t TABLE_WIDTH = 5;  // int64s per row of the weights table: A, Bt, rank, tiled, scale's bits
constexpr int64_t BLOCK_ROWS = 8;        // rows of one adapter whose deltas one task computes together
constexpr int64_t SERIAL_MACS = 1 << 16;  // below this much arithmetic in a call, one thread (no fork/join)
// How far ahead of its reads the vector path asks for an adapter's weights: a block streams a few KB
// of them, too short for the hardware prefetchers to run far ahead before it ends, so without this
// its reads wait on memory a line or two at a time.
constexpr int64_t PREFETCH_AHEAD = 2048;

// One task: the deltas of up to BLOCK_ROWS rows of one adapter for one projection. The adapter's A and
// B rows are widened once and used for every row of the block: a step streams each adapter's weights
// once per block instead of once per row, which at many rows and adapters is most of the deltas' cost.
template <typename scalar_t, typename weight_t>
void lora_block(scalar_t* y, int64_t width, const scalar_t* x, int64_t in, const int64_t* rows, int64_t n,
                const weight_t* a, const weight_t* bt, bool tiled, int64_t r, int64_t out, float scale,
                std::vector<float>& xs, std::vector<float>& w, std::vector<float>& t, std::vector<float>& d) {
  xs.resize(n * in);
  w.resize(std::max(in, out));
  t.resize(n * r);
  d.assign(n * out, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* xi = x + rows[i] * in;
    float* xsi = xs.data() + i * in;
#pragma omp simd
    for (int64_t k = 0; k < in; ++k) xsi[k] = widen(xi[k]);
  }
  float* wp = w.data();
  for (int64_t j = 0; j < r; ++j) {
    const weight_t* row = a + j * in;
#pragma omp simd
    for (int64_t k = 0; k < in; ++k) wp[k] = widen(row[k]);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {  // four rows' sums side by side: four chains of adds instead of one
      const float *x0 = xs.data() + i * in, *x1 = x0 + in, *x2 = x1 + in, *x3 = x2 + in;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t k = 0; k < in; ++k) {
        s0 += wp[k] * x0[k];
        s1 += wp[k] * x1[k];
        s2 += wp[k] * x2[k];
        s3 += wp[k] * x3[k];
      }
      t[i * r + j] = s0;
      t[(i + 1) * r + j] = s1;
      t[(i + 2) * r + j] = s2;
      t[(i + 3) * r + j] = s3;
    }
    for (; i < n; ++i) {
      const float* xsi = xs.data() + i * in;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < in; ++k) acc += wp[k] * xsi[k];
      t[i * r + j] = acc;
    }
  }
  for (int64_t j = 0; j < r; ++j) {
    if (tiled) {
      for (int64_t o = 0; o < out; ++o) wp[o] = widen(bt[(o / 16) * r * 16 + j * 16 + o % 16]);
    } else {
      const weight_t* row = bt + j * out;
#pragma omp simd
      for (int64_t o = 0; o < out; ++o) wp[o] = widen(row[o]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const float tj = t[i * r + j];
      float* di = d.data() + i * out;
#pragma omp simd
      for (int64_t o = 0; o < out; ++o) di[o] += wp[o] * tj;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    scalar_t* yi = y + rows[i] * width;
    const float* di = d.data() + i * out;
#pragma omp simd
    for (int64_t o = 0; o < out; ++o) yi[o] = narrow<scalar_t>(widen(yi[o]) + round_to<scalar_t>(di[o] * scale));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// lora_block for a bf16 model on AVX-512, its sizes multiples of 16: the same sums held in registers,
// N rows at a time (each A and B vector loaded once for all of them), fused multiply-adds.
template <int N, typename weight_t>
void lora_block16(c10::BFloat16* y, int64_t width, const c10::BFloat16* x, int64_t in, const int64_t* rows,
                  const weight_t* a, const weight_t* bt, bool tiled, int64_t r, int64_t out, float scale,
                  std::vector<float>& xs, std::vector<float>& t) {
  xs.resize(N * in);
  t.resize(N * r);
  for (int i = 0; i < N; ++i)
    for (int64_t k = 0; k < in; k += 16) _mm512_storeu_ps(xs.data() + i * in + k, widen16(x + rows[i] * in + k));
  constexpr int U = N >= 4 ? 1 : (N == 1 ? 4 : 2);  // sums per row: at least four chains of adds in flight
  for (int64_t j = 0; j < r; ++j) {
    const weight_t* row = a + j * in;
    __m512 acc[N][U];
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[i][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= in; k += 16 * U) {
      __builtin_prefetch(reinterpret_cast<const char*>(row + k) + PREFETCH_AHEAD, 0, 3);
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) {
        const __m512 w = widen16(row + k + 16 * u);
#pragma GCC unroll 8
        for (int i = 0; i < N; ++i)
          acc[i][u] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs.data() + i * in + k + 16 * u), acc[i][u]);
      }
    }
    for (; k < in; k += 16) {
      const __m512 w = widen16(row + k);
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) acc[i][0] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xs.data() + i * in + k), acc[i][0]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
      __m512 sum = acc[i][0];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[i][u]);
      t[i * r + j] = _mm512_reduce_add_ps(sum);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t o = 0; o < out; o += 16) {
    __m512 acc[N];
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < r; ++j) {
      // Tiled, B is one stream (two ranks' 16 columns a cache line): ask ahead once a line.
      const weight_t* wp = tiled ? bt + o * r + j * 16 : bt + j * out + o;
      if (tiled && (j & 1) == 0) __builtin_prefetch(reinterpret_cast<const char*>(wp) + PREFETCH_AHEAD, 0, 3);
      const __m512 w = widen16(wp);
#pragma GCC unroll 8
      for (int i = 0; i < N; ++i) acc[i] = _mm512_fmadd_ps(w, _mm512_set1_ps(t[i * r + j]), acc[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
      c10::BFloat16* yi = y + rows[i] * width + o;
      const __m512 sum = _mm512_add_ps(widen16(yi), bf16_round16(_mm512_mul_ps(acc[i], sv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(yi), _mm512_cvtepi32_epi16(bf16_bits16(sum)));
    }
  }
}

template <typename weight_t>
bool lora_block_avx512(c10::BFloat16* y, int64_t width, const c10::BFloat16* x, int64_t in, const int64_t* rows,
                       int64_t n, const weight_t* a, const weight_t* bt, bool tiled, int64_t r, int64_t out,
                       float scale, std::vector<float>& xs, std::vector<float>& t) {
  if (in % 16 != 0 || out % 16 != 0) return false;
  switch (n) {
#define INFLIGHTQ_LORA_BLOCK(K) \
  case K:                       \
    lora_block16<K>(y, width, x, in, rows, a, bt, tiled, r, out, scale, xs, t); \
    return true;
    INFLIGHTQ_LORA_BLOCK(1)
    INFLIGHTQ_LORA_BLOCK(2)
    INFLIGHTQ_LORA_BLOCK(3)
    INFLIGHTQ_LORA_BLOCK(4)
    INFLIGHTQ_LORA_BLOCK(5)
    INFLIGHTQ_LORA_BLOCK(6)
    INFLIGHTQ_LORA_BLOCK(7)
    INFLIGHTQ_LORA_BLOCK(8)
#undef INFLIGHTQ_LORA_BLOCK
    default:
      return false;
  }
}
#endif

// One adapter's weights for one projection, as a row of the table lora.py builds (five int64s).
struct Weights {
  const void* a;   // A [r, in], contiguous; null where the adapter leaves the projection out
  const void* bt;  // B transposed, contiguous: [r, out], or tiled [out/16, r, 16]
  int64_t r;
  bool tiled;
  float scale;
};

Weights weights_at(const int64_t* row) {
  float scale;
  const auto bits = static_cast<uint32_t>(row[4]);
  std::memcpy(&scale, &bits, sizeof scale);
  return {reinterpret_cast<const void*>(row[0]), reinterpret_cast<const void*>(row[1]), row[2], row[3] != 0, scale};
}

struct Task {
  int64_t weights;  // the table's row: slot * groups + projection
  int64_t first;    // the block's first entry in `order`
  int64_t n;        // its rows
};

template <typename scalar_t, typename weight_t>
void run(at::Tensor& y, const at::Tensor& x, const int64_t* slot, const int64_t* table, at::IntArrayRef bounds,
         int64_t groups, int64_t adapters) {
  const int64_t rows = y.size(0), in = x.size(1), width = y.size(1);
  // The rows of each adapter, together (a counting sort by slot), cut into blocks per projection.
  std::vector<int64_t> start(adapters + 1, 0), order(rows);
  for (int64_t i = 0; i < rows; ++i)
    if (slot[i] >= 0) ++start[slot[i] + 1];
  for (int64_t s = 0; s < adapters; ++s) start[s + 1] += start[s];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < rows; ++i)
    if (slot[i] >= 0) order[next[slot[i]]++] = i;
  std::vector<Task> tasks;
  int64_t macs = 0;
  for (int64_t s = 0; s < adapters; ++s) {
    if (start[s] == start[s + 1]) continue;
    for (int64_t p = 0; p < groups; ++p) {
      const int64_t w = s * groups + p;
      if (table[w * TABLE_WIDTH] == 0) continue;
      const int64_t r = table[w * TABLE_WIDTH + 2], out = bounds[2 * p + 1] - bounds[2 * p];
      for (int64_t first = start[s]; first < start[s + 1]; first += BLOCK_ROWS) {
        const int64_t n = std::min(BLOCK_ROWS, start[s + 1] - first);
        tasks.push_back({w, first, n});
        macs += n * r * (in + out);
      }
    }
  }
  const int64_t count = static_cast<int64_t>(tasks.size());
  scalar_t* yp = y.data_ptr<scalar_t>();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  at::parallel_for(0, count, macs < SERIAL_MACS ? std::max<int64_t>(count, 1) : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs, w, t, d;
    for (int64_t k = begin; k < end; ++k) {
      const Task& task = tasks[k];
      const int64_t p = task.weights % groups;
      const Weights wt = weights_at(table + task.weights * TABLE_WIDTH);
      const auto* a = static_cast<const weight_t*>(wt.a);
      const auto* bt = static_cast<const weight_t*>(wt.bt);
      const int64_t* block = order.data() + task.first;
      const int64_t out = bounds[2 * p + 1] - bounds[2 * p];
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (lora_block_avx512<weight_t>(yp + bounds[2 * p], width, xp, in, block, task.n, a, bt, wt.tiled, wt.r, out,
                                        wt.scale, xs, t))
          continue;
      }
#endif
      lora_block<scalar_t, weight_t>(yp + bounds[2 * p], width, xp, in, block, task.n, a, bt, wt.tiled, wt.r, out,
                                     wt.scale, xs, w, t, d);
    }
  });
}

void lora_rows(at::Tensor y_in, const at::Tensor& x_in, const at::Tensor& slots, const at::Tensor& table,
               at::IntArrayRef bounds, at::ScalarType weights_dtype) {
  TORCH_CHECK(y_in.device().is_cpu() && x_in.device().is_cpu(), "lora_rows runs on CPU tensors");
  TORCH_CHECK(y_in.dim() == 2 && x_in.dim() == 2, "lora_rows: 2-D y, x");
  // Strided y (a column slice) is computed in a contiguous copy and written back.
  at::Tensor y = y_in.is_contiguous() ? y_in : y_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "lora_rows: y and x of one dtype");
  const int64_t rows = y.size(0), width = y.size(1);
  TORCH_CHECK(x.size(0) == rows && slots.numel() == rows && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "lora_rows: slots");
  TORCH_CHECK(bounds.size() % 2 == 0 && bounds.size() > 0, "lora_rows: bounds are lo, hi per projection");
  const int64_t groups = static_cast<int64_t>(bounds.size()) / 2;
  for (int64_t p = 0; p < groups; ++p)
    TORCH_CHECK(0 <= bounds[2 * p] && bounds[2 * p] < bounds[2 * p + 1] && bounds[2 * p + 1] <= width,
                "lora_rows: each projection's columns inside y");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == TABLE_WIDTH &&
                  table.is_contiguous() && table.size(0) % groups == 0,
              "lora_rows: the weights table is int64 [adapters * projections, 5]");
  TORCH_CHECK(weights_dtype == at::kFloat || weights_dtype == y.scalar_type(), "lora_rows: weights in fp32 or y's dtype");
  const int64_t adapters = table.size(0) / groups;
  const int64_t* tp = table.const_data_ptr<int64_t>();
  for (int64_t w = 0; w < table.size(0); ++w)
    TORCH_CHECK(tp[w * TABLE_WIDTH] == 0 || (tp[w * TABLE_WIDTH + 1] != 0 && tp[w * TABLE_WIDTH + 2] > 0),
                "lora_rows: a table row with A has Bt and a rank");
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(slot[i] < adapters, "lora_rows: slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_rows", [&] {
    if (weights_dtype == at::kFloat) {
      run<scalar_t, float>(y, x, slot, tp, bounds, groups, adapters);
    } else {
      run<scalar_t, scalar_t>(y, x, slot, tp, bounds, groups, adapters);
    }
  });
  if (!y.is_same(y_in)) y_in.copy_(y);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflightq, m) {
  m.def("lora_rows(Tensor(a!) y, Tensor x, Tensor slots, Tensor table, int[] bounds, ScalarType weights_dtype) -> ()");
  m.impl("lora_rows", c10::DispatchKey::CPU, TORCH_FN(lora_rows));
}
