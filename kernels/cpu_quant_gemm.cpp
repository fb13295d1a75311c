// Weight-only quantized linears: GGUF Q4_1, Q4_0 and Q8_0 weights (blocks of 32 along the input) run as the file
// stores them, dequantized in registers, so a batch-1 decode reads each weight byte once (0.625 bytes a weight for
// Q4_1, 1.0625 for Q8_0, against bfloat16's 2).
//
// Layout (kernels/quantized_linear.py packs it once at load): tiles of 16 outputs by one block of 32 inputs,
// [ceil(N/16), K/32, tile bytes], each output tile's blocks contiguous; the file's bytes rearranged, nothing added
// but the zero outputs padding N (and Q4_0's min):
//   Q4 (Q4_1; Q4_0 as Q4_1 with m = -8d), 320 bytes: d[16] f16, m[16] f16, then 8 chunks of 32 bytes: chunk c's byte
//      2j+e holds output j's weights at inputs 2c+e (low nibble) and 2c+16+e (high nibble); w = d*q + m.
//   Q8 (Q8_0), 544 bytes: d[16] f16, then 16 chunks of 32 int8: chunk p's byte 2j+e is output j's weight at input
//      2p+e; w = d*q.
// Read as 16-bit words, a chunk holds one word an output (Q4: four nibbles, inputs 2c, 2c+16, 2c+1, 2c+17; Q8: two
// bytes, inputs 2p, 2p+1), so float32 lanes are outputs (AVX-512: 16, AVX2: 2 x 8, or plain C++). Read as bytes
// widened to 16 bits, it holds bfloat16 pairs: lane 2j+e is output j's input 2c+e (Q4: and 2c+16+e), which VDPBF16PS
// reduces against a broadcast pair of bfloat16 inputs (AVX512-BF16, bfloat16 activations): 32 weights an instruction,
// as kvloom's bfloat16 GEMM.
//
// Math: per block, S = sum over its 32 inputs of x*q in float32 (q small integers, exact in float32 or bfloat16),
// then y += d*S + m*X, with X the block's sum of x (once per call and row). In the VDPBF16PS kernel q becomes a
// bfloat16 by bits alone: 0x3F80 | q << 3 is 1 + q/16, so its sum is S' = X + S/16 and d*S + m*X = 16d*S' + (m-16d)*X;
// Q8's int8 go through float32 (exact).
// Sums are float32, rounded once to bfloat16 (nearest even) for bfloat16 activations. Work items (rows x adjacent
// tiles) are dealt from a shared counter as in kvloom's other kernels (cpu_deal.h).
//
// That per-block scaling makes the exact kernel ~1.18x slower than a bfloat16 GEMM once rows make it compute-bound,
// so from DEQUANTIZE_ROWS rows of bfloat16 x (AVX512-BF16) the tiles are de-quantized to bfloat16 in cache and run
// by kvloom's blocked GEMM kernel (run_dequantized): the de-quantized model's weights and arithmetic, bit for bit.
//
// Asked for (`quantization: gguf-int8`, W8A8 checkpoints), on CPUs with AVX512-VNNI, tiles are packed in a layout of
// their own and every call runs in int8 (int8_rows, below): x quantized a block at a time (llama.cpp's way), which
// costs accuracy (docs/performance.md, session 46), and VPDPBUSD takes a block's 32 inputs by 16 outputs in 8
// instructions, where the exact kernel's per-block scaling and unpacking cost more than its 16 VDPBF16PS.
//
// Built for this CPU (-march=native), and by tests for the instruction sets below it (cpu_extensions.ISA_VARIANTS:
// ops suffixed _avx512, _avx2, _generic), so each of its paths is tested where the host runs it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "cpu_blocked.h"
#include "cpu_deal.h"
#include "cpu_vec.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE_N = 16;   // outputs per tile
constexpr int64_t BLOCK_K = 32;  // weights per GGUF block
constexpr int64_t SERIAL_PREP = 1 << 15;  // x elements prepared on the calling thread (waking the team costs more)
constexpr int64_t MAX_ITEM_TILES = 32;    // tiles per work item at most (a few hundred KB of weights)
constexpr int64_t DEQUANTIZE_ROWS = 32;   // from this many, bfloat16 x meets de-quantized tiles (run_dequantized)

// The weight stream 4 KB ahead into L2 (an item's tiles are contiguous; prefetches never fault), on a tile's first
// pass only (from memory; the row blocks after it find it in cache, where prefetches cost Q8_0 10% at 16-64 rows).
// SmolLM2's batch-1 GEMMs (96 MB, cold) on a loaded 2-core EPYC, best of 3 alternated runs: 3.8 ms against 4.7
// without, and an L1 prefetch 1 KB ahead was slower than none (one thread: 4.7 ms with or without, 5.6 with it).
inline void prefetch(const uint8_t* tile) {
  __builtin_prefetch(tile + 4096, 0, 2);
  __builtin_prefetch(tile + 4096 + 256, 0, 2);
}

