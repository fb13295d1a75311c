// LoRA deltas of a step's adapter segments on CPU (punica's SGMV): y[rows] += (x[rows] @ A) @ B for each segment's
// own adapter, in one call per linear that finds the adapters' weights through the step's table of them (building
// each call's list of tensors in Python cost more than the arithmetic at few rows). A decode step's segments are a
// few rows each, where a GEMM library call costs more in set-up than the arithmetic and its weights are read once
// anyway: this streams each adapter's A and B once per block of up to ROWS rows, and reads of B skip its zero
// blocks (a fused linear's B holds each part's B over that part's columns only: the table's parts). A prompt
// chunk's segment is many such blocks, its weights then in cache. Measurements: docs/performance.md, "multi-LoRA".
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_deal.h"
#include "cpu_vec.h"

namespace {

// rows sharing each load of A and B (a work item's rows): eight where 32 vector registers hold their sums
constexpr int64_t ROWS = W == 16 ? 8 : 4;

inline float lanes_sum(vfloat v) {
  float sum = 0.0f;
  for (int j = 0; j < W; ++j) sum += v[j];
  return sum;
}

// Software prefetch of the rows a later group of UNROLL rows reads, PREFETCH_GROUPS groups ahead: an adapter's
// rows are short (an A row is `in` elements), so a group's UNROLL row streams each end before the hardware
// prefetcher has ramped up on them, and the loads stall on memory. Into L2, not L1 (locality 1): the loads' own
// misses keep L1's miss buffers, and a decode step's LoRA ran 7-15% faster so (docs/performance.md)
constexpr int64_t PREFETCH_GROUPS = 2;
template <typename T>
inline void prefetch_ahead(const T* p, int64_t distance, const T* end) {
  if (p + distance < end) __builtin_prefetch(p + distance, 0, 1);
}

// rows of A read together (each load of x serves UNROLL_A of them) and of B (each partial sum's load, UNROLL_B):
// with eight rows of x, two rows of A keep the shrink's sums in registers
template <int M>
constexpr int UNROLL_A = M > 4 ? 2 : 4;
constexpr int UNROLL_B = 4;

// One work item: M rows of one segment, with its adapter's A [R, in] (PEFT's lora_A rows, each part's stacked) and
// B [R, out] and parts (r0, r1, c0, c1): B's rows r0..r1 are nonzero over columns c0..c1 only. Both are read row by
// row, contiguously: a cold adapter streams from memory at the prefetcher's pace, where column strips of them did
// not. A row past the end reads a real row again and counts nothing.
template <typename T, int M>
void segment_rows(const T* x, int64_t x_stride, T* y, int64_t y_stride, const T* a, const T* b, int64_t in,
                  int64_t rank, int64_t out, const int64_t* parts, int64_t num_parts, std::vector<float>& shrunk,
                  std::vector<float>& sums) {
  constexpr int UNROLL = UNROLL_A<M>;
  const T* a_end = a + rank * in;
  const T* b_end = b + rank * out;
  shrunk.resize(M * rank + M * in);
  float* xs = shrunk.data() + M * rank;  // x's rows widened once, not once per row of A
  for (int i = 0; i < M; ++i)
    for (int64_t k = 0; k < in; ++k) xs[i * in + k] = widen(x[i * x_stride + k]);
  for (int64_t r = 0; r < rank; r += UNROLL) {  // shrunk[i][r + u] = x[i] . A[r + u]
    const T* rows[UNROLL];
    for (int u = 0; u < UNROLL; ++u) rows[u] = a + std::min(r + u, rank - 1) * in;
    vfloat acc[UNROLL][M] = {};
    int64_t k = 0;
    for (; k + W <= in; k += W) {
      vfloat av[UNROLL];
      for (int u = 0; u < UNROLL; ++u) {
        av[u] = load(rows[u] + k);
        prefetch_ahead(rows[u] + k, PREFETCH_GROUPS * UNROLL * in, a_end);
      }
      for (int i = 0; i < M; ++i) {
        const vfloat xv = load(xs + i * in + k);
        for (int u = 0; u < UNROLL; ++u) acc[u][i] += xv * av[u];
      }
    }
    for (int u = 0; u < UNROLL && r + u < rank; ++u)
      for (int i = 0; i < M; ++i) {
        float sum = lanes_sum(acc[u][i]);
        for (int64_t kk = k; kk < in; ++kk) sum += xs[i * in + kk] * widen(rows[u][kk]);
        shrunk[i * rank + r + u] = sum;
      }
  }
  for (int64_t p = 0; p < num_parts; ++p) {  // sums[i] = sum over r of shrunk[i][r] * B[r][c0:c1]
    const int64_t r0 = parts[4 * p], r1 = parts[4 * p + 1], c0 = parts[4 * p + 2], width = parts[4 * p + 3] - c0;
    sums.assign(M * width, 0.0f);
    for (int64_t r = r0; r < r1; r += UNROLL_B) {
      constexpr int UNROLL = UNROLL_B;
      const T* rows[UNROLL];
      float scale[UNROLL][M];
      for (int u = 0; u < UNROLL; ++u) {
        rows[u] = b + std::min(r + u, r1 - 1) * out + c0;
        for (int i = 0; i < M; ++i) scale[u][i] = r + u < r1 ? shrunk[i * rank + r + u] : 0.0f;
      }
      int64_t c = 0;
      for (; c + W <= width; c += W) {
        vfloat bv[UNROLL];
        for (int u = 0; u < UNROLL; ++u) {
          bv[u] = load(rows[u] + c);
          prefetch_ahead(rows[u] + c, PREFETCH_GROUPS * UNROLL * out, b_end);
        }
        for (int i = 0; i < M; ++i) {
          float* dst = sums.data() + i * width + c;
          vfloat sum = load(dst);
          for (int u = 0; u < UNROLL; ++u) sum += scale[u][i] * bv[u];
          store(dst, sum);
        }
      }
      for (; c < width; ++c)
        for (int i = 0; i < M; ++i)
          for (int u = 0; u < UNROLL; ++u) sums[i * width + c] += scale[u][i] * widen(rows[u][c]);
    }
    for (int i = 0; i < M; ++i) {
      T* y_row = y + i * y_stride + c0;
      const float* s = sums.data() + i * width;
      for (int64_t c = 0; c < width; ++c) y_row[c] = narrow<T>(widen(y_row[c]) + s[c]);
    }
  }
}

#if defined(__AVX512BF16__)
// bfloat16 on CPUs with AVX512-BF16: each instruction multiplies 32 bfloat16 pairs into 16 float32 sums, twice
// what widening to float32 gives, and nothing is widened. The shrink reads x's and A's rows as they are (pairs
// along `in`); the expand reads B as pack_expand lays it out (per part: its nonzero block only, in blocks of 16
// columns, each block's rows in pairs, a pair's two values side by side per column), and x @ A rounded to
// bfloat16 pairs, as torch's bfloat16 LoRA rounds it between its two GEMMs.
constexpr bool PAIRS = true;

inline __m512 widen16(const at::BFloat16* p, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline uint32_t bf16_pair(float lo, float hi) {
  return static_cast<uint32_t>(at::BFloat16(lo).x) | (static_cast<uint32_t>(at::BFloat16(hi).x) << 16);
}

template <int M>
void segment_rows_pairs(const at::BFloat16* x, int64_t x_stride, at::BFloat16* y, int64_t y_stride,
                        const at::BFloat16* a, const at::BFloat16* b, int64_t in, int64_t rank, const int64_t* parts,
                        int64_t num_parts, std::vector<float>& shrunk, std::vector<uint32_t>& pairs) {
  constexpr int UNROLL = UNROLL_A<M>;
  const at::BFloat16* a_end = a + rank * in;
  shrunk.resize(M * rank);
  for (int64_t r = 0; r < rank; r += UNROLL) {  // shrunk[i][r + u] = x[i] . A[r + u]
    const at::BFloat16* rows[UNROLL];
    for (int u = 0; u < UNROLL; ++u) rows[u] = a + std::min(r + u, rank - 1) * in;
    __m512 acc[UNROLL][M];
    for (int u = 0; u < UNROLL; ++u)
      for (int i = 0; i < M; ++i) acc[u][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
      const __mmask32 mask = in - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (in - k)) - 1;
      __m512bh av[UNROLL];
      for (int u = 0; u < UNROLL; ++u) {
        av[u] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[u] + k);
        prefetch_ahead(rows[u] + k, PREFETCH_GROUPS * UNROLL * in, a_end);
      }
      for (int i = 0; i < M; ++i) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * x_stride + k);
        for (int u = 0; u < UNROLL; ++u) acc[u][i] = _mm512_dpbf16_ps(acc[u][i], xv, av[u]);
      }
    }
    for (int u = 0; u < UNROLL && r + u < rank; ++u)
      for (int i = 0; i < M; ++i) shrunk[i * rank + r + u] = _mm512_reduce_add_ps(acc[u][i]);
  }
  for (int64_t p = 0; p < num_parts; ++p) {  // y[i][c0:c1] += sum over r of shrunk[i][r] * B[r][c0:c1]
    const int64_t r0 = parts[4 * p], r1 = parts[4 * p + 1], c0 = parts[4 * p + 2], width = parts[4 * p + 3] - c0;
    const int64_t half = (r1 - r0 + 1) / 2, blocks = (width + 15) / 16;
    pairs.resize(M * half);
    for (int i = 0; i < M; ++i)
      for (int64_t j = 0; j < half; ++j) {
        const int64_t row = r0 + 2 * j;
        pairs[i * half + j] = bf16_pair(shrunk[i * rank + row], row + 1 < r1 ? shrunk[i * rank + row + 1] : 0.0f);
      }
    const at::BFloat16* b_end = b + blocks * half * 32;
    for (int64_t block = 0; block < blocks; ++block) {
      const at::BFloat16* bp = b + block * half * 32;
      __m512 acc[M];
      for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t j = 0; j < half; ++j) {
        const __m512bh bv = (__m512bh)_mm512_loadu_si512(bp + j * 32);
        prefetch_ahead(bp + j * 32, PREFETCH_GROUPS * 64, b_end);
        for (int i = 0; i < M; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pairs[i * half + j]), bv);
      }
      const int64_t c = c0 + block * 16;
      const __mmask16 mask = width - block * 16 >= 16 ? ~__mmask16(0) : (__mmask16(1) << (width - block * 16)) - 1;
      for (int i = 0; i < M; ++i) {
        at::BFloat16* dst = y + i * y_stride + c;
        const __m512 sum = _mm512_add_ps(widen16(dst, mask), acc[i]);
        _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(sum));
      }
    }
    b = b_end;
  }
}
#else
constexpr bool PAIRS = false;
#endif

