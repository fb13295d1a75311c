// Paged decode attention for CPU: one query token per request, read straight from the block
// cache (no gather copy, no padding, no mask). A work item is one request's kv heads, split over
// ATen's thread pool; it walks the request's blocks in order with an online softmax, touching
// each block once while the next one is prefetched (blocks are scattered, so the hardware
// prefetcher cannot follow), and the query heads sharing a kv head (GQA) all use each K/V row
// while it is in registers. The step is memory-bound: at batch 64, context 256 it reads ~750 MB
// of fp32 K/V, so every row is read exactly once.
//
// Vectors are GCC/Clang vector extensions one hardware register wide (16 floats on AVX-512, 8 on
// AVX2, 4 elsewhere), so the same source builds on any x86-64 or Arm host with -march=native. The
// cache may hold float32, float16 or bfloat16 (half the bytes to stream); the math is float32. Head
// dims 16, 32, 64, 128 and 256 are compile-time (the row lives in registers); the GQA group (up to 8
// query heads per kv head) is a runtime loop whose per-row state sits in L1, which keeps the build
// to 15 instantiations (seconds of compile on a fresh machine, not minutes). paged_decode_supported()
// tells the caller when to use its torch fallback instead. The ops register as torch.ops.kvloom.*
// on ATen's own headers: pybind's torch/extension.h alone costs half a minute to compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

// one hardware register of floats: scalar-times-vector and loads then map to single instructions
// (a wider generic vector on AVX2 makes GCC build every broadcast through the stack, measured 2x slower)
#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;  // SSE2, NEON
#endif
constexpr int MAX_GROUP = 8;
constexpr int64_t MAX_ITEM_HEADS = 4;  // kv heads per work item: bounds the per-item state
typedef float vfloat __attribute__((vector_size(W * 4)));
typedef float vfloat_unaligned __attribute__((vector_size(W * 4), aligned(4), may_alias));
typedef _Float16 vhalf_unaligned __attribute__((vector_size(W * 2), aligned(2), may_alias));
typedef uint16_t vbits_unaligned __attribute__((vector_size(W * 2), aligned(2), may_alias));
typedef uint32_t vuint __attribute__((vector_size(W * 4)));

// W cache elements as floats: K/V may be stored in float32, float16 or bfloat16, math is float32
inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat_unaligned*>(p); }
inline vfloat load(const at::Half* p) {
#if defined(__AVX512F__)  // GCC 12 scalarizes the generic conversion below (measured 1.9x slower than float32)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<const vfloat&>(v);
#elif defined(__AVX__) && defined(__F16C__)
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<const vfloat&>(v);
#else
  return __builtin_convertvector(*reinterpret_cast<const vhalf_unaligned*>(p), vfloat);
#endif
}
inline vfloat load(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  const vuint bits = __builtin_convertvector(*reinterpret_cast<const vbits_unaligned*>(p), vuint) << 16;
  return reinterpret_cast<const vfloat&>(bits);
}
inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat_unaligned*>(p) = v; }

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

// exp(x) for x <= 0 (softmax after subtracting the max): Cephes-style range reduction and a degree-6
// polynomial, ~1 ulp, written as a plain loop so the compiler vectorizes it (std::exp does not).
inline void exp_nonpositive(float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.0f);
    const float k = std::floor(v * 1.44269504088896341f + 0.5f);
    const float r = v - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    x[i] = p * __builtin_bit_cast(float, bits);
  }
}

struct Item {
  const float* query;  // [KVH * G, D] of one request
  const int32_t* table;
  int64_t seq_len;
  float* out;
  int64_t first_head, last_head;  // kv heads [first_head, last_head)
};

template <typename T>
struct Cache {
  const T* keys;
  const T* values;
  int64_t block_size;
  int64_t row;  // floats per token row: KVH * D
};

template <int NV>
struct HeadState {
  vfloat q[MAX_GROUP][NV], acc[MAX_GROUP][NV];
  float running_max[MAX_GROUP], denominator[MAX_GROUP];
};