// float32 vectors of N outputs, and the loads that make them from a tile
#if defined(__AVX512F__)
struct Lanes {
  static constexpr int N = 16, R_MAX = 8, CHAINS = 2;  // 3 accumulators a row of 32 registers
  static constexpr const char* ISA = "avx512";
  using F = __m512;
  using Words = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static F splat(float a) { return _mm512_set1_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Words words(const uint8_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  template <int SHIFT>
  static F nibbles(Words w) {
    const Words shifted = SHIFT ? _mm512_srli_epi32(w, SHIFT) : w;
    return _mm512_cvtepi32_ps(SHIFT == 12 ? shifted : _mm512_and_si512(shifted, _mm512_set1_epi32(15)));
  }
  template <int BYTE>  // byte BYTE of each word, as a signed int8
  static F signed_byte(Words w) {
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * BYTE), 24));
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Lanes {
  static constexpr int N = 8, R_MAX = 2, CHAINS = 1;  // 4 accumulators a row of 16 registers
  static constexpr const char* ISA = "avx2";
  using F = __m256;
  using Words = __m256i;
  static F zero() { return _mm256_setzero_ps(); }
  static F splat(float a) { return _mm256_set1_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static Words words(const uint8_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  template <int SHIFT>
  static F nibbles(Words w) {
    const Words shifted = SHIFT ? _mm256_srli_epi32(w, SHIFT) : w;
    return _mm256_cvtepi32_ps(SHIFT == 12 ? shifted : _mm256_and_si256(shifted, _mm256_set1_epi32(15)));
  }
  template <int BYTE>
  static F signed_byte(Words w) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * BYTE), 24));
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#else
struct Lanes {  // one output a lane, plain C++ (the compiler vectorizes what it can)
  static constexpr int N = 1, R_MAX = 4, CHAINS = 1;
  static constexpr const char* ISA = "generic";
  using F = float;
  using Words = uint32_t;
  static F zero() { return 0.f; }
  static F splat(float a) { return a; }
  // one rounding, and a builtin that -ffast-math's reassociation leaves in order (a chain of a * b + c it may split
  // into partial sums, differently for each row count): a row's result stays independent of its batch
  static F fma(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  static F add(F a, F b) { return a + b; }
  static F halves(const uint8_t* p) {
    uint16_t bits;
    std::memcpy(&bits, p, 2);
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
  static Words words(const uint8_t* p) { return p[0] | static_cast<Words>(p[1]) << 8; }
  template <int SHIFT>
  static F nibbles(Words w) { return static_cast<float>((w >> SHIFT) & 15); }
  template <int BYTE>
  static F signed_byte(Words w) { return static_cast<float>(static_cast<int8_t>(w >> (8 * BYTE))); }
  static void store(float* p, F v) { *p = v; }
};
#endif

// A block's sum for an output runs in CHAINS chains (steps alternating between them, added at the block's end) and
// joins the output's total in block order, whatever the rows R of the register block: a row's result does not depend
// on the rows batched with it. For the latency of dependent FMAs to hide, a kernel wants 4 sums in flight: at few rows
// it runs blocks_for(R, sums a block and row) adjacent blocks in turn (memory order: one stream), which the
// out-of-order core overlaps.
constexpr int blocks_for(int rows, int sums) { return rows * sums >= 4 ? 1 : 4 / (rows * sums); }

template <typename V, size_t C>
V total(const std::array<V, C>& chains) {
  V sum = chains[0];
  for (size_t i = 1; i < C; ++i) sum = Lanes::add(sum, chains[i]);
  return sum;
}

// A block format: per block, the float32 kernel's STEPS steps of PER_STEP weight vectors (one input each; lanes are
// outputs) and, under AVX512-BF16, the pair kernel's PAIR_STEPS steps of PAIR_PER_STEP bfloat16 vectors (a pair of
// inputs each, lane 2j+e output j's input of parity e); then y += d*S (+ m*X where MIN).
struct Q4 {
  static constexpr int64_t TILE = 64 + 256;
  static constexpr bool MIN = true;
  static constexpr int STEPS = 8, PER_STEP = 4;  // step c: a chunk's words, nibbles for inputs 2c, 2c+16, 2c+1, 2c+17
  static int input(int step, int i) { return 2 * step + std::array{0, 16, 1, 17}[i]; }
  static void weights(const uint8_t* tile, int step, int h, Lanes::F (&q)[PER_STEP]) {
    const Lanes::Words w = Lanes::words(tile + 64 + 32 * step + 2 * Lanes::N * h);
    q[0] = Lanes::nibbles<0>(w);
    q[1] = Lanes::nibbles<4>(w);
    q[2] = Lanes::nibbles<8>(w);
    q[3] = Lanes::nibbles<12>(w);
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  static constexpr int PAIR_STEPS = 8, PAIR_PER_STEP = 2;  // step c: a chunk's bytes, pairs (2c, 2c+1), (2c+16, 2c+17)
  static int pair(int step, int i) { return step + 8 * i; }
  // q as the bfloat16 1 + q/16, by bits: (nibble << 3) | 0x3F80 (ternary logic 0xEA: (a & b) | c)
  static void pair_weights(const uint8_t* tile, int step, __m512bh (&q)[PAIR_PER_STEP]) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 + 32 * step)));
    const __m512i nibble = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(0x3F80);
    q[0] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 3), nibble, one, 0xEA);
    q[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 1), nibble, one, 0xEA);
  }
  // the sum of 1 + q/16 is X + S/16: d*S + m*X = 16d * that + (m - 16d) * X
  static __m512 pair_scale(const uint8_t* tile) { return _mm512_mul_ps(Lanes::halves(tile), _mm512_set1_ps(16.f)); }
  static __m512 pair_min(const uint8_t* tile, __m512 scale) { return _mm512_sub_ps(Lanes::halves(tile + 32), scale); }
#endif
};