// One work item of m rows (1 to ROWS): the row count as a template argument keeps the rows' sums in registers
template <typename Item>
void with_rows(int64_t m, Item item) {
#define KVLOOM_ROWS(M) \
  case M: return item(std::integral_constant<int, M>());
  switch (m) {
    KVLOOM_ROWS(1) KVLOOM_ROWS(2) KVLOOM_ROWS(3) KVLOOM_ROWS(4)
  }
  if constexpr (ROWS == 8) {
    switch (m) { KVLOOM_ROWS(5) KVLOOM_ROWS(6) KVLOOM_ROWS(7) KVLOOM_ROWS(8) }
  }
#undef KVLOOM_ROWS
  TORCH_CHECK(false, "lora_add_: a work item of ", m, " rows");
}

// A linear's row of an adapter's weights table (kernels/cpu_lora.py, `weights_table`): where its A and B are and
// what they hold; rank 0: the adapter does not patch this linear
constexpr int64_t MAX_PARTS = 3;  // a fused linear's parts (q|k|v), each (r0, r1, c0, c1)
enum Column : int64_t { A_DATA, B_DATA, RANK, IN, ELEMENT_SIZE, B_ELEMENTS, NUM_PARTS, PARTS,
                        WIDTH = PARTS + 4 * MAX_PARTS };

