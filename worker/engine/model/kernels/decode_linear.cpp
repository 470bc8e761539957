// A bf16 linear layer for the 1-4 rows of a small decode step, read at the memory's rate.
//
// At one to four streams a decode step multiplies each weight by a handful of rows: the matmuls
// are a read of every weight, so their speed is the rate at which the weights stream in. For a
// small model's shapes, which have few output rows and a fixed cost per call, oneDNN's packed
// matmul stays well below the memory's rate. This kernel reads a weight laid out for it once, at
// load, in blocks of BLOCK_ROWS output rows whose 32-value chunks of the input dimension alternate
// ([N / 4][K / 32][4][32]), so each thread walks one contiguous stream and prefetches a few cache
// lines ahead; AVX512-BF16's dot-product instruction multiplies 32 bf16 pairs per instruction into
// fp32 sums. Figures against oneDNN: see docs/benchmarks.md.
//
// Results: products of bf16 values are exact in fp32 and summed in fp32, bias added in fp32,
// rounded once to bf16 -- what a native bf16 matmul (oneDNN's included) does, in another order.
//
// With AVX-512F but no AVX512-BF16 (Ice Lake, Skylake and Cascade Lake Xeons) there is no
// bf16 dot product, and the engine's other choice is oneDNN in fp32 on an upcast copy of the
// weights, which streams twice the bytes. Here each 32-bit lane of a loaded chunk holds two bf16
// values: the lane shifted left by 16 is the even one as an fp32, the lane with its low half
// cleared the odd one, so two integer ops widen 16 pairs with no shuffle, and plain
// fp32 FMAs sum them (a product of two bf16 values is exact in fp32, so the fused multiply-add
// rounds only the sum, as dpbf16 does).
//
// With AVX2 (no AVX-512: Zen 1-3 EPYCs, Haswell to Comet Lake) the same widening runs on 256-bit
// registers, each chunk as two halves, two input rows per pass over a block for the 16 registers.
//
// Built with the other CPU kernels by cpu_kernel.py; registered as
// torch.ops.inflightq.decode_linear. Without AVX2 (where the engine does not route to it) a plain
// loop gives the same results, so the op exists and is tested on every CPU.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_call.h"
#include "rounding.h"
#include "simd_sums.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK_ROWS = 4;   // output rows interleaved in one block of the laid-out weight
constexpr int64_t CHUNK = 32;       // input-dimension values per chunk (one 512-bit register of bf16)
#if defined(__AVX512F__)
constexpr int64_t GROUP_ROWS = 4;   // input rows whose sums one pass over a block keeps in registers
#else
// AVX2 has 16 registers: a block's 4 x 2 sums, two rows' widened input and the weight's two halves fit.
constexpr int64_t GROUP_ROWS = 2;
#endif
constexpr int64_t MAX_ROWS = 16;    // input rows one call takes
constexpr int64_t GRAIN_BLOCKS = 16;  // 64 output rows per task: a 576-wide weight splits 9 ways

using inflightq_rounding::bf16_bits;
#if defined(__AVX512F__)
using inflightq_rounding::bf16_bits16;
#endif
using inflightq_rounding::widen_bf16_bits;

#if defined(__AVX512F__)
// sum4 sums a block's four rows at once: at 2-4 input rows four _mm512_reduce_add_ps per block
// would be a large share of the kernel's instructions.
static_assert(BLOCK_ROWS == 4, "sum4 and the 8-byte store take a block's rows four at a time");
using inflightq_simd::sum4;
#elif defined(__AVX2__) && defined(__FMA__)
static_assert(BLOCK_ROWS == 4, "sum4_avx2 takes a block's rows four at a time");
using inflightq_simd::sum4_avx2;
#endif

