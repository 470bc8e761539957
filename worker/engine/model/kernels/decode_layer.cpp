// A Llama-style decoder layer's decode step as one op: the dozen ops of fused_decoder_layer.py's
// forward, called from C++.
//
// At one to a few streams every op of the fused layer does microseconds of arithmetic, and each
// call from Python costs as much again in interpreter, argument parsing and dispatch: eleven calls
// per layer and a few Python frames around them (the packed linear, the attention backend) are a
// visible share of a small batch's step. Here the same ops run in the same order on the same
// tensors through the dispatcher's typed handles, a fraction of that cost a call, so the results
// are the Python path's bit for bit; only the calls around them go.
//
// Taken only by decode-only steps whose projections all run through decode_linear or amx_linear
// (bf16 weights laid out for one of them, as many rows as it takes) on the CPU kernel attention
// backend; anything else keeps the Python forward. Built with the other CPU kernels by cpu_kernel.py; registered
// as torch.ops.inflightq.decode_layer.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Each op's C++ signature as its kernel declares it (the dispatcher checks them on the first call).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("inflightq::rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              double)>
      add_rms_norm = handle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, double)>("inflightq::add_rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>
      linear = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>(
          "inflightq::decode_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>
      tiles = handle<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>(
          "inflightq::amx_linear");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>
      rotary_split = handle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
          const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>("inflightq::rotary_split");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
      handle<at::Tensor(const at::Tensor&)>("inflightq::silu_mul");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&)>
      cache_write = handle<void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&)>(
          "inflightq::cache_write");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, int64_t, double, at::Tensor)>
      paged_decode = handle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, int64_t, double, at::Tensor)>("inflightq::paged_decode");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                at::ScalarType)>
      lora_rows = handle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                              at::ScalarType)>("inflightq::lora_rows");
};

const Ops& ops() {
  static const Ops instance;  // looked up on the first call, when every op of the library is registered
  return instance;
}

// A step's LoRA rows for one layer: each row's adapter slot, and per projection group (q/k/v, o,
// gate/up, down) lora_rows' weights table and columns (see lora_rows.cpp).
struct LayerLora {
  const at::Tensor& slots;
  at::Tensor tables[4];
  at::IntArrayRef bounds[4];
  at::ScalarType dtype;
};

// x @ weight.T + bias through the kernel whose layout `weight` has: amx_linear's tiles are 6-D,
// decode_linear's blocks 4-D (the caller picks the layout as PackedLinear would route the call).
at::Tensor project(const Ops& op, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   int64_t out_features) {
  return weight.dim() == 6 ? op.tiles.call(x, weight, bias, out_features) : op.linear.call(x, weight, bias, out_features);
}

// y (a projection group's output) with the step's LoRA deltas of group g added in place, as
// fused_decoder_layer.py's forward adds them after the same matmul.
void add_deltas(const Ops& op, const LayerLora* lora, int g, const at::Tensor& y, const at::Tensor& x) {
  if (lora == nullptr) return;
  op.lora_rows.call(y.view({-1, y.size(-1)}), x.view({-1, x.size(-1)}), lora->slots, lora->tables[g], lora->bounds[g],
                    lora->dtype);
}