struct Q8 {
  static constexpr int64_t TILE = 32 + 512;
  static constexpr bool MIN = false;
  static constexpr int STEPS = 16, PER_STEP = 2;  // step p: a chunk's words, bytes for inputs 2p, 2p+1
  static int input(int step, int i) { return 2 * step + i; }
  static void weights(const uint8_t* tile, int step, int h, Lanes::F (&q)[PER_STEP]) {
    const Lanes::Words w = Lanes::words(tile + 32 + 32 * step + 2 * Lanes::N * h);
    q[0] = Lanes::signed_byte<0>(w);
    q[1] = Lanes::signed_byte<1>(w);
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  static constexpr int PAIR_STEPS = 16, PAIR_PER_STEP = 1;  // step p: a chunk, pair (2p, 2p+1)
  static int pair(int step, int) { return step; }
  // int8 -> float32 -> bfloat16, exact (|q| <= 128 has 8 significant bits); outputs 0-7, then 8-15
  static void pair_weights(const uint8_t* tile, int step, __m512bh (&q)[PAIR_PER_STEP]) {
    const auto* chunk = reinterpret_cast<const __m128i*>(tile + 32 + 32 * step);
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(chunk)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(chunk + 1)));
    q[0] = _mm512_cvtne2ps_pbh(high, low);
  }
  static __m512 pair_scale(const uint8_t* tile) { return Lanes::halves(tile); }
  static __m512 pair_min(const uint8_t*, __m512) { return _mm512_setzero_ps(); }
#endif
};

constexpr int H = TILE_N / Lanes::N;  // float32 vectors a tile
// a kernel's running sums, R rows by V vectors, passed by value: GCC keeps a by-value array in registers
template <typename Vector, int R, int V>
using Sums = std::array<std::array<Vector, V>, R>;

// Float32 x: R rows (row stride K) against BB blocks of a tile from block b; their sums join acc in block order.
template <typename Format, int R, int BB>
__attribute__((always_inline)) inline Sums<Lanes::F, R, H> float_blocks(const float* x, int64_t K, const float* xsum,
                                                                         const uint8_t* tile, int64_t b, bool first,
                                                                         Sums<Lanes::F, R, H> acc) {
  using F = Lanes::F;
  const int64_t B = K / BLOCK_K;
  const uint8_t* blocks = tile + b * Format::TILE;
  if (first) for (int k = 0; k < BB; ++k) prefetch(blocks + k * Format::TILE);
  constexpr int C = Lanes::CHAINS;
  std::array<F, C> s[R][BB][H];
  for (auto& row : s) for (auto& block : row) for (auto& chains : block) chains.fill(Lanes::zero());
#pragma GCC unroll 4
  for (int k = 0; k < BB; ++k) {
#pragma GCC unroll 16  // whole: every index a constant, so the sums stay in registers
    for (int step = 0; step < Format::STEPS; ++step) {
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        F q[Format::PER_STEP];
        Format::weights(blocks + k * Format::TILE, step, h, q);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * K + (b + k) * BLOCK_K;
#pragma GCC unroll 4
          for (int i = 0; i < Format::PER_STEP; ++i) {
            F& chain = s[r][k][h][(step * Format::PER_STEP + i) % C];
            chain = Lanes::fma(Lanes::splat(xr[Format::input(step, i)]), q[i], chain);
          }
        }
      }
    }
  }
  for (int k = 0; k < BB; ++k) {
    for (int h = 0; h < H; ++h) {
      const uint8_t* scales = blocks + k * Format::TILE + 2 * Lanes::N * h;
      const F d = Lanes::halves(scales), m = Format::MIN ? Lanes::halves(scales + 32) : Lanes::zero();
      for (int r = 0; r < R; ++r) {
        acc[r][h] = Lanes::fma(d, total(s[r][k][h]), acc[r][h]);
        if constexpr (Format::MIN) acc[r][h] = Lanes::fma(m, Lanes::splat(xsum[r * B + b + k]), acc[r][h]);
      }
    }
  }
  return acc;
}

// Float32 x: R rows (row stride K) against one tile's K/32 blocks -> out[R][16]; `first`: the tile's first pass.
template <typename Format, int R>
void float_rows(const float* x, int64_t K, const float* xsum, const uint8_t* tile, bool first, float* out) {
  constexpr int BB = blocks_for(R, H * Lanes::CHAINS);
  const int64_t B = K / BLOCK_K;
  Sums<Lanes::F, R, H> acc;
  for (auto& row : acc) row.fill(Lanes::zero());
  int64_t b = 0;
  for (; b + BB <= B; b += BB) acc = float_blocks<Format, R, BB>(x, K, xsum, tile, b, first, acc);
  for (; b < B; ++b) acc = float_blocks<Format, R, 1>(x, K, xsum, tile, b, first, acc);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) Lanes::store(out + r * TILE_N + h * Lanes::N, acc[r][h]);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool BF16_PAIRS = true;
