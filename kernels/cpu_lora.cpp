// LoRA deltas of a step's adapter segments on CPU (punica's SGMV): y[rows] += (x[rows] @ A) @ B for each segment's
// own adapter, in one call per linear. A decode step's segments are a few rows each, where a GEMM library call
// costs more in set-up than the arithmetic and its weights are read once anyway: this streams each adapter's A and
// B once per block of up to ROWS rows, and reads of B skip its zero blocks (a fused linear's B holds each part's B
// over that part's columns only: the `parts` table). A prompt chunk's segment is many such blocks, its weights
// then in cache. Measurements: docs/performance.md, "multi-LoRA".
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
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
// prefetcher has ramped up on them, and the loads stall on memory
constexpr int64_t PREFETCH_GROUPS = 2;
template <typename T>
inline void prefetch_ahead(const T* p, int64_t distance, const T* end) {
  if (p + distance < end) __builtin_prefetch(p + distance, 0, 3);
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

template <typename T>
void segment_rows(int64_t m, const T* x, int64_t x_stride, T* y, int64_t y_stride, const T* a, const T* b,
                  int64_t in, int64_t rank, int64_t out, const int64_t* parts, int64_t num_parts,
                  std::vector<float>& shrunk, std::vector<float>& sums) {
#define KVLOOM_ROWS(M) \
  case M: return segment_rows<T, M>(x, x_stride, y, y_stride, a, b, in, rank, out, parts, num_parts, shrunk, sums);
  switch (m) {
    KVLOOM_ROWS(1) KVLOOM_ROWS(2) KVLOOM_ROWS(3) KVLOOM_ROWS(4)
  }
  if constexpr (ROWS == 8) {
    switch (m) { KVLOOM_ROWS(5) KVLOOM_ROWS(6) KVLOOM_ROWS(7) KVLOOM_ROWS(8) }
  }
#undef KVLOOM_ROWS
  TORCH_CHECK(false, "lora_add_: a work item of ", m, " rows");
}

// y [T, out] += each segment's delta; x [T, in]; a[s] [R_s, in], b[s] [R_s, out]; rows: (first, end) per segment,
// already within x's rows; parts: per segment, its part count then (r0, r1, c0, c1) per part
template <typename T>
void add_deltas(const at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& a,
                const std::vector<at::Tensor>& b, const std::vector<int64_t>& rows, const std::vector<int64_t>& parts) {
  struct Item { int64_t segment, lo, hi, parts_at; };
  std::vector<Item> items;
  int64_t at_part = 0;
  for (size_t s = 0; s < a.size(); ++s) {
    for (int64_t lo = rows[2 * s]; lo < rows[2 * s + 1]; lo += ROWS)
      items.push_back({static_cast<int64_t>(s), lo, std::min(lo + ROWS, rows[2 * s + 1]), at_part});
    at_part += 1 + 4 * parts[at_part];
  }
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t in = x.size(1), out = y.size(1), x_stride = x.stride(0), y_stride = y.stride(0);
  std::vector<const T*> a_data, b_data;
  std::vector<int64_t> ranks;
  for (size_t s = 0; s < a.size(); ++s) {
    a_data.push_back(a[s].data_ptr<T>());
    b_data.push_back(b[s].data_ptr<T>());
    ranks.push_back(a[s].size(0));
  }
  using Scratch = std::pair<std::vector<float>, std::vector<float>>;
  deal_items(static_cast<int64_t>(items.size()), [] { return Scratch(); }, [&](int64_t n, Scratch& scratch) {
    const Item& it = items[n];
    segment_rows<T>(it.hi - it.lo, xp + it.lo * x_stride, x_stride, yp + it.lo * y_stride, y_stride,
                    a_data[it.segment], b_data[it.segment], in, ranks[it.segment], out, parts.data() + it.parts_at + 1,
                    parts[it.parts_at], scratch.first, scratch.second);
  });
}

void lora_add_(const at::Tensor& y, const at::Tensor& x, at::TensorList a, at::TensorList b, at::IntArrayRef rows,
               at::IntArrayRef parts) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1 && x.size(0) == y.size(0));
  TORCH_CHECK(a.size() == b.size() && rows.size() == 2 * a.size(), "lora_add_: one (a, b, rows) per segment");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_add_: x and y differ in dtype");
  for (size_t s = 0; s < a.size(); ++s) {
    TORCH_CHECK(a[s].is_contiguous() && b[s].is_contiguous() && a[s].scalar_type() == x.scalar_type() &&
                b[s].scalar_type() == x.scalar_type() && a[s].size(1) == x.size(1) && b[s].size(1) == y.size(1) &&
                a[s].size(0) == b[s].size(0), "lora_add_: segment ", s, "'s A and B do not fit x and y");
    TORCH_CHECK(0 <= rows[2 * s] && rows[2 * s] <= rows[2 * s + 1] && rows[2 * s + 1] <= x.size(0));
  }
  const std::vector<at::Tensor> as(a.begin(), a.end()), bs(b.begin(), b.end());
  const std::vector<int64_t> rs(rows.begin(), rows.end()), ps(parts.begin(), parts.end());
  switch (x.scalar_type()) {
    case at::kFloat: return add_deltas<float>(y, x, as, bs, rs, ps);
    case at::kBFloat16: return add_deltas<at::BFloat16>(y, x, as, bs, rs, ps);
    default: TORCH_CHECK(false, "lora_add_: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor[] a, Tensor[] b, int[] rows, int[] parts) -> ()", &lora_add_);
}