// B's elements as the op reads them: [R, out] as given, or packed (pack_expand) for the bfloat16 pairs path
int64_t expand_elements(bool packed, int64_t rank, int64_t out, const int64_t* row) {
  if (!packed) return rank * out;
  int64_t elements = 0;
  for (int64_t p = 0; p < row[NUM_PARTS]; ++p) {
    const int64_t* part = row + PARTS + 4 * p;
    elements += (part[1] - part[0] + 1) / 2 * 32 * ((part[3] - part[2] + 15) / 16);
  }
  return elements;
}

// A table row that fits x [T, in] and y [T, out]: a row built for other shapes or another dtype would read past
// its weights
void check_row(const int64_t* row, const at::Tensor& x, const at::Tensor& y, bool packed, int64_t segment) {
  bool fits = row[IN] == x.size(1) && row[ELEMENT_SIZE] == x.element_size() && row[NUM_PARTS] >= 1 &&
              row[NUM_PARTS] <= MAX_PARTS && row[A_DATA] != 0 && row[B_DATA] != 0;
  for (int64_t p = 0; fits && p < row[NUM_PARTS]; ++p) {
    const int64_t* part = row + PARTS + 4 * p;
    fits = 0 <= part[0] && part[0] < part[1] && part[1] <= row[RANK] && 0 <= part[2] && part[2] < part[3] &&
           part[3] <= y.size(1);
  }
  TORCH_CHECK(fits && row[B_ELEMENTS] == expand_elements(packed, row[RANK], y.size(1), row),
              "lora_add_: segment ", segment, "'s weights do not fit x ", x.sizes(), " and y ", y.sizes());
}

