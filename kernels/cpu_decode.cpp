// Paged decode attention for CPU: one query token per request, read straight from the block
// cache (no gather copy, no padding, no mask). A work item is one request (or one of its kv heads
// when requests are too few to feed every thread); ATen's threads take items from a shared counter,
// longest first. An item walks its request's blocks once with an online softmax. Per block and kv
// head, each query head sharing it (GQA) scores the block's keys, 8 per reduction tree, and folds
// in its values while both are still in L1; the next block (scattered, so the hardware prefetcher
// cannot guess it) is prefetched a slice per query head, spread over the block's work: one burst
// of a whole block's prefetches fills the core's miss buffers and stalls it. At batch 64, context
// 256 a step reads ~750 MB of fp32 K/V, every row exactly once.
//
// Vectors are GCC/Clang vector extensions one hardware register wide (16 floats on AVX-512, 8 on
// AVX2, 4 elsewhere), so the same source builds on any x86-64 or Arm host with -march=native. The
// cache may hold float32, float16 or bfloat16 (half the bytes to stream); the math is float32. Head
// dims 16, 32, 64, 128 and 256 are compile-time (the query row lives in registers); the GQA group is
// a runtime loop, which keeps the build to 15 instantiations (seconds of compile on a fresh machine,
// not minutes). paged_decode_supported() tells the caller when to use its torch fallback instead.
// The ops register as torch.ops.kvloom.* on ATen's own headers: pybind's torch/extension.h alone
// costs half a minute to compile. Built with -fopenmp: ATen's parallel_for is inline OpenMP, and
// without the flag it silently runs on one thread.
// The file also holds write_kv, the scatter of a step's new K/V rows into the blocks this kernel reads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_deal.h"
#include "cpu_math.h"
#include "cpu_vec.h"

namespace {

// A bfloat16 row read 2W elements at a time as W 32-bit lanes: lane i holds element 2i in its low
// half and 2i+1 in its high half, and bfloat16 is the top half of a float32, so one shift and one
// mask widen both halves exactly, with no cross-lane shuffle (the natural-order widening above
// costs a shuffle per W elements: QK and PV were bound by it). The row comes out "paired": every
// even element, then every odd one, per 2W. Queries are paired the same way once per head, so dot
// products never need the natural order back, and the outputs are unpaired once per head.
typedef uint32_t vuint_unaligned __attribute__((vector_size(W * 4), aligned(4), may_alias));

template <typename T, int NV>
constexpr bool PAIRED = std::is_same_v<T, at::BFloat16> && NV % 2 == 0;

// position, in a paired row, of natural element d
inline int64_t paired_index(int64_t d) { return d / (2 * W) * 2 * W + d % 2 * W + d % (2 * W) / 2; }

template <typename T, int NV>
inline void load_row(const T* p, vfloat* v) {
  if constexpr (PAIRED<T, NV>) {
    for (int c = 0; c < NV / 2; ++c) {
      const vuint bits = *reinterpret_cast<const vuint_unaligned*>(p + c * 2 * W);
      v[2 * c] = __builtin_bit_cast(vfloat, bits << 16);
      v[2 * c + 1] = __builtin_bit_cast(vfloat, bits & 0xFFFF0000u);
    }
  } else {
    for (int j = 0; j < NV; ++j) v[j] = load(p + j * W);
  }
}

inline float horizontal_sum(vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(v));
#elif defined(__AVX__)
  const __m256 s8 = reinterpret_cast<__m256&>(v);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
#else
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

// the W-wide dot products of 8 keys -> one vector of their 8 sums (the first 8 lanes where W is
// wider): one reduction tree for 8 scores, not 8 horizontal sums, and the scores land in a vector
inline void sum_rows8(const vfloat* dots, float* out) {
#if defined(__AVX__)
  __m256 d[8];
  for (int i = 0; i < 8; ++i) {
#if defined(__AVX512F__)  // fold each 16-float vector to 8 floats first
    const __m512 v = reinterpret_cast<const __m512&>(dots[i]);
    d[i] = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
    d[i] = reinterpret_cast<const __m256&>(dots[i]);
#endif
  }
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
#else
  for (int i = 0; i < 8; ++i) out[i] = horizontal_sum(dots[i]);
#endif
}

struct Item {
  const float* query;  // [KVH * G, D] of one request, or null where dot_bf16 applies
  const at::BFloat16* query_bf16;  // the same queries as the model computed them, where dot_bf16 applies
  int64_t query_head_stride;  // elements from one query head to the next
  const int32_t* table;
  int64_t seq_len;
  float* out;  // [KVH * G, D], in the query's dtype: one of these two is set
  at::BFloat16* out_bf16;
  int64_t first_head, last_head;  // kv heads [first_head, last_head)
};

template <typename T>
struct Cache {
  const T* keys;
  const T* values;
  int64_t block_size;
  int64_t row;  // elements per token row: KVH * D
};

// The running softmax of one query head: its output accumulator, running max and denominator.
template <int D>
struct HeadState {
  float acc[D];
  float running_max, denominator;
};

// Scores of one query head against n (<= block size) keys: 8 keys per reduction tree.
template <typename T, int NV>
inline void block_scores(const vfloat* q, const T* keys, int64_t row, int64_t n, float* __restrict scores) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    vfloat dots[8];
    for (int i = 0; i < 8; ++i) {
      if (t0 + i < n) {
        vfloat k[NV];
        load_row<T, NV>(keys + (t0 + i) * row, k);
        vfloat dot = q[0] * k[0];
        for (int j = 1; j < NV; ++j) dot += q[j] * k[j];
        dots[i] = dot;
      } else {
        dots[i] = vfloat{};
      }
    }
    sum_rows8(dots, scores + t0);
  }
}