// hidden [1, T, H]; each projection is (laid-out weight, fp32 bias or none, out_features), as
// PackedLinear holds them; the attention arguments are the CPU kernel backend's for a decode step.
at::Tensor layer_step(const at::Tensor& hidden, const at::Tensor& in_weight, double in_eps, const at::Tensor& qkv,
                      const std::optional<at::Tensor>& qkv_bias, int64_t qkv_out, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                      const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size, double scale,
                      const at::Tensor& o, const std::optional<at::Tensor>& o_bias, int64_t o_out,
                      const at::Tensor& post_weight, double post_eps, const at::Tensor& gate_up,
                      const std::optional<at::Tensor>& gate_up_bias, int64_t gate_up_out, const at::Tensor& down,
                      const std::optional<at::Tensor>& down_bias, int64_t down_out, const LayerLora* lora) {
  const Ops& op = ops();
  const at::Tensor normed = op.rms_norm.call(hidden, in_weight, in_eps);
  const at::Tensor projected = project(op, normed, qkv, qkv_bias, qkv_out);
  add_deltas(op, lora, 0, projected, normed);
  auto [q, k, v] = op.rotary_split.call(projected, cos, sin, num_heads, num_kv_heads, head_dim);  // each [T, heads, D]
  op.cache_write.call(k, v, k_cache, v_cache, slot_mapping);
  at::Tensor attended = at::empty_like(q);
  op.paged_decode.call(q, k_cache, v_cache, block_table, context_lens, block_size, scale, attended);
  std::vector<int64_t> rows(hidden.sizes().begin(), hidden.sizes().end() - 1);
  rows.push_back(-1);
  const at::Tensor attended_rows = attended.view(rows);
  const at::Tensor attn_out = project(op, attended_rows, o, o_bias, o_out);
  add_deltas(op, lora, 1, attn_out, attended_rows);
  auto [post_normed, residual] = op.add_rms_norm.call(attn_out, hidden, post_weight, post_eps);
  const at::Tensor gate_up_out_rows = project(op, post_normed, gate_up, gate_up_bias, gate_up_out);
  add_deltas(op, lora, 2, gate_up_out_rows, post_normed);
  const at::Tensor mlp = op.silu_mul.call(gate_up_out_rows);
  const at::Tensor down_rows = project(op, mlp, down, down_bias, down_out);
  add_deltas(op, lora, 3, down_rows, mlp);
  return residual + down_rows;
}

at::Tensor decode_layer(const at::Tensor& hidden, const at::Tensor& in_weight, double in_eps, const at::Tensor& qkv,
                        const std::optional<at::Tensor>& qkv_bias, int64_t qkv_out, const at::Tensor& cos,
                        const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
                        double scale, const at::Tensor& o, const std::optional<at::Tensor>& o_bias, int64_t o_out,
                        const at::Tensor& post_weight, double post_eps, const at::Tensor& gate_up,
                        const std::optional<at::Tensor>& gate_up_bias, int64_t gate_up_out, const at::Tensor& down,
                        const std::optional<at::Tensor>& down_bias, int64_t down_out) {
  return layer_step(hidden, in_weight, in_eps, qkv, qkv_bias, qkv_out, cos, sin, num_heads, num_kv_heads, head_dim,
                    k_cache, v_cache, slot_mapping, block_table, context_lens, block_size, scale, o, o_bias, o_out,
                    post_weight, post_eps, gate_up, gate_up_bias, gate_up_out, down, down_bias, down_out, nullptr);
}