constexpr int PAIR_CHAINS = 2;  // 2 sums a row and block, and a total: 24 of 32 registers at 8 rows
// bfloat16 x taken as pairs (32-bit words, K/2 a row): R rows against BB blocks of a tile from block b (VDPBF16PS);
// their sums join acc in block order.
template <typename Format, int R, int BB>
__attribute__((always_inline)) inline Sums<__m512, R, 1> pair_blocks(const uint32_t* x, int64_t K, const float* xsum,
                                                                      const uint8_t* tile, int64_t b, bool first,
                                                                      Sums<__m512, R, 1> acc) {
  const int64_t B = K / BLOCK_K, KW = K / 2;
  const uint8_t* blocks = tile + b * Format::TILE;
  if (first) for (int k = 0; k < BB; ++k) prefetch(blocks + k * Format::TILE);
  std::array<__m512, PAIR_CHAINS> s[R][BB];
  for (auto& row : s) for (auto& chains : row) chains.fill(_mm512_setzero_ps());
#pragma GCC unroll 4
  for (int k = 0; k < BB; ++k) {
#pragma GCC unroll 16
    for (int step = 0; step < Format::PAIR_STEPS; ++step) {
      __m512bh q[Format::PAIR_PER_STEP];
      Format::pair_weights(blocks + k * Format::TILE, step, q);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        for (int i = 0; i < Format::PAIR_PER_STEP; ++i) {
          const uint32_t pair = x[r * KW + (b + k) * (BLOCK_K / 2) + Format::pair(step, i)];
          __m512& chain = s[r][k][(step * Format::PAIR_PER_STEP + i) % PAIR_CHAINS];
          chain = _mm512_dpbf16_ps(chain, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), q[i]);
        }
      }
    }
  }
  for (int k = 0; k < BB; ++k) {
    const __m512 d = Format::pair_scale(blocks + k * Format::TILE), m = Format::pair_min(blocks + k * Format::TILE, d);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm512_fmadd_ps(d, total(s[r][k]), acc[r][0]);
      if constexpr (Format::MIN) acc[r][0] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * B + b + k]), acc[r][0]);
    }
  }
  return acc;
}

// R rows' sums (16 outputs a vector) over a tile's B blocks, BB at a time, then one at a time: blocks(b, the count
// as an integral_constant, acc) adds blocks b.. to acc -> out[R][16]
template <int R, int BB, typename Blocks>
__attribute__((always_inline)) inline void vector_rows(int64_t B, Blocks&& blocks, float* out) {
  Sums<__m512, R, 1> acc;
  for (auto& row : acc) row.fill(_mm512_setzero_ps());
  int64_t b = 0;
  for (; b + BB <= B; b += BB) acc = blocks(b, std::integral_constant<int, BB>{}, acc);
  for (; b < B; ++b) acc = blocks(b, std::integral_constant<int, 1>{}, acc);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * TILE_N, acc[r][0]);
}

template <typename Format, int R>
void pair_rows(const uint32_t* x, int64_t K, const float* xsum, const uint8_t* tile, bool first, float* out) {
  vector_rows<R, blocks_for(R, PAIR_CHAINS)>(K / BLOCK_K, [&](int64_t b, auto bb, Sums<__m512, R, 1> acc) {
    return pair_blocks<Format, R, decltype(bb)::value>(x, K, xsum, tile, b, first, acc);
  }, out);
}
#else
constexpr bool BF16_PAIRS = false;
#endif

template <typename X>
using RowsFn = void (*)(const X*, int64_t, const float*, const uint8_t*, bool, float*);

template <typename X, size_t R_MAX>
using RowsTable = std::array<RowsFn<X>, R_MAX>;  // [R - 1]