// A bfloat16 model's queries against a bfloat16 cache, on CPUs with AVX512-BF16: VDPBF16PS
// multiplies 32 bfloat16 pairs and adds them into 16 float32 lanes, one instruction where widening
// costs three. A product of two bfloat16 is exact in float32, so the scores are the float32 ones up
// to summation order; the scale (rarely a bfloat16) multiplies the scores instead of the query.
#if defined(__AVX512BF16__)
template <typename T, int NV>
constexpr bool DOT_BF16 = std::is_same_v<T, at::BFloat16> && W == 16 && NV % 2 == 0;

template <int NV>
inline void block_scores_bf16(const at::BFloat16* query, const at::BFloat16* keys, int64_t row, int64_t n,
                              float scale, float* __restrict scores) {
  __m512bh q[NV / 2];
  for (int c = 0; c < NV / 2; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + c * 2 * W);
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    vfloat dots[8];
    for (int i = 0; i < 8; ++i) {
      if (t0 + i < n) {
        const at::BFloat16* k = keys + (t0 + i) * row;
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
        for (int c = 1; c < NV / 2; ++c) dot = _mm512_dpbf16_ps(dot, q[c], (__m512bh)_mm512_loadu_si512(k + c * 2 * W));
        dots[i] = reinterpret_cast<const vfloat&>(dot);
      } else {
        dots[i] = vfloat{};
      }
    }
    sum_rows8(dots, scores + t0);
  }
  for (int64_t t = 0; t < n; ++t) scores[t] *= scale;
}
#else
template <typename T, int NV>
constexpr bool DOT_BF16 = false;

template <int NV>
inline void block_scores_bf16(const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, float, float*) {}
#endif

// Folds one block's scores into a query head's running softmax: exp, rescale, then P.V.
template <typename T, int NV>
inline void block_update(HeadState<NV * W>& st, float* __restrict s, const T* values, int64_t row, int64_t n) {
  float block_max = st.running_max;
  for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
  for (int64_t t = 0; t < n; ++t) s[t] -= block_max;
  exp_nonpositive_all(s, n);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += s[t];
  vfloat acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = load(st.acc + j * W);
  if (block_max > st.running_max) {
    float correction = st.running_max - block_max;
    correction = exp_nonpositive(correction);
    st.denominator *= correction;
    for (int j = 0; j < NV; ++j) acc[j] *= correction;
    st.running_max = block_max;
  }
  st.denominator += sum;
  for (int64_t t = 0; t < n; ++t) {
    vfloat v[NV];
    load_row<T, NV>(values + t * row, v);
    const float p = s[t];
    for (int j = 0; j < NV; ++j) acc[j] += p * v[j];
  }
  for (int j = 0; j < NV; ++j) store(st.acc + j * W, acc[j]);
}

