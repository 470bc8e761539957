// The elementwise steps of a Llama-style decoder layer, one op each, with the rounding steps of
// transformers' own code so a bf16 model gives the same values:
//
//   rotary_split: the fused q/k/v projection's output split into q, k and v ([T, heads, D],
//     contiguous), q and k rotated: x * cos + rotate_half(x) * sin, each product and the sum
//     rounded to the model's dtype as apply_rotary_pos_emb's three tensor ops round them.
//     transformers spends a dozen or more tensor ops on this per layer (views, slices, negations, cats).
//   silu_mul: the fused gate/up projection's output -> silu(gate) * up, silu rounded before the
//     product (the MLP's act_fn, then the multiply); four ops in the module. SiLU's exp is the
//     one torch's own vectorized SiLU calls (SLEEF's, on the same vector width).
//
// At decode row counts each of those ops costs its dispatch, not its arithmetic.
// Built with the other CPU kernels by cpu_kernel.py; registered as
// torch.ops.inflightq.rotary_split / silu_mul; used by worker/engine/model/fused_decoder_layer.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rounding.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <tuple>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace inflightq_rounding;

template <typename scalar_t>
void rotate_heads(const scalar_t* src, scalar_t* dst, const scalar_t* cos, const scalar_t* sin, int64_t heads,
                  int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* x = src + h * dim;
    scalar_t* y = dst + h * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {  // rotate_half: (-x2, x1)
      const float a = round_to<scalar_t>(widen(x[i]) * widen(cos[i]));
      const float b = round_to<scalar_t>(-widen(x[i + half]) * widen(sin[i]));
      y[i] = narrow<scalar_t>(a + b);
    }
#pragma omp simd
    for (int64_t i = half; i < dim; ++i) {
      const float a = round_to<scalar_t>(widen(x[i]) * widen(cos[i]));
      const float b = round_to<scalar_t>(widen(x[i - half]) * widen(sin[i]));
      y[i] = narrow<scalar_t>(a + b);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split(const at::Tensor& qkv, const at::Tensor& cos,
                                                            const at::Tensor& sin, int64_t num_heads,
                                                            int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.device().is_cpu(), "rotary_split runs on CPU tensors");
  TORCH_CHECK(head_dim % 2 == 0, "rotary_split: head_dim must be even");
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_dim;
  TORCH_CHECK(qkv.size(-1) == width, "rotary_split: qkv's last dim must be (heads + 2 * kv heads) * head_dim");
  const int64_t tokens = qkv.numel() / width;
  TORCH_CHECK(cos.numel() == tokens * head_dim && sin.numel() == tokens * head_dim,
              "rotary_split: cos/sin must be [.., T, head_dim]");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              "rotary_split: qkv, cos and sin must share a dtype");
  const at::Tensor x = qkv.contiguous();
  const at::Tensor c = cos.contiguous();
  const at::Tensor s = sin.contiguous();
  at::Tensor q = at::empty({tokens, num_heads, head_dim}, qkv.options());
  at::Tensor k = at::empty({tokens, num_kv_heads, head_dim}, qkv.options());
  at::Tensor v = at::empty({tokens, num_kv_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_split", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* cp = c.const_data_ptr<scalar_t>();
    const scalar_t* sp = s.const_data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* vp = v.data_ptr<scalar_t>();
    const int64_t qw = num_heads * head_dim, kw = num_kv_heads * head_dim;
    at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* row = xp + t * width;
        rotate_heads(row, qp + t * qw, cp + t * head_dim, sp + t * head_dim, num_heads, head_dim);
        rotate_heads(row + qw, kp + t * kw, cp + t * head_dim, sp + t * head_dim, num_kv_heads, head_dim);
        std::copy(row + qw + kw, row + width, vp + t * kw);
      }
    });
  });
  return {q, k, v};
}

