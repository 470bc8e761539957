// What a linear over a laid-out bf16 weight needs, shared by
// decode_linear.cpp and amx_linear.cpp: the weight padded for its layout; and before a call the
// checks on the input and bias, the input as [m, k]
// rows, the bias in fp32 and the output allocated in the input's shape. Included by the kernels
// beside it (cpu_kernel.py's build key hashes this header too).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace inflightq_linear {

struct LinearCall {
  at::Tensor x;       // [m, k] contiguous bf16 rows
  at::Tensor bias32;  // fp32, or undefined
  at::Tensor out;     // the input's shape with out_features last
  int64_t m;
  int64_t k;

  const uint16_t* input() const { return reinterpret_cast<const uint16_t*>(x.data_ptr()); }
  const float* bias() const { return bias32.defined() ? bias32.data_ptr<float>() : nullptr; }
  uint16_t* output() const { return reinterpret_cast<uint16_t*>(out.data_ptr()); }
};

// A [N, K] bf16 weight checked for a layout of `chunk`-value input chunks, its rows padded with
// zeros to a multiple of `row_multiple`: what each kernel's layout then reorders.
inline at::Tensor padded_weight(const char* name, const at::Tensor& weight, int64_t chunk, int64_t row_multiple) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, name, ": a 2-D bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % chunk == 0, name, ": in_features must be a multiple of ", chunk);
  auto rows = at::zeros({(n + row_multiple - 1) / row_multiple * row_multiple, k}, weight.options());
  rows.narrow(0, 0, n).copy_(weight);
  return rows;
}

// `name` prefixes every error; `max_rows` is the most input rows the kernel takes.
inline LinearCall prepare(const char* name, const at::Tensor& input, const at::Tensor& laid_out,
                          const std::optional<at::Tensor>& bias, int64_t out_features, int64_t max_rows) {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && laid_out.scalar_type() == at::kBFloat16, name,
              ": bf16 input and weight");
  const int64_t k = input.size(-1);
  const int64_t m = input.numel() / k;
  TORCH_CHECK(m <= max_rows, name, ": 0 to ", max_rows, " rows, got ", m);
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == out_features, name, ": bias size");
    bias32 = bias->scalar_type() == at::kFloat ? bias->contiguous() : bias->to(at::kFloat).contiguous();
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end() - 1);
  shape.push_back(out_features);
  return {input.reshape({m, k}).contiguous(), bias32, at::empty(shape, input.options()), m, k};
}

}  // namespace inflightq_linear