// One request's kv heads: walk its blocks once; per block and kv head, each of the G query heads
// sharing it scores the block's keys and folds in its values while both are still in L1.
template <typename T, int NV>
void decode_item(const Item& item, const Cache<T>& cache, int G, float scale, float* scratch) {
  constexpr int D = NV * W;
  constexpr int64_t LINE = 64 / sizeof(T);  // elements per cache line
  const int64_t BS = cache.block_size, L = item.seq_len;
  const int64_t first = item.first_head * G, heads = (item.last_head - item.first_head) * G;
  auto* states = reinterpret_cast<HeadState<D>*>(scratch);
  float* scores = scratch + heads * sizeof(HeadState<D>) / sizeof(float);
  const bool dot_bf16 = DOT_BF16<T, NV> && item.query == nullptr;
  const float* queries = item.query;  // [KVH * G, D], paired like the rows where they are
  int64_t head_stride = item.query_head_stride;
  if (PAIRED<T, NV> && !dot_bf16) {
    float* paired = scores + BS + 8;
    for (int64_t h = first; h < first + heads; ++h)
      for (int64_t d = 0; d < D; ++d) paired[h * D + paired_index(d)] = item.query[h * head_stride + d];
    queries = paired;
    head_stride = D;
  }
  for (int64_t h = 0; h < heads; ++h) {
    std::fill_n(states[h].acc, D, 0.f);
    states[h].running_max = -INFINITY;
    states[h].denominator = 0.f;
  }
  // the next block (contiguous BS rows of K, then of V) is fetched a slice per query head processed
  const int64_t block_elems = BS * cache.row;
  const int64_t slice = ((block_elems + heads - 1) / heads + LINE - 1) / LINE * LINE;
  for (int64_t start = 0; start < L; start += BS) {
    const int64_t n = std::min(BS, L - start);
    const int64_t base = static_cast<int64_t>(item.table[start / BS]) * BS * cache.row;
    const T* next_keys = nullptr;
    const T* next_values = nullptr;
    if (start + BS < L) {
      const int64_t next = static_cast<int64_t>(item.table[start / BS + 1]) * BS * cache.row;
      next_keys = cache.keys + next;
      next_values = cache.values + next;
    }
    int64_t prefetched = 0;
    for (int64_t kvh = item.first_head; kvh < item.last_head; ++kvh) {
      const T* keys = cache.keys + base + kvh * D;
      const T* values = cache.values + base + kvh * D;
      for (int g = 0; g < G; ++g) {
        const int64_t head = kvh * G + g;
        if (dot_bf16) {
          block_scores_bf16<NV>(item.query_bf16 + head * head_stride, reinterpret_cast<const at::BFloat16*>(keys),
                                cache.row, n, scale, scores);
        } else {
          vfloat q[NV];
          for (int j = 0; j < NV; ++j) q[j] = load(queries + head * head_stride + j * W) * scale;
          block_scores<T, NV>(q, keys, cache.row, n, scores);
        }
        block_update<T, NV>(states[head - first], scores, values, cache.row, n);
        if (next_keys != nullptr) {
          const int64_t stop = std::min(prefetched + slice, block_elems);
          for (; prefetched < stop; prefetched += LINE) {
            __builtin_prefetch(next_keys + prefetched);
            __builtin_prefetch(next_values + prefetched);
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / states[h].denominator;
    float* acc = states[h].acc;
    if constexpr (PAIRED<T, NV>) {  // back to natural order, through the paired queries' room (done with)
      float* natural = scores + BS + 8;
      for (int64_t d = 0; d < D; ++d) natural[d] = acc[paired_index(d)];
      acc = natural;
    }
    if (item.out_bf16 != nullptr) {
      at::BFloat16* out = item.out_bf16 + (first + h) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<at::BFloat16>(acc[d] * inv);
    } else {
      float* out = item.out + (first + h) * D;
      for (int j = 0; j < NV; ++j) store(out + j * W, load(acc + j * W) * inv);
    }
  }
}

template <typename T>
using ItemFn = void (*)(const Item&, const Cache<T>&, int, float, float*);

template <typename T>
ItemFn<T> pick(int64_t head_dim, int64_t group) {
  if (group < 1) return nullptr;
  switch (head_dim) {
    case 16: return &decode_item<T, 16 / W>;
    case 32: return &decode_item<T, 32 / W>;
    case 64: return &decode_item<T, 64 / W>;
    case 128: return &decode_item<T, 128 / W>;
    case 256: return &decode_item<T, 256 / W>;
    default: return nullptr;
  }
}

// Whether a bfloat16 query meets a T cache through VDPBF16PS (no float32 copy of the queries needed).
template <typename T>
bool dot_bf16_applies(int64_t head_dim) { return DOT_BF16<T, 2> && head_dim / W % 2 == 0; }

// query [B, H, D] in the model's dtype, its rows possibly strided (a view of fused QKV rows) -> [B, H, D] of
// that dtype. Float32 queries are read in place; bfloat16 ones too where dot_bf16 applies, else widened once.
template <typename T>
at::Tensor run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
               const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const bool bf16_query = query.scalar_type() == at::kBFloat16;
  const bool dot_bf16 = bf16_query && dot_bf16_applies<T>(D);
  const at::Tensor wide = dot_bf16 || !bf16_query ? query : query.to(at::kFloat).contiguous();
  const float* q = dot_bf16 ? nullptr : wide.data_ptr<float>();
  const at::BFloat16* q_bf16 = dot_bf16 ? query.data_ptr<at::BFloat16>() : nullptr;
  const int64_t q_stride = wide.stride(0), q_head_stride = wide.stride(1);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2), G = H / KVH;
  const ItemFn<T> fn = pick<T>(D, G);
  TORCH_CHECK(fn != nullptr, "unsupported head_dim ", D, " / group ", G);
  const int64_t MAXB = block_tables.size(1);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty({B, H, D}, query.options());
  float* o = bf16_query ? nullptr : out.data_ptr<float>();
  at::BFloat16* o_bf16 = bf16_query ? out.data_ptr<at::BFloat16>() : nullptr;
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const int32_t* bt = tables.data_ptr<int32_t>();
  const int32_t* sl = lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  // a work item is a request, or one of its kv heads when there are too few requests to keep every
  // thread busy; dealt longest context first
  const int64_t threads = deal_threads();
  const int64_t split = B >= 4 * threads ? 1 : KVH;
  const int64_t items = B * split;
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sl[a / split] > sl[b / split]; });
  const int64_t heads_per_item = KVH / split;
  // per thread: the heads' softmax states, one block's scores, and paired queries (all H of them,
  // indexed by head)
  const size_t scratch_floats = heads_per_item * G * sizeof(HeadState<256>) / sizeof(float) + BS + 8 + H * D;
  deal_items(
      items, [&] { return std::vector<float>(scratch_floats); },
      [&](int64_t n, std::vector<float>& scratch) {
        const int64_t i = order[n], b = i / split, first = (i % split) * heads_per_item;
        const Item item{q ? q + b * q_stride : nullptr, q_bf16 ? q_bf16 + b * q_stride : nullptr, q_head_stride,
                        bt + b * MAXB, sl[b], o ? o + b * H * D : nullptr, o_bf16 ? o_bf16 + b * H * D : nullptr,
                        first, first + heads_per_item};
        fn(item, Cache<T>{kc, vc, BS, KVH * D}, static_cast<int>(G), fscale, scratch.data());
      });
  return out;
}

}  // namespace