template <typename Format, int... Rs>
constexpr RowsTable<float, sizeof...(Rs)> float_rows_table(std::integer_sequence<int, Rs...>) {
  return {float_rows<Format, Rs + 1>...};
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <typename Format, int... Rs>
constexpr RowsTable<uint32_t, sizeof...(Rs)> pair_rows_table(std::integer_sequence<int, Rs...>) {
  return {pair_rows<Format, Rs + 1>...};
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool INT8_DOTS = true;
// Int8 activations (asked for: `quantization: gguf-int8`, W8A8 checkpoints) on CPUs with VNNI, at any row count: x
// quantized a block of 32 at a time to int8 (step dx = max|x|/127, rounded to nearest: llama.cpp's way), multiplied
// with the weights' own integers by VPDPBUSD (64 multiply-adds an instruction, exact int32 sums), each block's sum S
// scaled once: y += d * dx * S (+ m * X, X the block's exact sum of x).
// Such tiles have a layout of their own (quantized_linear.pack(int8=True)): the same bytes a tile, arranged as
// VPDPBUSD's unsigned operand, so a 64-byte load is 16 outputs (32-bit lanes) by 4 inputs a byte:
//   Q4, 320 bytes: d[16] f16, m[16] f16, then 4 vectors of 64 bytes: vector v's lane j, byte b holds output j's q at
//      input 4v+b in its low nibble and at input 16+4v+b in its high one.
//   Q8, 544 bytes: d[16] f16, then 8 vectors: vector v's lane j, byte b holds output j's q at input 4v+b, plus 128
//      (unsigned), so S = that sum - 128 * the sum of the block's int8 x.
// A Q4 block is then 8 ANDs and 8 VPDPBUSD for 16 outputs, against the exact kernel's 16 VDPBF16PS and 40
// operations unpacking their operands (measured in docs/performance.md, session 53: faster from cache and from 4
// rows on; a batch-1 call from memory waits on the memory either way).
// A row's result depends on its own x alone (its int32 sums are exact, its blocks join in order), never on which
// rows it is batched with.
constexpr int64_t GROUP = Lanes::R_MAX;  // rows a register block: x's quads and facts are laid out by groups of them
constexpr int INT8_CHAINS = 2;           // sums a row and block (Q4: of the low nibbles and of the high ones, x16)

// a block's weight vectors: the 64-byte loads and the quads of x each meets
template <bool Q4_BLOCKS>
struct Int8Blocks {
  static constexpr int64_t TILE = Q4_BLOCKS ? Q4::TILE : Q8::TILE, WEIGHTS = Q4_BLOCKS ? 64 : 32;
  static constexpr int VECTORS = Q4_BLOCKS ? 4 : 8;
};

inline __m512i dot(__m512i sum, __m512i weights, const uint32_t* x) {  // x's 4 int8 broadcast from memory
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(weights), "m"(*x));
  return sum;
}

// A group of R rows' quads and facts (quantize_x: R is its width) against BB blocks of a tile from block b; sums join
// acc in order.
template <bool Q4_BLOCKS, int R, int BB>
__attribute__((always_inline)) inline Sums<__m512, R, 1> int8_blocks(const uint32_t* x, const float* facts,
                                                                      const uint8_t* tile, int64_t b, bool first,
                                                                      Sums<__m512, R, 1> acc) {
  using Format = Int8Blocks<Q4_BLOCKS>;
  const uint8_t* blocks = tile + b * Format::TILE;
  if (first) for (int k = 0; k < BB; ++k) prefetch(blocks + k * Format::TILE);
  std::array<__m512i, INT8_CHAINS> s[R][BB];
  for (auto& row : s) for (auto& chains : row) chains.fill(_mm512_setzero_si512());
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
#pragma GCC unroll 4
  for (int k = 0; k < BB; ++k) {
    const uint8_t* weights = blocks + k * Format::TILE + Format::WEIGHTS;
    const uint32_t* quads = x + (b + k) * 8 * R;
#pragma GCC unroll 8
    for (int v = 0; v < Format::VECTORS; ++v) {
      const __m512i w = _mm512_loadu_si512(weights + 64 * v);
      if constexpr (Q4_BLOCKS) {
        const __m512i w_low = _mm512_and_si512(w, low), w_high = _mm512_and_si512(w, high);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          s[r][k][0] = dot(s[r][k][0], w_low, quads + v * R + r);
          s[r][k][1] = dot(s[r][k][1], w_high, quads + (4 + v) * R + r);
        }
      } else {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) s[r][k][v % 2] = dot(s[r][k][v % 2], w, quads + v * R + r);
      }
    }
  }
  for (int k = 0; k < BB; ++k) {
    const uint8_t* block = blocks + k * Format::TILE;
    const __m512 d = Lanes::halves(block);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* f = facts + ((b + k) * R + r) * 2;  // dx, and Q4: X, Q8: -128 * the block's sum of int8 x
      const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(f[0]));
      if constexpr (Q4_BLOCKS) {  // the high nibbles' sum is 16 times theirs, exactly
        const __m512i sum = _mm512_add_epi32(s[r][k][0], _mm512_srai_epi32(s[r][k][1], 4));
        acc[r][0] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), acc[r][0]);
        acc[r][0] = _mm512_fmadd_ps(Lanes::halves(block + 32), _mm512_set1_ps(f[1]), acc[r][0]);
      } else {  // |S| < 2^24: exact in float32, and so is the correction's sum
        const __m512 sum = _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[r][k][0], s[r][k][1])),
                                         _mm512_set1_ps(f[1]));
        acc[r][0] = _mm512_fmadd_ps(scale, sum, acc[r][0]);
      }
    }
  }
  return acc;
}

template <bool Q4_BLOCKS, int R>
void int8_rows(const uint32_t* x, int64_t K, const float* facts, const uint8_t* tile, bool first, float* out) {
  vector_rows<R, blocks_for(R, INT8_CHAINS)>(K / BLOCK_K, [&](int64_t b, auto bb, Sums<__m512, R, 1> acc) {
    return int8_blocks<Q4_BLOCKS, R, decltype(bb)::value>(x, facts, tile, b, first, acc);
  }, out);
}

template <bool Q4_BLOCKS, int... Rs>
constexpr RowsTable<uint32_t, sizeof...(Rs)> int8_rows_table(std::integer_sequence<int, Rs...>) {
  return {int8_rows<Q4_BLOCKS, Rs + 1>...};
}

// x [M, K] -> its int8 quads (input order, 4 a word) and facts (dx, and Q4: the block's sum of x, Q8: -128 * the sum
// of its int8), by groups of GROUP rows side by side, so that a register block (a group) reads one stream of each:
// group g at quads + g * GROUP * K/4 and facts + g * GROUP * 2 * K/32, as [K/32][8 quads][w rows] and [K/32][w][2],
// w its rows (GROUP but for the last): a lone row's quads are contiguous, the cache lines another thread reads of it.
template <typename In>
void quantize_x(const In* x, int64_t M, int64_t K, bool q4, uint32_t* quads, float* facts) {
  const int64_t B = K / BLOCK_K;
  parallel_chunks(0, M * B, SERIAL_PREP / BLOCK_K, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / B, group = row / GROUP, r = row % GROUP, w = std::min(GROUP, M - group * GROUP);
      uint32_t* group_quads = quads + group * GROUP * B * 8 + (i % B) * 8 * w + r;
      float* group_facts = facts + 2 * (group * GROUP * B + (i % B) * w + r);
      // 16 elements of x as float32 (cpu_vec.h's load: W is 16 here)
      const __m512 low = __builtin_bit_cast(__m512, load(x + i * BLOCK_K));
      const __m512 high = __builtin_bit_cast(__m512, load(x + i * BLOCK_K + 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
      const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // to nearest, ties to even (the default rounding mode); |q| <= 127
      const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse));
      const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse));
      int8_t q[BLOCK_K];
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q_low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q_high));
      for (int c = 0; c < 8; ++c) std::memcpy(group_quads + c * w, q + 4 * c, 4);
      group_facts[0] = amax / 127.f;
      group_facts[1] = q4 ? _mm512_reduce_add_ps(_mm512_add_ps(low, high))
                          : -128.f * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high)));
    }
  });
}