// exp(-x) over SIMD_STEP values, as torch's vectorized SiLU computes it: SLEEF's vector exp (from
// libtorch_cpu) on the same vector width, so the values match torch's bit for bit.
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
constexpr int64_t SIMD_STEP = 32;  // torch's loops take two vectors at a time
inline void exp_neg(const float* x, float* out) {
  for (int64_t j = 0; j < SIMD_STEP; j += 16)
    _mm512_storeu_ps(out + j, Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(x + j))));
}
#elif defined(__AVX2__) && defined(__FMA__)
extern "C" __m256 Sleef_expf8_u10(__m256);
constexpr int64_t SIMD_STEP = 16;
inline void exp_neg(const float* x, float* out) {
  for (int64_t j = 0; j < SIMD_STEP; j += 8)
    _mm256_storeu_ps(out + j, Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(x + j))));
}
#else
constexpr int64_t SIMD_STEP = 1;
inline void exp_neg(const float* x, float* out) { out[0] = std::exp(-x[0]); }
#endif

// Columns [c0, c1) of one row: whole SIMD_STEP runs as torch's vector loop, the row's tail (fewer
// than SIMD_STEP columns) as its scalar loop with libm's exp. A model's intermediate width is a
// multiple of SIMD_STEP, so there is no tail; on a contiguous gate torch runs one loop over all
// rows, so for other widths a tail value may come out of SLEEF's exp there, an ulp away.
template <typename scalar_t>
void silu_mul_columns(const scalar_t* gate, const scalar_t* up, scalar_t* y, int64_t c0, int64_t c1, int64_t inter) {
  const int64_t vector_end = inter / SIMD_STEP * SIMD_STEP;
  float g[SIMD_STEP], e[SIMD_STEP];
  int64_t c = c0;
  for (; c < std::min(c1, vector_end); c += SIMD_STEP) {
    for (int64_t j = 0; j < SIMD_STEP; ++j) g[j] = widen(gate[c + j]);
    exp_neg(g, e);
    for (int64_t j = 0; j < SIMD_STEP; ++j)
      y[c + j] = narrow<scalar_t>(round_to<scalar_t>(g[j] / (1.f + e[j])) * widen(up[c + j]));
  }
  for (; c < c1; ++c) {
    const float x = widen(gate[c]);
    y[c] = narrow<scalar_t>(round_to<scalar_t>(x / (1.f + std::exp(-x))) * widen(up[c]));
  }
}

#if defined(__AVX512F__)
// The bf16 columns' loop with the widening and both roundings in vector registers: left to the
// compiler, the scalar loop above keeps bf16_bits' NaN branch per value scalar and runs slower than
// torch's own silu then multiply on a prefill. The same operations in the same order, so the same
// values (the vector widening and roundings are rounding.h's, beside their scalar forms).
template <>
void silu_mul_columns<c10::BFloat16>(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* y, int64_t c0,
                                     int64_t c1, int64_t inter) {
  const int64_t vector_end = inter / SIMD_STEP * SIMD_STEP;
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t c = c0;
  for (; c < std::min(c1, vector_end); c += 16) {  // SIMD_STEP is two vectors: whole steps are whole vectors
    const __m512 g = widen16(gate + c);
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 act = bf16_round16(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    const __m512i out = bf16_bits16(_mm512_mul_ps(act, widen16(up + c)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + c), _mm512_cvtepi32_epi16(out));
  }
  for (; c < c1; ++c) {
    const float x = widen(gate[c]);
    y[c] = narrow<c10::BFloat16>(round_to<c10::BFloat16>(x / (1.f + std::exp(-x))) * widen(up[c]));
  }
}
#endif

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_mul runs on CPU tensors");
  const int64_t width = gate_up.size(-1);
  TORCH_CHECK(width % 2 == 0, "silu_mul: the last dim holds gate then up, so it must be even");
  const int64_t inter = width / 2;
  const int64_t rows = inter ? gate_up.numel() / width : 0;
  const at::Tensor x = gate_up.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, x.options());
  // Rows of a decode step are few and wide: tasks are runs of columns (whole SIMD steps), so both
  // cores take part and each run starts where torch's vector loop would.
  const int64_t runs = (inter + SIMD_STEP - 1) / SIMD_STEP;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * runs, 2048 / SIMD_STEP, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end;) {
        const int64_t r = task / runs, first = task % runs, last = std::min(runs, first + (end - task));
        silu_mul_columns(xp + r * width, xp + r * width + inter, op + r * inter, first * SIMD_STEP,
                         std::min(inter, last * SIMD_STEP), inter);
        task += last - first;
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflightq, m) {
  m.def("rotary_split(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim) -> (Tensor, Tensor, Tensor)");
  m.impl("rotary_split", c10::DispatchKey::CPU, TORCH_FN(rotary_split));
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