// New tokens' K/V into their cache slots: key/value [T, KVH, D] in the cache's dtype, each token's heads
// contiguous (rows may be strided views of fused QKV rows), slot_mapping [T] int64; a negative slot is
// padding, skipped. One call for both caches where two index_copy_ took ~10 us each a layer at decode sizes.
void write_kv(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
              const at::Tensor& value, const at::Tensor& slot_mapping) {
  const int64_t T = key.size(0), row = key_cache.size(2) * key_cache.size(3);
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes());
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "K/V must be in the cache's dtype");
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) * t->size(2) == row && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2), "K/V: [T, kv_heads, head_dim] with each token's heads contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T);
  const auto slot = slot_mapping.contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const size_t bytes = row * key_cache.element_size();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < T; ++t) {
    if (sp[t] < 0) continue;
    TORCH_CHECK(sp[t] < slots, "slot ", sp[t], " is past the cache's ", slots);
    std::memcpy(kc + sp[t] * bytes, k + t * k_stride, bytes);
    std::memcpy(vc + sp[t] * bytes, v + t * v_stride, bytes);
  }
}

bool paged_decode_supported(int64_t head_dim, int64_t group) { return pick<float>(head_dim, group) != nullptr; }

at::Tensor paged_decode(const at::Tensor& query,         // [B, H, D] float32 or bfloat16, any B/H strides
                        const at::Tensor& key_cache,     // [NB, BS, KVH, D] float32, float16 or bfloat16
                        const at::Tensor& value_cache,   // [NB, BS, KVH, D] same dtype as key_cache
                        const at::Tensor& block_tables,  // [B, MAXB] int32
                        const at::Tensor& seq_lens,      // [B] int32, each >= 1
                        double scale) {
  TORCH_CHECK(query.dtype() == at::kFloat || query.dtype() == at::kBFloat16, "the query must be float32 or bfloat16");
  TORCH_CHECK(key_cache.dtype() == value_cache.dtype(), "key and value caches differ in dtype");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "the query's head_dim must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous());
  switch (key_cache.scalar_type()) {
    case at::kFloat: return run<float>(query, key_cache, value_cache, block_tables, seq_lens, scale);
    case at::kHalf: return run<at::Half>(query, key_cache, value_cache, block_tables, seq_lens, scale);
    case at::kBFloat16: return run<at::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, scale);
    default: TORCH_CHECK(false, "unsupported cache dtype ", key_cache.scalar_type());
  }
}

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor", &paged_decode);
  m.def("paged_decode_supported(int head_dim, int group) -> bool", &paged_decode_supported);
  m.def("write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()",
        &write_kv);
}