// One block's BLOCK_ROWS output rows for M input rows (x is [M, k]), plus bias, rounded to bf16 into y.
template <int M>
void write_block(const uint16_t* block, const uint16_t* x, const float* bias, uint16_t* y, int64_t n, int64_t k,
                 int64_t b) {
  const int64_t row0 = b * BLOCK_ROWS;
#if defined(__AVX512F__)
  __m512 acc[BLOCK_ROWS][M];
  for (int r = 0; r < BLOCK_ROWS; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += CHUNK) {
    const uint16_t* chunk = block + c * BLOCK_ROWS;
#if defined(__AVX512BF16__)
    // The block's next 2 KB, into L2 (the hardware prefetcher alone leaves the stream short of the
    // memory's rate). Into L2, not L1: each line is read once, and an L1 fill per line competes
    // with the loads it serves (see docs/benchmarks.md).
    for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(chunk + 1024 + 32 * line), _MM_HINT_T1);
    __m512bh xs[M];
    for (int m = 0; m < M; ++m) xs[m] = (__m512bh)_mm512_loadu_si512(x + m * k + c);
    for (int r = 0; r < BLOCK_ROWS; ++r) {
      const __m512bh ws = (__m512bh)_mm512_loadu_si512(chunk + r * CHUNK);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], ws, xs[m]);
    }
#else
    for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(chunk + 1024 + 32 * line), _MM_HINT_T0);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m512 xe[M], xo[M];  // the chunk's even and odd input values, widened
    for (int m = 0; m < M; ++m) {
      const __m512i v = _mm512_loadu_si512(x + m * k + c);
      xe[m] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      xo[m] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    for (int r = 0; r < BLOCK_ROWS; ++r) {
      const __m512i v = _mm512_loadu_si512(chunk + r * CHUNK);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wo, xo[m], _mm512_fmadd_ps(we, xe[m], acc[r][m]));
    }
#endif
  }
  for (int m = 0; m < M; ++m) {
    __m128 sums = sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]);
    uint16_t* y_row = y + m * n;
    if (row0 + BLOCK_ROWS <= n) {
      if (bias) sums = _mm_add_ps(sums, _mm_loadu_ps(bias + row0));
      const __m256i bits = _mm512_cvtepi32_epi16(bf16_bits16(_mm512_zextps128_ps512(sums)));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(y_row + row0), _mm256_castsi256_si128(bits));
    } else {  // the last block's padding rows are not written
      alignas(16) float lanes[BLOCK_ROWS];
      _mm_store_ps(lanes, sums);
      for (int64_t row = row0; row < n; ++row) y_row[row] = bf16_bits(lanes[row - row0] + (bias ? bias[row] : 0.f));
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2 (no AVX-512): each 32-value chunk is two 256-bit halves, each widened as above (the lane
  // shifted left by 16 is the even value, the lane with its low half cleared the odd one) and summed
  // by plain fp32 FMAs, which round only the sum as the products of bf16 values are exact in fp32.
  __m256 acc[BLOCK_ROWS][M];
  for (int r = 0; r < BLOCK_ROWS; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t c = 0; c < k; c += CHUNK) {
    const uint16_t* chunk = block + c * BLOCK_ROWS;
    for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(chunk + 1024 + 32 * line), _MM_HINT_T0);
    for (int half = 0; half < 2; ++half) {
      __m256 xe[M], xo[M];
      for (int m = 0; m < M; ++m) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * k + c + 16 * half));
        xe[m] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        xo[m] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
      for (int r = 0; r < BLOCK_ROWS; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + r * CHUNK + 16 * half));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        for (int m = 0; m < M; ++m) acc[r][m] = _mm256_fmadd_ps(wo, xo[m], _mm256_fmadd_ps(we, xe[m], acc[r][m]));
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    alignas(16) float lanes[BLOCK_ROWS];
    _mm_store_ps(lanes, sum4_avx2(acc[0][m], acc[1][m], acc[2][m], acc[3][m]));
    uint16_t* y_row = y + m * n;
    for (int64_t row = row0; row < std::min(n, row0 + BLOCK_ROWS); ++row)
      y_row[row] = bf16_bits(lanes[row - row0] + (bias ? bias[row] : 0.f));
  }
