// A step's LoRA deltas for one projection group (q/k/v, o, gate/up or down) as one op: each row with
// its own adapter's A and B, rows of several adapters and of none in one call.
//
//   lora_rows(y, x, slots, a, bt, scales, bounds): for each row i with slots[i] = s >= 0 and each
//   projection p of the group (its columns bounds[2p]:bounds[2p+1] of y), with A = a[s*P+p] [r, in]
//   and Bt = bt[s*P+p] [r, out_p] (B transposed; fp32 or y's dtype, an empty tensor where the adapter
//   leaves p out; the sums in fp32 either way):
//     y[i, lo:hi] += narrow((Bt.T @ (A @ x[i])) * scales[s*P+p])
//   in place, in PEFT's order (B(Ax), then the scale), the delta rounded to y's dtype before the add
//   as lora.py's torch path rounds it. Rows with slot -1 are left alone.
//
// Each row reads only its own adapter's r x (in + out) weights: the torch alternatives (a mask over
// every adapter's columns, or padded batched matmuls) either multiply every row by every adapter or
// spend a handful of ops per projection, and at decode sizes an op's dispatch costs more than its
// arithmetic. Built with the other CPU kernels by cpu_kernel.py; registered as
// torch.ops.inflightq.lora_rows; used by worker/engine/model/lora.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "rounding.h"

#include <cstdint>
#include <vector>

namespace {

using namespace inflightq_rounding;

template <typename scalar_t, typename weight_t>
void lora_task(scalar_t* y, const scalar_t* x, int64_t in, const weight_t* a, const weight_t* bt, int64_t r,
               int64_t out, float scale, std::vector<float>& xs, std::vector<float>& t, std::vector<float>& d) {
  xs.resize(in);
  t.resize(r);
  d.assign(out, 0.f);
#pragma omp simd
  for (int64_t k = 0; k < in; ++k) xs[k] = widen(x[k]);
  for (int64_t j = 0; j < r; ++j) {
    const weight_t* row = a + j * in;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < in; ++k) acc += widen(row[k]) * xs[k];
    t[j] = acc;
  }
  for (int64_t j = 0; j < r; ++j) {
    const weight_t* row = bt + j * out;
    const float tj = t[j];
#pragma omp simd
    for (int64_t o = 0; o < out; ++o) d[o] += widen(row[o]) * tj;
  }
#pragma omp simd
  for (int64_t o = 0; o < out; ++o) {
    y[o] = narrow<scalar_t>(widen(y[o]) + round_to<scalar_t>(d[o] * scale));
  }
}

template <typename scalar_t, typename weight_t>
void run(at::Tensor& y, const at::Tensor& x, const int64_t* slot, at::TensorList a, at::TensorList bt,
         at::ArrayRef<double> scales, at::IntArrayRef bounds, int64_t groups) {
  const int64_t rows = y.size(0), in = x.size(1), width = y.size(1);
  scalar_t* yp = y.data_ptr<scalar_t>();
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  at::parallel_for(0, rows * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs, t, d;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / groups, p = task % groups, s = slot[i];
      if (s < 0) continue;
      const at::Tensor& wa = a[s * groups + p];
      if (wa.numel() == 0) continue;
      const at::Tensor& wb = bt[s * groups + p];
      lora_task<scalar_t, weight_t>(yp + i * width + bounds[2 * p], xp + i * in, in, wa.const_data_ptr<weight_t>(),
                                    wb.const_data_ptr<weight_t>(), wa.size(0), wb.size(1),
                                    static_cast<float>(scales[s * groups + p]), xs, t, d);
    }
  });
}

void lora_rows(at::Tensor y, const at::Tensor& x, const at::Tensor& slots, at::TensorList a, at::TensorList bt,
               at::ArrayRef<double> scales, at::IntArrayRef bounds) {
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu(), "lora_rows runs on CPU tensors");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.is_contiguous() && x.is_contiguous(), "lora_rows: 2-D contiguous y, x");
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "lora_rows: y and x of one dtype");
  const int64_t rows = y.size(0), in = x.size(1), width = y.size(1);
  TORCH_CHECK(x.size(0) == rows && slots.numel() == rows && slots.scalar_type() == at::kLong, "lora_rows: slots");
  TORCH_CHECK(bounds.size() % 2 == 0 && bounds.size() > 0, "lora_rows: bounds are lo, hi per projection");
  const int64_t groups = static_cast<int64_t>(bounds.size()) / 2;
  TORCH_CHECK(a.size() == bt.size() && a.size() == scales.size() && a.size() % groups == 0, "lora_rows: lists");
  const int64_t adapters = static_cast<int64_t>(a.size()) / groups;
  at::ScalarType weight_dtype = at::ScalarType::Undefined;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].numel() == 0) continue;
    const int64_t p = static_cast<int64_t>(i) % groups;
    TORCH_CHECK(a[i].scalar_type() == bt[i].scalar_type() &&
                    (a[i].scalar_type() == at::kFloat || a[i].scalar_type() == y.scalar_type()),
                "lora_rows: A and Bt in fp32 or y's dtype");
    if (weight_dtype == at::ScalarType::Undefined) weight_dtype = a[i].scalar_type();
    TORCH_CHECK(a[i].scalar_type() == weight_dtype, "lora_rows: every A and Bt of one dtype");
    TORCH_CHECK(a[i].is_contiguous() && bt[i].is_contiguous(), "lora_rows: contiguous A, Bt");
    TORCH_CHECK(a[i].dim() == 2 && a[i].size(1) == in && bt[i].dim() == 2 && bt[i].size(0) == a[i].size(0) &&
                    bt[i].size(1) == bounds[2 * p + 1] - bounds[2 * p] && bounds[2 * p + 1] <= width,
                "lora_rows: A [r, in] and Bt [r, out] fit the row and the projection's columns");
  }
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(slot[i] < adapters, "lora_rows: slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_rows", [&] {
    if (weight_dtype == at::kFloat || weight_dtype == at::ScalarType::Undefined) {
      run<scalar_t, float>(y, x, slot, a, bt, scales, bounds, groups);
    } else {
      run<scalar_t, scalar_t>(y, x, slot, a, bt, scales, bounds, groups);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflightq, m) {
  m.def("lora_rows(Tensor(a!) y, Tensor x, Tensor slots, Tensor[] a, Tensor[] bt, float[] scales, int[] bounds) -> ()");
  m.impl("lora_rows", c10::DispatchKey::CPU, TORCH_FN(lora_rows));
}