#else
constexpr bool INT8_DOTS = false;
#endif

// A thread's scratch for de-quantized tiles: 64-byte aligned, kept from call to call, grown when short.
inline void* scratch(int64_t bytes) {
  static thread_local std::unique_ptr<void, decltype(&std::free)> data{nullptr, &std::free};
  static thread_local int64_t size = 0;
  if (bytes > size) {
    size = (bytes + 63) / 64 * 64;
    data.reset(std::aligned_alloc(64, size));
  }
  return data.get();
}

// x [M, K] (row stride x_stride in X; xsum_stride floats of xsum a row) against the tiles -> y [M, N] (+ bias),
// rows in groups of 4 R_MAX, each work item a row group by adjacent tiles (row groups outer: a group's x stays in L2;
// tiles outer within an item: a tile's weights stay in L1 over its row blocks).
template <typename X, size_t R_MAX, typename Out>
void run_tiles(const RowsTable<X, R_MAX>& rows, const X* x, int64_t x_stride, int64_t M, int64_t K,
               const float* xsum, int64_t xsum_stride, const uint8_t* tiles, int64_t tile_bytes, const float* bias,
               Out* y, int64_t N) {
  const int64_t T = (N + TILE_N - 1) / TILE_N, B = K / BLOCK_K, item_rows = 4 * int64_t{R_MAX};
  const int64_t row_groups = (M + item_rows - 1) / item_rows, threads = deal_threads();
  // about 2 items a thread: long contiguous streams for the hardware prefetcher (SmolLM2's 576x576 Q4_1 GEMV from
  // memory, 2 threads: 13-15 us against 22-24 with 8 items a thread), one left to share if a thread is preempted
  const int64_t per_item = std::clamp<int64_t>(T * row_groups / (2 * threads), 1, MAX_ITEM_TILES);
  const int64_t tile_groups = (T + per_item - 1) / per_item;
  deal_items(row_groups * tile_groups, [] { return 0; }, [&](int64_t item, int) {
    const int64_t m_begin = item / tile_groups * item_rows, m_end = std::min(M, m_begin + item_rows);
    const int64_t t_begin = item % tile_groups * per_item, t_end = std::min(T, t_begin + per_item);
    float out[R_MAX * TILE_N];
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n = t * TILE_N, n_valid = std::min(TILE_N, N - n);
      const uint8_t* weights = tiles + t * B * tile_bytes;
      for (int64_t m = m_begin; m < m_end; m += R_MAX) {
        const int64_t r_count = std::min<int64_t>(R_MAX, m_end - m);
        rows[r_count - 1](x + m * x_stride, K, xsum ? xsum + m * xsum_stride : nullptr, weights, m == m_begin, out);
        for (int64_t r = 0; r < r_count; ++r)
          for (int64_t j = 0; j < n_valid; ++j)
            y[(m + r) * N + n + j] = narrow<Out>(out[r * TILE_N + j] + (bias ? bias[n + j] : 0.f));
      }
    }
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// x [M, K] (float32 or bfloat16) in int8 against int8-layout tiles -> y [M, N] of x's dtype (+ bias)
template <typename In>
void run_int8(const In* x, int64_t M, int64_t K, const uint8_t* tiles, bool q4, const float* bias, In* y,
              int64_t N, const at::TensorOptions& options) {
  const int64_t B = K / BLOCK_K, rows = (M + GROUP - 1) / GROUP * GROUP;
  at::Tensor quads = at::empty({rows, K / 4}, options.dtype(at::kInt));
  at::Tensor facts = at::empty({rows, B, 2}, options.dtype(at::kFloat));
  auto* qp = reinterpret_cast<uint32_t*>(quads.data_ptr<int32_t>());
  float* fp = facts.data_ptr<float>();
  static constexpr auto Q4_INT8 = int8_rows_table<true>(std::make_integer_sequence<int, Lanes::R_MAX>{});
  static constexpr auto Q8_INT8 = int8_rows_table<false>(std::make_integer_sequence<int, Lanes::R_MAX>{});
  quantize_x(x, M, K, q4, qp, fp);
  run_tiles(q4 ? Q4_INT8 : Q8_INT8, qp, K / 4, M, K, fp, 2 * B, tiles, q4 ? Q4::TILE : Q8::TILE, bias, y, N);
}
#endif

// Per block of 32 inputs of x [M, K]: its sum (sums, if any) and x widened to float32 (widened, if any).
template <typename In>
void prepare(const In* x, int64_t M, int64_t K, float* widened, float* sums) {
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float sum = 0.f;
      for (int64_t k = 0; k < BLOCK_K; ++k) {
        const float v = widen(x[i * BLOCK_K + k]);
        sum += v;
        if (widened) widened[i * BLOCK_K + k] = v;
      }
      if (sums) sums[i] = sum;
    }
  };
  const int64_t blocks = M * K / BLOCK_K;
  if (M * K <= SERIAL_PREP) run(0, blocks);
  else parallel_chunks(0, blocks, SERIAL_PREP / BLOCK_K, run);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// Many rows of bfloat16 x (DEQUANTIZE_ROWS or more; not int8): the tiles de-quantized into kvloom's blocked bfloat16
// layout and run by its register kernel (cpu_blocked.h). The exact kernel's per-block scaling costs an add and two
// FMAs a row and block on top of 16 VDPBF16PS; de-quantizing costs about as much once for all of a call's rows.
// Each weight is d*q + m in float32 (d*q is exact, so one rounding), rounded to bfloat16 (nearest even): the
// de-quantized model's own weights, so these calls compute what its blocked GEMM computes, bit for bit.

// a block's 16 outputs (float32 scales) -> each output's scale twice: lanes 2j and 2j+1 of outputs `from`.. from+7
inline __m512 paired(__m512 scales, int from) {
  alignas(64) static const std::array<std::array<int32_t, 16>, 2> index = [] {
    std::array<std::array<int32_t, 16>, 2> out{};
    for (int h = 0; h < 2; ++h)
      for (int lane = 0; lane < 16; ++lane) out[h][lane] = 8 * h + lane / 2;
    return out;
  }();
  return _mm512_permutexvar_ps(_mm512_load_si512(index[from / 8].data()), scales);
}

// 16 bytes of a chunk (outputs from.. from+7, byte 2j+e) as 32-bit lanes
inline __m512i chunk_bytes(const uint8_t* p, bool is_signed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
}

// q (32-bit lanes of outputs 0-7 and 8-15) -> the bfloat16 pair vector d*q + m: lane 2j+e, output j
inline __m512i pair_vector(__m512i q_low, __m512i q_high, const __m512 (&d)[2], const __m512 (&m)[2]) {
  const __m512 low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q_low), d[0], m[0]);
  const __m512 high = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q_high), d[1], m[1]);
  return (__m512i)_mm512_cvtne2ps_pbh(high, low);
}