#else
  float sums[BLOCK_ROWS][M];
  for (int r = 0; r < BLOCK_ROWS; ++r)
    for (int m = 0; m < M; ++m) sums[r][m] = 0.f;
  for (int64_t c = 0; c < k; c += CHUNK) {
    const uint16_t* chunk = block + c * BLOCK_ROWS;
    for (int r = 0; r < BLOCK_ROWS; ++r)
      for (int m = 0; m < M; ++m) {
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < CHUNK; ++i) s += widen_bf16_bits(chunk[r * CHUNK + i]) * widen_bf16_bits(x[m * k + c + i]);
        sums[r][m] += s;
      }
  }
  for (int r = 0; r < BLOCK_ROWS; ++r) {
    const int64_t row = row0 + r;
    if (row >= n) break;  // the last block's padding rows
    for (int m = 0; m < M; ++m) y[m * n + row] = bf16_bits(sums[r][m] + (bias ? bias[row] : 0.f));
  }
#endif
}

// Output rows [BLOCK_ROWS * b0, BLOCK_ROWS * b1) for m input rows. More than GROUP_ROWS input rows
// would not fit the registers' sums, so they go in groups, each group's pass over a block reading
// it from L1 (a block is at most a few KB): the weight still streams in from memory once.
void blocks(const uint16_t* w, const uint16_t* x, const float* bias, uint16_t* y, int64_t n, int64_t k, int64_t m,
            int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* block = w + b * BLOCK_ROWS * k;
    for (int64_t g = 0; g < m; g += GROUP_ROWS) {
      const uint16_t* xg = x + g * k;
      uint16_t* yg = y + g * n;
      switch (std::min(GROUP_ROWS, m - g)) {
        case 1: write_block<1>(block, xg, bias, yg, n, k, b); break;
        case 2: write_block<2>(block, xg, bias, yg, n, k, b); break;
        case 3: write_block<3>(block, xg, bias, yg, n, k, b); break;
        default: write_block<4>(block, xg, bias, yg, n, k, b); break;
      }
    }
  }
}

// [N, K] bf16 -> [ceil(N / 4) * 4 / 4, K / 32, 4, 32]: the layout ``blocks`` reads (zero rows pad N).
at::Tensor decode_linear_layout(const at::Tensor& weight) {
  const auto rows = inflightq_linear::padded_weight("decode_linear_layout", weight, CHUNK, BLOCK_ROWS);
  const int64_t padded = rows.size(0), k = rows.size(1);
  return rows.view({padded / BLOCK_ROWS, BLOCK_ROWS, k / CHUNK, CHUNK}).transpose(1, 2).contiguous();
}

at::Tensor decode_linear(const at::Tensor& input, const at::Tensor& laid_out, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(laid_out.dim() == 4 && laid_out.size(1) * CHUNK == input.size(-1), "decode_linear: weight layout");
  const int64_t num_blocks = laid_out.size(0);
  TORCH_CHECK(out_features <= num_blocks * BLOCK_ROWS && out_features > (num_blocks - 1) * BLOCK_ROWS,
              "decode_linear: out_features does not match the weight");
  const auto call = inflightq_linear::prepare("decode_linear", input, laid_out, bias, out_features, MAX_ROWS);
  // A step whose chunks all end mid-prompt keeps no logits: the head gets no rows.
  if (call.m == 0) return call.out;
  const at::Tensor w = laid_out.contiguous();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const uint16_t* xp = call.input();
  const float* bp = call.bias();
  uint16_t* yp = call.output();
  const int64_t m = call.m, k = call.k;
  at::parallel_for(0, num_blocks, GRAIN_BLOCKS,
                   [&](int64_t b0, int64_t b1) { blocks(wp, xp, bp, yp, out_features, k, m, b0, b1); });
  return call.out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflightq, m) {
  m.def("decode_linear_layout(Tensor weight) -> Tensor");
  m.impl("decode_linear_layout", c10::DispatchKey::CPU, TORCH_FN(decode_linear_layout));
  m.def("decode_linear(Tensor input, Tensor laid_out, Tensor? bias, int out_features) -> Tensor");
  m.impl("decode_linear", c10::DispatchKey::CPU, TORCH_FN(decode_linear));
}