template <typename T, int NV>
void decode_item(const Item& item, const Cache<T>& cache, int G, float scale, float* __restrict scores) {
  constexpr int D = NV * W;
  constexpr int64_t LINE = 64 / sizeof(T);  // elements per cache line
  const int64_t BS = cache.block_size, L = item.seq_len;
  HeadState<NV> states[MAX_ITEM_HEADS];
  const int64_t nh = item.last_head - item.first_head;
  for (int64_t h = 0; h < nh; ++h) {
    auto& st = states[h];
    const float* qh = item.query + (item.first_head + h) * G * D;
    for (int g = 0; g < G; ++g) {
      for (int j = 0; j < NV; ++j) { st.q[g][j] = load(qh + g * D + j * W) * scale; st.acc[g][j] = vfloat{}; }
      st.running_max[g] = -INFINITY;
      st.denominator[g] = 0.f;
    }
  }
  for (int64_t start = 0; start < L; start += BS) {
    const int64_t n = std::min(BS, L - start);
    const int64_t base = static_cast<int64_t>(item.table[start / BS]) * BS * cache.row;
    if (start + BS < L) {  // the hardware prefetcher cannot guess the next block: fetch it one block ahead
      const int64_t next = static_cast<int64_t>(item.table[start / BS + 1]) * BS * cache.row;
      for (int64_t t = 0; t < BS; ++t)
        for (int64_t off = item.first_head * D; off < item.last_head * D; off += LINE) {
          __builtin_prefetch(cache.keys + next + t * cache.row + off);
          __builtin_prefetch(cache.values + next + t * cache.row + off);
        }
    }
    for (int64_t h = 0; h < nh; ++h) {
      auto& st = states[h];
      const T* keys = cache.keys + base + (item.first_head + h) * D;
      const T* values = cache.values + base + (item.first_head + h) * D;
      for (int64_t t = 0; t < n; ++t) {
        vfloat k[NV];
        for (int j = 0; j < NV; ++j) k[j] = load(keys + t * cache.row + j * W);
        for (int g = 0; g < G; ++g) {
          vfloat dot = st.q[g][0] * k[0];
          for (int j = 1; j < NV; ++j) dot += st.q[g][j] * k[j];
          scores[g * BS + t] = horizontal_sum(dot);
        }
      }
      for (int g = 0; g < G; ++g) {
        float* s = scores + g * BS;
        float block_max = st.running_max[g];
        for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
        for (int64_t t = 0; t < n; ++t) s[t] -= block_max;
        exp_nonpositive(s, n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) sum += s[t];
        if (block_max > st.running_max[g]) {
          float correction = st.running_max[g] - block_max;
          exp_nonpositive(&correction, 1);
          st.denominator[g] *= correction;
          for (int j = 0; j < NV; ++j) st.acc[g][j] *= correction;
          st.running_max[g] = block_max;
        }
        st.denominator[g] += sum;
      }
      for (int64_t t = 0; t < n; ++t) {
        vfloat v[NV];
        for (int j = 0; j < NV; ++j) v[j] = load(values + t * cache.row + j * W);
        for (int g = 0; g < G; ++g) {
          const float p = scores[g * BS + t];
          for (int j = 0; j < NV; ++j) st.acc[g][j] += p * v[j];
        }
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    auto& st = states[h];
    float* oh = item.out + (item.first_head + h) * G * D;
    for (int g = 0; g < G; ++g) {
      const float inv = 1.f / st.denominator[g];
      for (int j = 0; j < NV; ++j) store(oh + g * D + j * W, st.acc[g][j] * inv);
    }
  }
}

template <typename T>
using ItemFn = void (*)(const Item&, const Cache<T>&, int, float, float*);

template <typename T>
ItemFn<T> pick(int64_t head_dim, int64_t group) {
  if (group < 1 || group > MAX_GROUP) return nullptr;
  switch (head_dim) {
    case 16: return &decode_item<T, 16 / W>;
    case 32: return &decode_item<T, 32 / W>;
    case 64: return &decode_item<T, 64 / W>;
    case 128: return &decode_item<T, 128 / W>;
    case 256: return &decode_item<T, 256 / W>;
    default: return nullptr;
  }
}

template <typename T>
at::Tensor run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
               const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2), G = H / KVH;
  const ItemFn<T> fn = pick<T>(D, G);
  TORCH_CHECK(fn != nullptr, "unsupported head_dim ", D, " / group ", G);
  const int64_t MAXB = block_tables.size(1);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(query);
  const float* q = query.data_ptr<float>();
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const int32_t* bt = tables.data_ptr<int32_t>();
  const int32_t* sl = lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // a work item is a request's kv heads (at most MAX_ITEM_HEADS of them), or a single kv head when there
  // are too few requests to keep every thread busy
  const int64_t split = B >= 4 * at::get_num_threads() ? (KVH + MAX_ITEM_HEADS - 1) / MAX_ITEM_HEADS : KVH;
  at::parallel_for(0, B * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * BS);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / split, part = i % split;
      const int64_t first = part * KVH / split, last = (part + 1) * KVH / split;
      const Item item{q + b * H * D, bt + b * MAXB, sl[b], o + b * H * D, first, last};
      fn(item, Cache<T>{kc, vc, BS, KVH * D}, static_cast<int>(G), fscale, scores.data());
    }
  });
  return out;
}

}  // namespace

bool paged_decode_supported(int64_t head_dim, int64_t group) { return pick<float>(head_dim, group) != nullptr; }

at::Tensor paged_decode(const at::Tensor& query,         // [B, H, D] float32, contiguous
                        const at::Tensor& key_cache,     // [NB, BS, KVH, D] float32, float16 or bfloat16
                        const at::Tensor& value_cache,   // [NB, BS, KVH, D] same dtype as key_cache
                        const at::Tensor& block_tables,  // [B, MAXB] int32
                        const at::Tensor& seq_lens,      // [B] int32, each >= 1
                        double scale) {
  TORCH_CHECK(query.dtype() == at::kFloat, "the query must be float32");
  TORCH_CHECK(key_cache.dtype() == value_cache.dtype(), "key and value caches differ in dtype");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous());
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
}
