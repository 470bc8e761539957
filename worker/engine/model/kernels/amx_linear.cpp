// A bf16 linear layer for the few to few dozen rows of a decode step, on AMX tiles.
//
// A decode step of 2-32 sequences multiplies each weight by a few rows: a read of every weight
// with a little arithmetic per byte. AVX512-BF16's dot product (decode_linear.cpp) runs out of
// arithmetic past a handful of rows, and oneDNN's AMX matmul, blocked for large row counts, stays
// near half the memory's rate at these shapes. Here the weight is laid out once, at load, as AMX
// B tiles: per group of 32 output columns, its 32-value chunks of the input dimension one after
// another, each chunk two 1 KB tiles of 16 columns ([N / 32][K / 32][2][16 pairs][16 columns][2]),
// so a thread walks one contiguous stream per group; up to 16 input rows make an A tile, and up
// to two A tiles (32 rows) share each B tile as it streams by: four accumulator tiles, four tile
// dot products per chunk, and the weight read once. More than 32 rows go in passes whose second
// reads the group from L2. Groups of 32 columns (not 64) leave the eight tile registers room for
// the two A tiles, and split a model's narrow projections evenly over the threads.
//
// Results: products of bf16 values are exact in fp32 and summed in fp32 (TDPBF16PS), bias added
// in fp32, rounded once to bf16 -- what a native bf16 matmul does, in another order.
//
// Linux hands out AMX state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM):
// amx_linear_supported asks once and says whether the tiles can be used. Without AMX at build
// time a plain loop over the same layout gives the same results, so the op exists and is
// tested on every CPU. Built with the other CPU kernels by cpu_kernel.py; registered as
// torch.ops.inflightq.amx_linear. Figures: docs/benchmarks.md.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "linear_call.h"
#include "rounding.h"

#include <algorithm>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define INFLIGHTQ_AMX 1
#endif

