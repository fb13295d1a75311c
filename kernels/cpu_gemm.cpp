// bfloat16 linear layers on CPUs with AVX512-BF16 dot products and no AMX tiles (AMD Zen 4 here).
//
// oneDNN's packed bfloat16 GEMM is weak at the row counts decode runs at on these CPUs: measured on the
// 2-core AMD EPYC (Zen 4), SmolLM2's 30 layers at 48 rows ran 290 GFLOP/s (16 rows 207, 1 row ~13) where
// the same CPU reaches ~440 on large matrices. Here the weight is laid out once in pairs of inputs,
// [ceil(N/32), K/2, 32, 2] (zero rows pad N), so that one 512-bit load holds 16 outputs' next two weights,
// and a register block of 12 rows x 32 outputs runs VDPBF16PS over a broadcast pair of each row's inputs:
// 24 float32 accumulators live in registers over all of K, and the weight block read once per 12 rows
// stays in L2. Work items (48 rows x 64 or 96 outputs) go to ATen's threads from a shared counter, so a thread
// that the OS preempts for a moment leaves its share to the other rather than holding it at a barrier.
// Sums are float32, rounded to bfloat16 once (nearest even), as oneDNN's are.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>

#include "cpu_deal.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK_N = 32;  // outputs per weight block: two 512-bit vectors of float32 sums
constexpr int BLOCK_M = 12;      // rows per register block: 12 x 2 accumulators of the 32 vector registers
constexpr int64_t ITEM_M = 4 * BLOCK_M;  // rows per work item
// Weight blocks per work item: adjacent, so the L2 prefetch runs on into the item's next block (SmolLM2's layers
// at 16-64 rows 6-15% faster with 2 than with 1, alternated runs; 4 no better than 2). 2 or 3, whichever deals
// the items most evenly over the threads: a 576-wide output's 18 blocks in items of 2 give one of two threads
// 5 items and the other 4; in items of 3, 3 each.
int64_t item_blocks(int64_t nblocks, int64_t row_groups, int64_t threads) {
  auto span = [&](int64_t per_item) {  // weight blocks the busiest thread runs its row groups through
    const int64_t items = row_groups * ((nblocks + per_item - 1) / per_item);
    return (items + threads - 1) / threads * per_item;
  };
  return span(3) < span(2) ? 3 : 2;
}

bool pair_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
// R rows of x (K2 pairs of bfloat16 each, as 32-bit words) times one weight block [K2, 32 pairs]
// -> y[R, n_valid <= 32] bfloat16 (+ bias).
template <int R>
void block(const uint32_t* x, const uint32_t* w, int64_t K2, const float* bias, uint16_t* y, int64_t y_stride,
           int64_t n_valid) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k * BLOCK_N);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k * BLOCK_N + 16);
    // prefetches never fault past the end; into L2 further ahead: at 1 row (memory-bound) the 30 layers'
    // weights took 7.5-8.1 ms against 8.6-9.7 with the L1 prefetch alone (~28 GB/s, near a plain sum's 32)
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 16) * BLOCK_N), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 16) * BLOCK_N + 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 96) * BLOCK_N), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 96) * BLOCK_N + 16), _MM_HINT_T1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * K2 + k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pair, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pair, w1);
    }
  }
  const __mmask16 low = n_valid >= 16 ? 0xffff : (1u << n_valid) - 1;
  const __mmask16 high = n_valid >= 32 ? 0xffff : n_valid <= 16 ? 0 : (1u << (n_valid - 16)) - 1;
  for (int r = 0; r < R; ++r) {
    for (int half = 0; half < 2; ++half) {
      __m512 sum = acc[r][half];
      if (bias != nullptr) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(half ? high : low, bias + half * 16));
      _mm256_mask_storeu_epi16(y + r * y_stride + half * 16, half ? high : low, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

using BlockFn = void (*)(const uint32_t*, const uint32_t*, int64_t, const float*, uint16_t*, int64_t, int64_t);
template <int... Rs>
constexpr std::array<BlockFn, sizeof...(Rs)> blocks_by_rows(std::integer_sequence<int, Rs...>) {
  return {block<Rs + 1>...};
}
constexpr auto BLOCKS = blocks_by_rows(std::make_integer_sequence<int, BLOCK_M>{});  // [R - 1]
#endif

// x [M, K] bfloat16, weight [ceil(N/32), K/2, 32, 2] bfloat16, bias [N] float32 or none -> [M, N] bfloat16
at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& weight, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous [M, K] bfloat16");
  const int64_t M = x.size(0), K = x.size(1), K2 = K / 2, nblocks = weight.size(0);
  TORCH_CHECK(weight.dim() == 4 && weight.size(1) == K2 && weight.size(2) == BLOCK_N && weight.size(3) == 2 &&
                  weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 && K % 2 == 0,
              "weight: [ceil(N/32), K/2, 32, 2] bfloat16 for an even K");
  TORCH_CHECK(nblocks == (N + BLOCK_N - 1) / BLOCK_N, "N does not match the weight's blocks");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat),
              "bias: [N] float32");
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint32_t*>(weight.data_ptr());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t row_groups = (M + ITEM_M - 1) / ITEM_M, threads = deal_threads();
  const int64_t per_item = item_blocks(nblocks, row_groups, threads), nitems = (nblocks + per_item - 1) / per_item;
  const int64_t items = row_groups * nitems;  // row groups outer: a group's x stays in L2
  deal_items(items, [] { return 0; }, [&](int64_t item, int) {
    const int64_t m_begin = item / nitems * ITEM_M, m_end = std::min(M, m_begin + ITEM_M);
    const int64_t b_end = std::min(nblocks, (item % nitems + 1) * per_item);
    for (int64_t b = item % nitems * per_item; b < b_end; ++b) {
      const int64_t n = b * BLOCK_N;
      for (int64_t m = m_begin; m < m_end; m += BLOCK_M) {
        const int rows = static_cast<int>(std::min<int64_t>(BLOCK_M, m_end - m));
        BLOCKS[rows - 1](xp + m * K2, wp + n * K2, K2, bp ? bp + n : nullptr, yp + m * N + n, N,
                         std::min(BLOCK_N, N - n));
      }
    }
  });
#else
  TORCH_CHECK(false, "pair_linear needs AVX512-BF16 (check pair_linear_supported())");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("pair_linear(Tensor x, Tensor weight, int N, Tensor? bias) -> Tensor", &pair_linear);
  m.def("pair_linear_supported() -> bool", &pair_linear_supported);
}
