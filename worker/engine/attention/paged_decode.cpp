// Paged attention for decode steps on CPU: one query token per sequence, K/V read in place.
//
// The plain-torch path gathers every decode's context out of the paged cache (index_select)
// and then runs two batched matmuls over the copy: on a 2-core box at 32 sequences of ~200
// tokens that is ~40% of a decode step, mostly memory traffic for the copy. This kernel walks
// each sequence's block table and reads each cached K and V row once, for all the query heads
// that share its kv head (grouped-query attention), with scores and the softmax in the
// accumulation type (fp32 for fp32/bf16/fp16, fp64 for fp64) as the torch path does.
//
// Built on first use by worker/engine/attention/cpu_kernel.py (torch.utils.cpp_extension) and
// registered as torch.ops.inflightq.paged_decode.

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const scalar_t* k_block = k_head + table[start / block_size] * block_size * head_dim;
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t* k_row = k_block + i * head_dim;
          for (int64_t g = 0; g < group; ++g) {
            const acc_t* q_g = q_acc.data() + g * head_dim;
            acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += q_g[d] * static_cast<acc_t>(k_row[d]);
            scores[g * len + start + i] = dot * scale_acc;
          }
        }
      }

      // Softmax per query head, normalised at the end so the weights stay in acc_t.
      std::fill(o_acc.begin(), o_acc.end(), acc_t(0));
      std::vector<acc_t> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        acc_t* s = scores.data() + g * len;
        acc_t peak = -std::numeric_limits<acc_t>::infinity();
        for (int64_t t = 0; t < len; ++t) peak = std::max(peak, s[t]);
        acc_t total = 0;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - peak);
          total += s[t];
        }
        inv_sum[g] = acc_t(1) / total;
      }

      // Weighted sum of V rows, again reading each row once for the whole group.
      for (int64_t start = 0; start < len; start += block_size) {
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
// slots ([Hkv, slots, D]). index_copy_ does the same but costs ~25 us per call for a few dozen
// rows (two calls per layer per step: ~1.5 ms of a 32-sequence step on the 2-core box).
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

void cache_write(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache, at::Tensor v_cache,
                 const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu(), "cache_write runs on CPU tensors");
  TORCH_CHECK(key.dim() == 4 && key.size(0) == 1 && key.sizes() == value.sizes(), "key/value must be [1, Hkv, T, D]");
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