// y [T, out] += each segment's delta for x's rows [T, in], the step's rows first_row.. on. tables [S, linears,
// WIDTH]: each segment's adapter's weights table; rows [S, 2]: each segment's first and end row in the step.
template <typename T>
void add_deltas(const at::Tensor& y, const at::Tensor& x, const at::Tensor& tables, const at::Tensor& rows,
                int64_t linear, int64_t first_row, bool packed) {
  struct Item { const int64_t* weights; int64_t lo, hi; };
  std::vector<Item> items;
  const int64_t* row_bounds = rows.data_ptr<int64_t>();
  for (int64_t s = 0; s < tables.size(0); ++s) {
    const int64_t* weights = tables.data_ptr<int64_t>() + (s * tables.size(1) + linear) * WIDTH;
    const int64_t lo = std::max(row_bounds[2 * s], first_row) - first_row;
    const int64_t hi = std::min(row_bounds[2 * s + 1], first_row + x.size(0)) - first_row;
    if (lo >= hi || weights[RANK] == 0) continue;
    check_row(weights, x, y, packed, s);
    for (int64_t at = lo; at < hi; at += ROWS) items.push_back({weights, at, std::min(at + ROWS, hi)});
  }
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t in = x.size(1), out = y.size(1), x_stride = x.stride(0), y_stride = y.stride(0);
  struct Scratch { std::vector<float> shrunk, sums; std::vector<uint32_t> pairs; };
  deal_items(static_cast<int64_t>(items.size()), [] { return Scratch(); }, [&](int64_t n, Scratch& scratch) {
    const Item& it = items[n];
    const T* xi = xp + it.lo * x_stride;
    T* yi = yp + it.lo * y_stride;
    const T* a = reinterpret_cast<const T*>(it.weights[A_DATA]);
    const T* b = reinterpret_cast<const T*>(it.weights[B_DATA]);
    const int64_t rank = it.weights[RANK], num_parts = it.weights[NUM_PARTS];
    const int64_t* parts = it.weights + PARTS;
    with_rows(it.hi - it.lo, [&](auto rows) {
      constexpr int M = decltype(rows)::value;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        return segment_rows_pairs<M>(xi, x_stride, yi, y_stride, a, b, in, rank, parts, num_parts, scratch.shrunk,
                                     scratch.pairs);
      } else
#endif
      segment_rows<T, M>(xi, x_stride, yi, y_stride, a, b, in, rank, out, parts, num_parts, scratch.shrunk,
                         scratch.sums);
    });
  });
}

void lora_add_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& tables, const at::Tensor& rows,
               int64_t linear, int64_t first_row) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1 && x.size(0) == y.size(0));
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_add_: x and y differ in dtype");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 3 && tables.size(2) == WIDTH &&
              tables.is_contiguous() && 0 <= linear && linear < tables.size(1),
              "lora_add_: tables must be int64 [segments, linears, ", int64_t{WIDTH}, "] with linear ", linear);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 2 &&
              rows.size(0) == tables.size(0) && rows.size(1) == 2, "lora_add_: rows must be int64 [segments, 2]");
  const bool packed = PAIRS && x.scalar_type() == at::kBFloat16;
  switch (x.scalar_type()) {
    case at::kFloat: return add_deltas<float>(y, x, tables, rows, linear, first_row, packed);
    case at::kBFloat16: return add_deltas<at::BFloat16>(y, x, tables, rows, linear, first_row, packed);
    default: TORCH_CHECK(false, "lora_add_: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

bool lora_packs_expand(at::ScalarType dtype) { return PAIRS && dtype == at::kBFloat16; }

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor tables, Tensor rows, int linear, int first_row) -> ()", &lora_add_);
  m.def("lora_table_width() -> int", [] { return int64_t{WIDTH}; });
  m.def("lora_packs_expand(ScalarType dtype) -> bool", &lora_packs_expand);
}