// One tile's K/32 blocks -> its 16 outputs of a blocked-layout weight block (out: [K/2 words][32 outputs], this
// tile's half at out + half * 16; a word is a pair of inputs (2k, 2k+1)).
template <bool Q4_BLOCKS>
void dequantize_tile(const uint8_t* tile, int64_t B, int half, uint32_t* out) {
  const int64_t bytes = Q4_BLOCKS ? Q4::TILE : Q8::TILE;
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* block = tile + b * bytes;
    const __m512 scale = Lanes::halves(block), min = Q4_BLOCKS ? Lanes::halves(block + 32) : _mm512_setzero_ps();
    const __m512 d[2] = {paired(scale, 0), paired(scale, 8)}, m[2] = {paired(min, 0), paired(min, 8)};
    uint32_t* words = out + b * (BLOCK_K / 2) * BLOCK_N + half * TILE_N;  // the block's first pair of inputs
    auto store = [&](int pair, __m512i v) { _mm512_storeu_si512(words + pair * BLOCK_N, v); };
    if constexpr (Q4_BLOCKS) {  // chunk c: inputs 2c+e in the low nibbles, 2c+16+e in the high
      const __m512i nibble = _mm512_set1_epi32(15);
      for (int c = 0; c < 8; ++c) {
        const __m512i low = chunk_bytes(block + 64 + 32 * c, false), high = chunk_bytes(block + 80 + 32 * c, false);
        store(c, pair_vector(_mm512_and_si512(low, nibble), _mm512_and_si512(high, nibble), d, m));
        store(c + 8, pair_vector(_mm512_srli_epi32(low, 4), _mm512_srli_epi32(high, 4), d, m));
      }
    } else {  // chunk p: inputs 2p+e
      for (int p = 0; p < 16; ++p)
        store(p, pair_vector(chunk_bytes(block + 32 + 32 * p, true), chunk_bytes(block + 48 + 32 * p, true), d, m));
    }
  }
}

// Tiles 2nb and 2nb+1 (where there is one) -> blocked-layout weight block nb at out ([K/2 words][32 outputs]).
void dequantize_block(const uint8_t* tiles, bool q4, int64_t K, int64_t N, int64_t nb, uint32_t* out) {
  const int64_t KW = K / 2, B = K / BLOCK_K, T = (N + TILE_N - 1) / TILE_N, tile_bytes = B * (q4 ? Q4::TILE : Q8::TILE);
  for (int half = 0; half < 2; ++half) {
    const int64_t t = 2 * nb + half;
    if (t < T) (q4 ? dequantize_tile<true> : dequantize_tile<false>)(tiles + t * tile_bytes, B, half, out);
    else for (int64_t k = 0; k < KW; ++k) std::memset(out + k * BLOCK_N + half * TILE_N, 0, TILE_N * 4);
  }
}

// x [M, K] bfloat16 against the tiles -> y [M, N] (+ bias): a work item is a weight block (a pair of tiles)
// de-quantized into the thread's scratch, then run by the blocked GEMM's register kernel over a row group, which is
// all M rows unless there are too few blocks to keep the threads busy (de-quantized once a call, in cache for every
// row: 1.01x the de-quantized weight's time from 512 rows; de-quantizing the whole weight first, then running
// cpu_gemm.cpp's schedule, was 1.02-1.16x at 160-512 rows, measured on SmolLM2's shapes on the 2-core Zen 4).
void run_dequantized(const uint32_t* x, int64_t M, int64_t K, const uint8_t* tiles, bool q4, const float* bias,
                     uint16_t* y, int64_t N) {
  const int64_t KW = K / 2, nblocks = (N + BLOCK_N - 1) / BLOCK_N;
  const int64_t max_groups = (M + ITEM_M - 1) / ITEM_M;
  const int64_t groups = std::clamp<int64_t>((2 * deal_threads() + nblocks - 1) / nblocks, 1, max_groups);
  const int64_t group_rows = ((M + groups - 1) / groups + BLOCK_M - 1) / BLOCK_M * BLOCK_M;
  deal_items(groups * nblocks, [] { return 0; }, [&](int64_t item, int) {
    const int64_t nb = item % nblocks, m_begin = item / nblocks * group_rows;
    auto* w = static_cast<uint32_t*>(scratch(KW * BLOCK_N * 4));
    dequantize_block(tiles, q4, K, N, nb, w);
    block_rows<BFloat16Pairs>(x, KW, w, bias, y, N, nb * BLOCK_N, m_begin, std::min(M, m_begin + group_rows));
  });
}
#endif

