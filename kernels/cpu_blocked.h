// The register kernel of kvloom's blocked GEMM (cpu_gemm.cpp's blocked_linear, and cpu_quant_gemm.cpp's many-row
// path, which runs it on GGUF tiles de-quantized into this layout): a weight block of 32 outputs laid out as
// [K/E words][32 outputs][E] (E inputs a 32-bit word: a pair of bfloat16 or one float32), so that one 512-bit load
// holds 16 outputs' next word, and a register block of up to 12 rows x 32 outputs meets a broadcast word of each
// row's inputs (VDPBF16PS over a pair, or FMAs): 24 float32 accumulators live in registers over all of K. A row's
// sums run in input order whatever the rows beside it. Sums are float32, rounded to bfloat16 once (nearest even).
#pragma once
#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <utility>

#include "cpu_deal.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {  // each library's own copy: the ISA variants' builds must not share these symbols

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

// How one 32-bit word of the weight meets a row's inputs. X_WORDS: 32-bit words of x per weight word (x as the
// kernel reads it: cpu_gemm.cpp widens bfloat16 x to float32 where the CPU has no bfloat16 arithmetic).
#if defined(__AVX512F__)
struct Float32 {  // one float32 input a word, FMA (any AVX-512 CPU)
  using Out = float;
  static constexpr int X_WORDS = 1;
  static __m512 step(__m512 acc, const uint32_t* x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_set1_ps(std::bit_cast<float>(*x)), _mm512_castsi512_ps(w), acc);
  }
  static void store(Out* y, __mmask16 mask, __m512 sum) { _mm512_mask_storeu_ps(y, mask, sum); }
};
#endif
#if defined(__AVX512BF16__)
struct BFloat16Pairs {  // a pair of bfloat16 inputs a word, VDPBF16PS (AVX512-BF16)
  using Out = uint16_t;
  static constexpr int X_WORDS = 1;
  static __m512 step(__m512 acc, const uint32_t* x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(*x)), (__m512bh)w);
  }
  static void store(Out* y, __mmask16 mask, __m512 sum) {  // rounded once, to nearest even
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(sum));
  }
};
#elif defined(__AVX512F__)
// The same pairs on AVX-512 without bfloat16 arithmetic: each weight word widened to its two float32 values in
// registers (a bfloat16 is a float32's top half) and two FMAs against x widened to float32 once per call, so
// the weights stream at half of float32's bytes and the math costs float32's plus a shift and a mask per
// weight vector (shared by a block's 12 rows).
struct BFloat16Pairs {
  using Out = uint16_t;
  static constexpr int X_WORDS = 2;
  static __m512 step(__m512 acc, const uint32_t* x, __m512i w) {
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(std::bit_cast<float>(x[0])), even, acc);
    return _mm512_fmadd_ps(_mm512_set1_ps(std::bit_cast<float>(x[1])), odd, acc);
  }
  static void store(Out* y, __mmask16 mask, __m512 sum) {  // rounded once, to nearest even; NaN stays NaN
    const __m512i bits = _mm512_castps_si512(sum);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(rounded));
  }
};
#endif

