// RMSNorm of a Llama-style decoder in one pass per row, with the rounding steps of the model's own
// module (transformers' LlamaRMSNorm): the row in fp32, y = x * rsqrt(mean(x^2) + eps) rounded to
// the model's dtype, then weight * y rounded again. The module runs that as eight tensor ops; at
// decode row counts each op costs its dispatch, not its arithmetic, and a forward calls the norm
// 2 * layers + 1 times.
// The mean of squares is summed in double: torch sums it in fp32 in its own (pairwise, vectorized)
// order, which a plain fp32 loop here would miss by an ulp more often than the correctly rounded sum.
//
// Built with the other CPU kernels by cpu_kernel.py; registered as
// torch.ops.inflightq.rms_norm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rounding.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using namespace inflightq_rounding;

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * dim;
      scalar_t* outr = out + r * dim;
      double total = 0.0;
#pragma omp simd reduction(+ : total)
      for (int64_t i = 0; i < dim; ++i) {
        const float v = widen(xr[i]);
        total += static_cast<double>(v) * v;
      }
      const float scale = 1.f / std::sqrt(static_cast<float>(total) / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = widen(narrow<scalar_t>(widen(xr[i]) * scale));
        outr[i] = narrow<scalar_t>(widen(w[i]) * normed);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "rms_norm runs on CPU tensors");
  TORCH_CHECK(weight.dim() == 1 && input.size(-1) == weight.size(0), "weight must be [hidden] of the input's last dim");
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(), "input and weight must share a dtype");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf,
              "rms_norm takes float32, bfloat16 or float16");
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t dim = w.size(0);
  const int64_t rows = dim ? x.numel() / dim : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows,
                            dim, static_cast<float>(eps));
  });
  return out;
}

template <typename scalar_t>
void add_rows(const scalar_t* x, const scalar_t* residual, scalar_t* sum, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) sum[i] = narrow<scalar_t>(widen(residual[i]) + widen(x[i]));
}

// The decoder layer's residual step and the next norm: sum = residual + x (rounded to the dtype, as
// the layer's ``residual + hidden_states`` is), then the norm of the sum; returns (normed, sum).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& input, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.sizes() == residual.sizes() && input.scalar_type() == residual.scalar_type(),
              "add_rms_norm: input and residual must match in shape and dtype");
  at::Tensor sum = at::empty_like(input, at::MemoryFormat::Contiguous);
  const at::Tensor x = input.contiguous();
  const at::Tensor r = residual.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* rp = r.const_data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    // Both threads on a prefill's rows (a decode step's few rows stay under the grain, on this thread).
    at::parallel_for(0, x.numel(), 16384, [&](int64_t begin, int64_t end) {
      add_rows<scalar_t>(xp + begin, rp + begin, sp + begin, end - begin);
    });
  });
  return {rms_norm(sum, weight, eps), sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflightq, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("add_rms_norm(Tensor input, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
}