// the code a call of `rows` rows runs
std::string quant_linear_path(int64_t bits, at::ScalarType dtype, int64_t rows, bool int8) {
  if (INT8_DOTS && int8) return "avx512vnni-int8";
  if (dtype != at::kBFloat16) return Lanes::ISA;
  if (BF16_PAIRS && rows >= DEQUANTIZE_ROWS) return "avx512bf16-dequantized";
  return BF16_PAIRS ? "avx512bf16" : Lanes::ISA;
}

// x [M, K] float32 or bfloat16 times tiles [ceil(N/16), K/32, 320 (bits 4) or 544 (bits 8)] uint8 (+ bias [N]
// float32) -> [M, N] of x's dtype; int8: the tiles are in the int8 layout and x runs in int8 (where VNNI is)
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t bits, int64_t N,
                        const std::optional<at::Tensor>& bias, bool int8) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 (Q4_1, Q4_0) or 8 (Q8_0)");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (bf16 || x.scalar_type() == at::kFloat),
              "x: contiguous [M, K] float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), B = K / BLOCK_K, tile_bytes = bits == 4 ? Q4::TILE : Q8::TILE;
  TORCH_CHECK(K % BLOCK_K == 0 && tiles.dim() == 3 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.size(0) == (N + TILE_N - 1) / TILE_N && tiles.size(1) == B && tiles.size(2) == tile_bytes,
              "tiles: [ceil(N/16), K/32, ", tile_bytes, "] uint8, as quantized_linear.pack lays them out");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat),
              "bias: [N] float32");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto* tp = tiles.data_ptr<uint8_t>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const bool q4 = bits == 4;
  const auto* x_bf16 = reinterpret_cast<const at::BFloat16*>(x.data_ptr());
  auto* y_bf16 = reinterpret_cast<at::BFloat16*>(y.data_ptr());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (int8) {  // int8-layout tiles: pack() makes them only where this build runs them (quant_linear_path)
    if (bf16) run_int8(x_bf16, M, K, tp, q4, bp, y_bf16, N, x.options());
    else run_int8(x.data_ptr<float>(), M, K, tp, q4, bp, y.data_ptr<float>(), N, x.options());
    return y;
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (bf16 && M >= DEQUANTIZE_ROWS) {
    run_dequantized(reinterpret_cast<const uint32_t*>(x_bf16), M, K, tp, q4, bp, reinterpret_cast<uint16_t*>(y_bf16),
                    N);
    return y;
  }
#endif
  // the exact paths: only Q4 needs x's block sums (its min)
  at::Tensor sums = at::empty({q4 ? M : 0, B}, x.options().dtype(at::kFloat));
  float* sp = q4 ? sums.data_ptr<float>() : nullptr;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (bf16) {
    static constexpr auto Q4_PAIRS = pair_rows_table<Q4>(std::make_integer_sequence<int, Lanes::R_MAX>{});
    static constexpr auto Q8_PAIRS = pair_rows_table<Q8>(std::make_integer_sequence<int, Lanes::R_MAX>{});
    if (q4) prepare(x_bf16, M, K, nullptr, sp);
    run_tiles(q4 ? Q4_PAIRS : Q8_PAIRS, reinterpret_cast<const uint32_t*>(x_bf16), K / 2, M, K, sp, B, tp, tile_bytes,
              bp, y_bf16, N);
    return y;
  }
#endif
  at::Tensor xf = x;
  if (bf16) {
    xf = at::empty({M, K}, x.options().dtype(at::kFloat));
    prepare(x_bf16, M, K, xf.data_ptr<float>(), sp);
  } else if (q4) {
    prepare(x.data_ptr<float>(), M, K, nullptr, sp);
  }
  static constexpr auto Q4_ROWS = float_rows_table<Q4>(std::make_integer_sequence<int, Lanes::R_MAX>{});
  static constexpr auto Q8_ROWS = float_rows_table<Q8>(std::make_integer_sequence<int, Lanes::R_MAX>{});
  const auto& rows = q4 ? Q4_ROWS : Q8_ROWS;
  const float* xp = xf.data_ptr<float>();
  if (bf16) run_tiles(rows, xp, K, M, K, sp, B, tp, tile_bytes, bp, y_bf16, N);
  else run_tiles(rows, xp, K, M, K, sp, B, tp, tile_bytes, bp, y.data_ptr<float>(), N);
  return y;
}

}  // namespace

#if defined(KVLOOM_VARIANT)  // a build for an instruction set below the host's: its ops' names end in _<variant>
#define KVLOOM_STRING(x) #x
#define KVLOOM_SUFFIX(x) KVLOOM_STRING(x)
#define OP(name) name KVLOOM_SUFFIX(KVLOOM_VARIANT)
#else
#define OP(name) name
#endif

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def(OP("quant_linear") "(Tensor x, Tensor tiles, int bits, int N, Tensor? bias, bool int8=False) -> Tensor",
        &quant_linear);
  m.def(OP("quant_linear_path") "(int bits, ScalarType dtype, int rows, bool int8=False) -> str", &quant_linear_path);
}