namespace {

constexpr int64_t TILE_COLS = 16;                   // output columns per B tile (and per C tile)
constexpr int64_t GROUP_TILES = 2;                  // B tiles per chunk of a group
constexpr int64_t GROUP_COLS = TILE_COLS * GROUP_TILES;  // output columns per group: 32
constexpr int64_t CHUNK = 32;                       // input-dimension values per tile (16 bf16 pairs)
constexpr int64_t TILE_ELEMS = CHUNK * TILE_COLS;   // bf16 values per B tile: 1 KB
constexpr int64_t TILE_ROWS = 16;                   // input rows per A tile
constexpr int64_t PASS_ROWS = 2 * TILE_ROWS;        // input rows per pass over a group (two A tiles)
constexpr int64_t MAX_ROWS = 64;                    // input rows one call takes

using inflightq_rounding::bf16_bits;
using inflightq_rounding::widen_bf16_bits;

#if defined(INFLIGHTQ_AMX)
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
  constexpr long XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// For a pass of `rows` (1 to 32) input rows: tiles 0-1 accumulate the first A tile's rows (up to
// 16) against the chunk's two B tiles, 2-3 the second's (the rest); 4-5: the A tiles (rows x 32
// bf16); 6-7: the B tiles (16 pairs x 16 columns). A pass of 16 rows or fewer leaves 2, 3 and 5
// unconfigured.
void configure(int rows) {
  TileConfig config;
  const int first = std::min<int>(rows, TILE_ROWS), second = rows - first;
  for (const int t : {0, 1, 4}) {
    config.rows[t] = static_cast<uint8_t>(first);
    config.colsb[t] = 64;
  }
  if (second > 0)
    for (const int t : {2, 3, 5}) {
      config.rows[t] = static_cast<uint8_t>(second);
      config.colsb[t] = 64;
    }
  for (const int t : {6, 7}) {
    config.rows[t] = CHUNK / 2;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

constexpr int64_t SUMS_ROW_BYTES = GROUP_COLS * sizeof(float);

// One group's 32 output columns for up to 16 input rows into sums (rows x 32 fp32).
void group_sums(const uint16_t* group, const uint16_t* x, int64_t k, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  const int64_t stride = k * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t c = 0; c < k; c += CHUNK) {
    const uint16_t* tiles = group + c * GROUP_COLS;
    // No software prefetch: the hardware prefetcher follows the contiguous stream, and prefetching
    // it too was slower (docs/benchmarks.md).
    _tile_loadd(4, x + c, stride);
    _tile_loadd(6, tiles, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, tiles + TILE_ELEMS, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, sums, SUMS_ROW_BYTES);
  _tile_stored(1, sums + TILE_COLS, SUMS_ROW_BYTES);
}

// The same for 17 to 32 input rows: each B tile, loaded once, meets both A tiles.
void group_sums_two(const uint16_t* group, const uint16_t* x, int64_t k, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t stride = k * static_cast<int64_t>(sizeof(uint16_t));
  const uint16_t* x_second = x + TILE_ROWS * k;
  for (int64_t c = 0; c < k; c += CHUNK) {
    const uint16_t* tiles = group + c * GROUP_COLS;
    _tile_loadd(4, x + c, stride);
    _tile_loadd(5, x_second + c, stride);
    _tile_loadd(6, tiles, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, tiles + TILE_ELEMS, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  float* sums_second = sums + TILE_ROWS * GROUP_COLS;
  _tile_stored(0, sums, SUMS_ROW_BYTES);
  _tile_stored(1, sums + TILE_COLS, SUMS_ROW_BYTES);
  _tile_stored(2, sums_second, SUMS_ROW_BYTES);
  _tile_stored(3, sums_second + TILE_COLS, SUMS_ROW_BYTES);
}
#endif

// The plain loop: the same sums from the same layout, one product at a time.
void group_sums_plain(const uint16_t* group, const uint16_t* x, int64_t k, int64_t rows, float* sums) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t col = 0; col < GROUP_COLS; ++col) {
      const int64_t tile = col / TILE_COLS, n = col % TILE_COLS;
      float s = 0.f;
      for (int64_t c = 0; c < k; c += CHUNK) {
        const uint16_t* b = group + c * GROUP_COLS + tile * TILE_ELEMS;
        for (int64_t i = 0; i < CHUNK; ++i)
          s += widen_bf16_bits(b[(i / 2) * 2 * TILE_COLS + 2 * n + i % 2]) * widen_bf16_bits(x[m * k + c + i]);
      }
      sums[m * GROUP_COLS + col] = s;
    }
}

void write_rows(const float* sums, const float* bias, uint16_t* y, int64_t n, int64_t rows, int64_t col0) {
  const int64_t cols = std::min(GROUP_COLS, n - col0);
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* y_row = y + m * n + col0;
    const float* s = sums + m * GROUP_COLS;
    for (int64_t j = 0; j < cols; ++j) y_row[j] = bf16_bits(s[j] + (bias ? bias[col0 + j] : 0.f));
  }
}

// [N, K] bf16 -> [ceil(N / 32), K / 32, 2, 16, 16, 2]: the tiles `group_sums` reads (zero rows pad N).
at::Tensor amx_linear_layout(const at::Tensor& weight) {
  const auto rows = inflightq_linear::padded_weight("amx_linear_layout", weight, CHUNK, GROUP_COLS);
  const int64_t groups = rows.size(0) / GROUP_COLS, k = rows.size(1);
  // [group, tile, column, chunk, pair, 2] -> [group, chunk, tile, pair, column, 2]
  return rows.view({groups, GROUP_TILES, TILE_COLS, k / CHUNK, CHUNK / 2, 2}).permute({0, 3, 1, 4, 2, 5}).contiguous();
}

bool amx_linear_supported() {
#if defined(INFLIGHTQ_AMX)
  static const bool granted = request_amx();
  return granted;
#else
  return false;
#endif
}

at::Tensor amx_linear(const at::Tensor& input, const at::Tensor& laid_out, const std::optional<at::Tensor>& bias,
                      int64_t out_features) {
  TORCH_CHECK(laid_out.dim() == 6 && laid_out.size(1) * CHUNK == input.size(-1), "amx_linear: weight layout");
  const int64_t groups = laid_out.size(0);
  TORCH_CHECK(out_features <= groups * GROUP_COLS && out_features > (groups - 1) * GROUP_COLS,
              "amx_linear: out_features does not match the weight");
  const auto call = inflightq_linear::prepare("amx_linear", input, laid_out, bias, out_features, MAX_ROWS);
  if (call.m == 0) return call.out;
  const at::Tensor w = laid_out.contiguous();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const float* bp = call.bias();
  uint16_t* yp = call.output();
  const int64_t m = call.m, k = call.k;
  const bool tiles = amx_linear_supported();
  const int64_t n = out_features;
  // Passes of equal rows (past 32, two of half the rows each), so the tiles are configured once per
  // thread rather than twice per group; an odd row count gets a zero row, whose sums are dropped.
  const int64_t passes = (m + PASS_ROWS - 1) / PASS_ROWS;
  const int64_t pass_rows = (m + passes - 1) / passes;
  at::Tensor x = call.x;
  if (tiles && passes * pass_rows != m) {
    x = at::zeros({passes * pass_rows, k}, call.x.options());
    x.narrow(0, 0, m).copy_(call.x);
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float sums[PASS_ROWS * GROUP_COLS];
    int64_t configured = 0;  // the rows the tiles are configured for
    for (int64_t g = g0; g < g1; ++g) {
      const uint16_t* group = wp + g * k * GROUP_COLS;
      // A group's second pass (past 32 rows) reads its weight again, from L2 now.
      for (int64_t h = 0; h < m; h += pass_rows) {
        const int64_t rows = std::min(pass_rows, m - h);  // the rows written; the tiles take pass_rows
#if defined(INFLIGHTQ_AMX)
        if (tiles) {
          if (pass_rows != configured) configure(static_cast<int>(pass_rows));
          configured = pass_rows;
          if (pass_rows > TILE_ROWS)
            group_sums_two(group, xp + h * k, k, sums);
          else
            group_sums(group, xp + h * k, k, sums);
        } else {
          group_sums_plain(group, xp + h * k, k, rows, sums);
        }
#else
        (void)tiles;
        (void)configured;
        group_sums_plain(group, xp + h * k, k, rows, sums);
#endif
        write_rows(sums, bp, yp + h * n, n, rows, g * GROUP_COLS);
      }
    }
#if defined(INFLIGHTQ_AMX)
    if (configured) _tile_release();
#endif
  });
  return call.out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflightq, m) {
  m.def("amx_linear_layout(Tensor weight) -> Tensor");
  m.impl("amx_linear_layout", c10::DispatchKey::CPU, TORCH_FN(amx_linear_layout));
  m.def("amx_linear_supported() -> bool");
  m.impl("amx_linear_supported", TORCH_FN(amx_linear_supported));
  m.def("amx_linear(Tensor input, Tensor laid_out, Tensor? bias, int out_features) -> Tensor");
  m.impl("amx_linear", c10::DispatchKey::CPU, TORCH_FN(amx_linear));
}