#if defined(__AVX512F__)
// R rows of x (KW 32-bit words of inputs each) times one weight block [KW, 32 words] -> y[R, n_valid <= 32]
// (+ bias).
template <typename Words, int R>
void block(const uint32_t* x, const uint32_t* w, int64_t KW, const float* bias, typename Words::Out* y,
           int64_t y_stride, int64_t n_valid) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < KW; ++k) {
    const __m512i w0 = _mm512_loadu_si512(w + k * BLOCK_N);
    const __m512i w1 = _mm512_loadu_si512(w + k * BLOCK_N + 16);
    // prefetches never fault past the end; into L2 further ahead: at 1 row (memory-bound) the 30 layers'
    // weights took 7.5-8.1 ms against 8.6-9.7 with the L1 prefetch alone (~28 GB/s, near a plain sum's 32)
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 16) * BLOCK_N), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 16) * BLOCK_N + 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 96) * BLOCK_N), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(w + (k + 96) * BLOCK_N + 16), _MM_HINT_T1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const uint32_t* xk = x + (r * KW + k) * Words::X_WORDS;
      acc[r][0] = Words::step(acc[r][0], xk, w0);
      acc[r][1] = Words::step(acc[r][1], xk, w1);
    }
  }
  const __mmask16 low = n_valid >= 16 ? 0xffff : (1u << n_valid) - 1;
  const __mmask16 high = n_valid >= 32 ? 0xffff : n_valid <= 16 ? 0 : (1u << (n_valid - 16)) - 1;
  for (int r = 0; r < R; ++r) {
    for (int half = 0; half < 2; ++half) {
      __m512 sum = acc[r][half];
      if (bias != nullptr) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(half ? high : low, bias + half * 16));
      Words::store(y + r * y_stride + half * 16, half ? high : low, sum);
    }
  }
}

template <typename Words>
using BlockFn = void (*)(const uint32_t*, const uint32_t*, int64_t, const float*, typename Words::Out*, int64_t,
                         int64_t);
template <typename Words, int... Rs>
constexpr std::array<BlockFn<Words>, sizeof...(Rs)> blocks_by_rows(std::integer_sequence<int, Rs...>) {
  return {block<Words, Rs + 1>...};
}

// Rows [m_begin, m_end) of x (KW words each) against weight block w, outputs n.. n+31 of y [.., N] (+ bias), a
// register block of up to BLOCK_M rows at a time.
template <typename Words>
void block_rows(const uint32_t* x, int64_t KW, const uint32_t* w, const float* bias, typename Words::Out* y,
                int64_t N, int64_t n, int64_t m_begin, int64_t m_end) {
  static constexpr auto BLOCKS = blocks_by_rows<Words>(std::make_integer_sequence<int, BLOCK_M>{});  // [R - 1]
  for (int64_t m = m_begin; m < m_end; m += BLOCK_M) {
    const int rows = static_cast<int>(std::min<int64_t>(BLOCK_M, m_end - m));
    BLOCKS[rows - 1](x + m * KW * Words::X_WORDS, w, KW, bias ? bias + n : nullptr, y + m * N + n, N,
                     std::min(BLOCK_N, N - n));
  }
}

// x [M, KW words] against weight blocks [ceil(N/32)][KW][32 outputs] -> y [M, N] (+ bias): work items of ITEM_M rows
// by item_blocks adjacent weight blocks, dealt from a shared counter (cpu_deal.h), so a thread that the OS preempts
// for a moment leaves its share to the other rather than holding it at a barrier.
template <typename Words>
void run_blocks(const uint32_t* x, int64_t M, int64_t KW, const uint32_t* w, const float* bias,
                typename Words::Out* y, int64_t N) {
  const int64_t nblocks = (N + BLOCK_N - 1) / BLOCK_N;
  const int64_t row_groups = (M + ITEM_M - 1) / ITEM_M, threads = deal_threads();
  const int64_t per_item = item_blocks(nblocks, row_groups, threads), nitems = (nblocks + per_item - 1) / per_item;
  const int64_t items = row_groups * nitems;  // row groups outer: a group's x stays in L2
  deal_items(items, [] { return 0; }, [&](int64_t item, int) {
    const int64_t m_begin = item / nitems * ITEM_M, m_end = std::min(M, m_begin + ITEM_M);
    const int64_t b_end = std::min(nblocks, (item % nitems + 1) * per_item);
    for (int64_t b = item % nitems * per_item; b < b_end; ++b)
      block_rows<Words>(x, KW, w + b * BLOCK_N * KW, bias, y, N, b * BLOCK_N, m_begin, m_end);
  });
}
#endif

}  // namespace