// Every layer of a decode step, one after another, each as decode_layer: the per-layer lists hold
// each layer's weights (PackedLinear's laid-out weight and fp32 bias or none) and KV caches; the
// sizes and constants are every layer's (the caller checks that they agree). Called once per step
// instead of once per layer from Python, which would parse decode_layer's 29 arguments and run its
// checks once per layer (bench.step_ab's "each layer from Python"; see docs/benchmarks.md). The
// same function on the same tensors: the same values. A step with LoRA rows passes their slots and,
// per projection group, every layer's lora_rows table stacked [layers, adapters * projections, 5]
// with the group's columns: each layer adds the deltas after the group's matmul, as the Python
// forward does.
at::Tensor decode_layers(const at::Tensor& hidden, at::TensorList in_weight, double in_eps, at::TensorList qkv,
                         const c10::List<std::optional<at::Tensor>>& qkv_bias, int64_t qkv_out, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                         const at::Tensor& block_table, const at::Tensor& context_lens, int64_t block_size,
                         double scale, at::TensorList o, const c10::List<std::optional<at::Tensor>>& o_bias,
                         int64_t o_out, at::TensorList post_weight, double post_eps, at::TensorList gate_up,
                         const c10::List<std::optional<at::Tensor>>& gate_up_bias, int64_t gate_up_out,
                         at::TensorList down, const c10::List<std::optional<at::Tensor>>& down_bias,
                         int64_t down_out, const std::optional<at::Tensor>& lora_slots,
                         const std::optional<at::Tensor>& lora_qkv, const std::optional<at::Tensor>& lora_o,
                         const std::optional<at::Tensor>& lora_gate_up, const std::optional<at::Tensor>& lora_down,
                         at::IntArrayRef lora_qkv_bounds, at::IntArrayRef lora_gate_up_bounds,
                         std::optional<at::ScalarType> lora_dtype) {
  const size_t layers = in_weight.size();
  for (const size_t size : {qkv.size(), qkv_bias.size(), k_caches.size(), v_caches.size(), o.size(), o_bias.size(),
                            post_weight.size(), gate_up.size(), gate_up_bias.size(), down.size(), down_bias.size()})
    TORCH_CHECK(size == layers, "decode_layers: one entry per layer in every list");
  const bool lora = lora_slots.has_value();
  const std::optional<at::Tensor>* tables[4] = {&lora_qkv, &lora_o, &lora_gate_up, &lora_down};
  TORCH_CHECK(!lora || lora_dtype.has_value(), "decode_layers: LoRA rows come with their weights' dtype");
  for (const auto* table : tables)
    TORCH_CHECK(!lora || (table->has_value() && (*table)->dim() == 3 &&
                          static_cast<size_t>((*table)->size(0)) == layers),
                "decode_layers: LoRA rows come with a table per projection group, each holding every layer's "
                "[layers, adapters * projections, 5]");
  const std::vector<int64_t> o_bounds{0, o_out}, down_bounds{0, down_out};
  at::Tensor x = hidden;
  for (size_t i = 0; i < layers; ++i) {
    std::optional<LayerLora> layer_lora;
    if (lora) {
      const auto l = static_cast<int64_t>(i);
      layer_lora.emplace(LayerLora{*lora_slots,
                                   {(*lora_qkv)[l], (*lora_o)[l], (*lora_gate_up)[l], (*lora_down)[l]},
                                   {lora_qkv_bounds, o_bounds, lora_gate_up_bounds, down_bounds},
                                   *lora_dtype});
    }
    x = layer_step(x, in_weight[i], in_eps, qkv[i], qkv_bias.get(i), qkv_out, cos, sin, num_heads, num_kv_heads,
                   head_dim, k_caches[i], v_caches[i], slot_mapping, block_table, context_lens, block_size, scale, o[i],
                   o_bias.get(i), o_out, post_weight[i], post_eps, gate_up[i], gate_up_bias.get(i), gate_up_out,
                   down[i], down_bias.get(i), down_out, layer_lora ? &*layer_lora : nullptr);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflightq, m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor in_weight, float in_eps, Tensor qkv, Tensor? qkv_bias, int qkv_out, "
      "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_table, Tensor context_lens, int block_size, "
      "float scale, Tensor o, Tensor? o_bias, int o_out, Tensor post_weight, float post_eps, Tensor gate_up, "
      "Tensor? gate_up_bias, int gate_up_out, Tensor down, Tensor? down_bias, int down_out) -> Tensor");
  m.impl("decode_layer", c10::DispatchKey::CPU, TORCH_FN(decode_layer));
  m.def(
      "decode_layers(Tensor hidden, Tensor[] in_weight, float in_eps, Tensor[] qkv, Tensor?[] qkv_bias, int qkv_out, "
      "Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor block_table, Tensor context_lens, int block_size, "
      "float scale, Tensor[] o, Tensor?[] o_bias, int o_out, Tensor[] post_weight, float post_eps, Tensor[] gate_up, "
      "Tensor?[] gate_up_bias, int gate_up_out, Tensor[] down, Tensor?[] down_bias, int down_out, "
      "Tensor? lora_slots=None, Tensor? lora_qkv=None, Tensor? lora_o=None, Tensor? lora_gate_up=None, "
      "Tensor? lora_down=None, int[] lora_qkv_bounds=[], int[] lora_gate_up_bounds=[], ScalarType? lora_dtype=None) "
      "-> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
}
