// Causal prefill attention for CPU: every prompt chunk of a step in one call, read from the paged cache.
//
// torch's CPU flash attention (what per-request SDPA ran) computes the whole square of scores under a
// causal mask (as slow causal as not) at ~60 GFLOP/s on two cores, a fifth of a bfloat16 prefill
// step's time. Here a prompt's K and V, per kv head, are first widened to float32 once (K transposed,
// [D, keys], so that scores come out a vector of keys at a time), then work items of a few query
// positions times the G query heads that share the kv head (rows) score only the keys at or before
// their own position, with register-blocked broadcast-FMA loops (a row block times two vectors of
// keys for Q.K, a row block times a slice of the head dim for P.V) and an exact two-pass softmax over
// a row's scores held in L2. Items go to ATen's threads from a shared counter, costliest first.
// Query rows are read where the QKV projection left them and outputs written, in the query's dtype, to the
// chunks' rows of the step's output (no gather, scatter or conversion pass around the call).
// Math is float32 (float32 products, float32 sums), except for a bfloat16 model over a bfloat16 cache
// on CPUs with AVX512-BF16: there VDPBF16PS multiplies bfloat16 pairs into float32 sums, twice the
// products of an FMA per instruction, over K and V laid out in pairs, with the probabilities rounded
// to bfloat16 for P.V (as torch's bfloat16 attention rounds them). Head dims 16-256 (powers of two)
// are compiled, for AVX-512 hosts; prefill_supported() tells the caller when to fall back to SDPA.
// Measured on the AVX512-BF16 EPYC, 2 threads, 9 query heads on 3 kv heads of 64: eight 256-token
// prompts 3.3 ms (bfloat16 pairs) and 7.4 ms (float32) against SDPA's 10-11; one of 2048 tokens
// 19.5 and 41 ms against 45.5.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_deal.h"
#include "cpu_math.h"
#include "cpu_vec.h"

namespace {

constexpr int QK_ROWS = W == 16 ? 8 : 4;  // rows per Q.K register block (times 2 key vectors)
constexpr int PV_ROWS = W == 16 ? 4 : 2;  // rows per P.V register block (times PV_VECS of the head dim)
constexpr int PV_VECS = 4;
constexpr int TILE_ROWS = 32;  // query rows (positions x heads of a group) per work item, about

#if defined(__AVX512BF16__)
constexpr bool HAS_DOT_BF16 = W == 16;
#else
constexpr bool HAS_DOT_BF16 = false;
#endif

// One prompt chunk's K and V per kv head, in the layout its math reads: float32, K transposed
// [D, padded keys] and V [padded keys, D]; or, for the bfloat16 dot products, 32-bit pairs of
// bfloat16: K [D/2, padded keys] (pairs of head dims), V [padded keys / 2, D] (pairs of keys).
struct Prompt {
  const void* query;  // [q_len, H, D] float32 or bfloat16, the chunk's rows
  int64_t row_stride, head_stride;  // elements from one row, and one head, to the next (a fused QKV output's)
  void* out;          // [q_len, H, D] contiguous, in the query's dtype
  int64_t q_len, seq_len, padded;  // padded: keys rounded up to 2W, zero past seq_len
  std::unique_ptr<float[]> keys, values;  // per kv head: D * padded 4-byte elements each
};

struct Work {
  int64_t prompt, kv_head, first_pos, num_pos;
};

// Where token t's row for kv head kvh starts in a cache [NB, BS, KVH, D], in elements.
inline int64_t row_offset(const int32_t* table, int64_t t, int64_t BS, int64_t KVH, int64_t D, int64_t kvh) {
  return ((static_cast<int64_t>(table[t / BS]) * BS + t % BS) * KVH + kvh) * D;
}

template <typename T>
void widen_prompt(Prompt& p, const T* kc, const T* vc, const int32_t* table, int64_t BS, int64_t KVH, int64_t D,
                  int64_t kvh) {
  float* kt = p.keys.get() + kvh * D * p.padded;
  float* v = p.values.get() + kvh * D * p.padded;
  for (int64_t t = 0; t < p.seq_len; ++t) {
    const int64_t row = row_offset(table, t, BS, KVH, D, kvh);
    for (int64_t d = 0; d < D; d += W) {
      const vfloat k = load(kc + row + d);
      for (int i = 0; i < W; ++i) kt[(d + i) * p.padded + t] = k[i];
      store(v + t * D + d, load(vc + row + d));
    }
  }
  for (int64_t d = 0; d < D; ++d) std::fill(kt + d * p.padded + p.seq_len, kt + (d + 1) * p.padded, 0.f);
  std::fill(v + p.seq_len * D, v + p.padded * D, 0.f);
}

// The bfloat16 cache's rows as pairs: a K row's adjacent head dims already are one, two V rows interleave.
void pair_prompt(Prompt& p, const at::BFloat16* kc, const at::BFloat16* vc, const int32_t* table, int64_t BS,
                 int64_t KVH, int64_t D, int64_t kvh) {
  auto* kt = reinterpret_cast<uint32_t*>(p.keys.get()) + kvh * D * p.padded;
  auto* v = reinterpret_cast<uint32_t*>(p.values.get()) + kvh * D * p.padded;
  auto row = [&](int64_t t) { return reinterpret_cast<const uint16_t*>(vc) + row_offset(table, t, BS, KVH, D, kvh); };
  for (int64_t t = 0; t < p.seq_len; ++t) {
    const auto* k_row = reinterpret_cast<const uint32_t*>(kc + row_offset(table, t, BS, KVH, D, kvh));
    for (int64_t dp = 0; dp < D / 2; ++dp) kt[dp * p.padded + t] = k_row[dp];
  }
  for (int64_t dp = 0; dp < D / 2; ++dp) std::fill(kt + dp * p.padded + p.seq_len, kt + (dp + 1) * p.padded, 0u);
  for (int64_t t = 0; t < p.padded; t += 2) {
    uint32_t* dst = v + t / 2 * D;
    if (t >= p.seq_len) {
      std::fill_n(dst, D, 0u);
      continue;
    }
    const uint16_t* even = row(t);
    const uint16_t* odd = t + 1 < p.seq_len ? row(t + 1) : nullptr;
    for (int64_t d = 0; d < D; ++d) dst[d] = even[d] | (odd ? static_cast<uint32_t>(odd[d]) << 16 : 0u);
  }
}

// scores[r, 0:keys) = q[r] . K[0:keys) for rows [0, rows) (rows a multiple of QK_ROWS, keys of 2W);
// float32 queries come scaled
template <int D>
void scores_f32(const float* q, const float* kt, int64_t padded, int64_t rows, int64_t keys, float* s) {
  for (int64_t r0 = 0; r0 < rows; r0 += QK_ROWS) {
    for (int64_t k0 = 0; k0 < keys; k0 += 2 * W) {
      vfloat acc[QK_ROWS][2] = {};
      for (int64_t d = 0; d < D; ++d) {
        const vfloat k_lo = load(kt + d * padded + k0), k_hi = load(kt + d * padded + k0 + W);
#pragma GCC unroll 16
        for (int r = 0; r < QK_ROWS; ++r) {
          const float x = q[(r0 + r) * D + d];
          acc[r][0] += x * k_lo;
          acc[r][1] += x * k_hi;
        }
      }
      for (int r = 0; r < QK_ROWS; ++r) {
        store(s + (r0 + r) * keys + k0, acc[r][0]);
        store(s + (r0 + r) * keys + k0 + W, acc[r][1]);
      }
    }
  }
}

// out[r] = sum over keys k <= limit[r] of p[r, k] v[k], rows a multiple of PV_ROWS
template <int D>
void values_f32(const float* p, int64_t keys_stride, const float* v, const int64_t* limit, int64_t rows, float* out) {
  constexpr int NV = D / W;
  constexpr int VECS = NV < PV_VECS ? NV : PV_VECS;
  for (int64_t r0 = 0; r0 < rows; r0 += PV_ROWS) {
    int64_t keys = 0;
    for (int r = 0; r < PV_ROWS; ++r) keys = std::max(keys, limit[r0 + r] + 1);
    for (int c = 0; c < NV; c += VECS) {
      vfloat acc[PV_ROWS][VECS] = {};
      for (int64_t k = 0; k < keys; ++k) {
        vfloat vk[VECS];
#pragma GCC unroll 8
        for (int j = 0; j < VECS; ++j) vk[j] = load(v + k * D + (c + j) * W);
#pragma GCC unroll 8
        for (int r = 0; r < PV_ROWS; ++r) {
          const float x = p[(r0 + r) * keys_stride + k];  // zero past the row's own position
#pragma GCC unroll 8
          for (int j = 0; j < VECS; ++j) acc[r][j] += x * vk[j];
        }
      }
      for (int r = 0; r < PV_ROWS; ++r)
        for (int j = 0; j < VECS; ++j) store(out + (r0 + r) * D + (c + j) * W, acc[r][j]);
    }
  }
}

#if defined(__AVX512BF16__)
// scores_f32 over pairs: q [rows, D/2] and K [D/2, padded] bfloat16 pairs; the scale applies to the sums
template <int D>
void scores_bf16(const uint32_t* q, const uint32_t* kt, int64_t padded, int64_t rows, int64_t keys, float scale,
                 float* s) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rows; r0 += QK_ROWS) {
    for (int64_t k0 = 0; k0 < keys; k0 += 2 * W) {
      __m512 acc[QK_ROWS][2];
      for (int r = 0; r < QK_ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t dp = 0; dp < D / 2; ++dp) {
        const __m512bh k_lo = (__m512bh)_mm512_loadu_si512(kt + dp * padded + k0);
        const __m512bh k_hi = (__m512bh)_mm512_loadu_si512(kt + dp * padded + k0 + W);
#pragma GCC unroll 16
        for (int r = 0; r < QK_ROWS; ++r) {
          const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[(r0 + r) * (D / 2) + dp]));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, k_lo);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, k_hi);
        }
      }
      for (int r = 0; r < QK_ROWS; ++r) {
        _mm512_storeu_ps(s + (r0 + r) * keys + k0, _mm512_mul_ps(acc[r][0], vscale));
        _mm512_storeu_ps(s + (r0 + r) * keys + k0 + W, _mm512_mul_ps(acc[r][1], vscale));
      }
    }
  }
}

// values_f32 over pairs: probabilities rounded to bfloat16 pairs of keys, V [padded / 2, D] pairs of keys
template <int D>
void values_bf16(const float* p, int64_t keys_stride, const uint32_t* v, const int64_t* limit, int64_t rows,
                 float* out, std::vector<uint16_t>& rounded) {
  constexpr int NV = D / W;
  constexpr int VECS = NV < PV_VECS ? NV : PV_VECS;
  rounded.resize(rows * keys_stride);
  for (int64_t i = 0; i < rows * keys_stride; i += 2 * W)
    _mm512_storeu_si512(rounded.data() + i,
                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + i + W), _mm512_loadu_ps(p + i)));
  const auto* pairs = reinterpret_cast<const uint32_t*>(rounded.data());
  for (int64_t r0 = 0; r0 < rows; r0 += PV_ROWS) {
    int64_t keys = 0;
    for (int r = 0; r < PV_ROWS; ++r) keys = std::max(keys, limit[r0 + r] + 1);
    for (int c = 0; c < NV; c += VECS) {
      __m512 acc[PV_ROWS][VECS];
      for (int r = 0; r < PV_ROWS; ++r)
        for (int j = 0; j < VECS; ++j) acc[r][j] = _mm512_setzero_ps();
      for (int64_t kp = 0; kp < (keys + 1) / 2; ++kp) {
        __m512bh vk[VECS];
#pragma GCC unroll 8
        for (int j = 0; j < VECS; ++j) vk[j] = (__m512bh)_mm512_loadu_si512(v + kp * D + (c + j) * W);
#pragma GCC unroll 8
        for (int r = 0; r < PV_ROWS; ++r) {
          const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[(r0 + r) * (keys_stride / 2) + kp]));
#pragma GCC unroll 8
          for (int j = 0; j < VECS; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, vk[j]);
        }
      }
      for (int r = 0; r < PV_ROWS; ++r)
        for (int j = 0; j < VECS; ++j) _mm512_storeu_ps(out + (r0 + r) * D + (c + j) * W, acc[r][j]);
    }
  }
}
#endif

// A thread's buffers, reused across its work items.
struct Scratch {
  std::vector<float> q, scores, out, denominators;
  std::vector<int64_t> limits;  // per row: its last key (its own position)
  std::vector<uint16_t> rounded;  // bfloat16 probabilities
};

// softmax over each row's keys [0, limit]: probabilities in place, zero past the limit; their sums
void softmax_rows(float* s, int64_t rows, int64_t keys, const int64_t* limits, float* denominators) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * keys;
    const int64_t n = limits[r] + 1;
    // the max in W lanes: a scalar max reduction does not vectorize (NaN semantics) and took longer than Q.K
    std::fill(row + n, row + keys, -INFINITY);
    vfloat lanes = load(row);
    for (int64_t k = W; k < keys; k += W) {
      const vfloat x = load(row + k);
      lanes = lanes > x ? lanes : x;
    }
    float row_max = lanes[0];
    for (int i = 1; i < W; ++i) row_max = std::max(row_max, lanes[i]);
    for (int64_t k = 0; k < n; ++k) row[k] -= row_max;
    exp_nonpositive_all(row, n);
    float sum = 0.f;
    for (int64_t k = 0; k < n; ++k) sum += row[k];
    std::fill(row + n, row + keys, 0.f);
    denominators[r] = sum;
  }
}

// One work item: positions [first_pos, first_pos + num_pos) of a chunk, the G query heads of one kv head.
// Q is the query's element type (float, or bfloat16 with DOT_BF16).
template <int D, typename Q, bool DOT_BF16>
void attend(const Prompt& p, const Work& w, int64_t H, int64_t G, float scale, Scratch& buf) {
  const int64_t rows = w.num_pos * G;
  const int64_t padded_rows = (rows + QK_ROWS - 1) / QK_ROWS * QK_ROWS;  // a multiple of PV_ROWS too
  const int64_t context = p.seq_len - p.q_len;  // keys cached before the chunk (a prefix hit, earlier chunks)
  const int64_t last = context + w.first_pos + w.num_pos - 1;  // the last position any row sees
  const int64_t keys = std::min((last + 2 * W) / (2 * W) * (2 * W), p.padded);
  buf.q.resize(padded_rows * D);
  buf.scores.resize(padded_rows * keys);
  buf.out.resize(padded_rows * D);
  buf.denominators.resize(padded_rows);
  buf.limits.resize(padded_rows);
  // row r: position first_pos + r / G, query head kv_head * G + r % G; float32 scaled, bfloat16 as is
  float* q = buf.q.data();
  auto* q_bf16 = reinterpret_cast<Q*>(q);
  for (int64_t r = 0; r < padded_rows; ++r) {
    const int64_t pos = w.first_pos + r / G, head = w.kv_head * G + r % G;
    buf.limits[r] = r < rows ? context + pos : 0;  // padding rows: computed, never written out
    const Q* src = static_cast<const Q*>(p.query) + pos * p.row_stride + head * p.head_stride;
    for (int64_t d = 0; d < D; ++d) {
      if constexpr (DOT_BF16)
        q_bf16[r * D + d] = r < rows ? src[d] : Q(0.f);
      else
        q[r * D + d] = r < rows ? static_cast<float>(src[d]) * scale : 0.f;
    }
  }
  float* s = buf.scores.data();
  const int64_t head_offset = w.kv_head * D * p.padded;
#if defined(__AVX512BF16__)
  if constexpr (DOT_BF16) {
    scores_bf16<D>(reinterpret_cast<const uint32_t*>(q), reinterpret_cast<const uint32_t*>(p.keys.get()) + head_offset,
                   p.padded, padded_rows, keys, scale, s);
    softmax_rows(s, padded_rows, keys, buf.limits.data(), buf.denominators.data());
    values_bf16<D>(s, keys, reinterpret_cast<const uint32_t*>(p.values.get()) + head_offset, buf.limits.data(),
                   padded_rows, buf.out.data(), buf.rounded);
  } else
#endif
  {
    scores_f32<D>(q, p.keys.get() + head_offset, p.padded, padded_rows, keys, s);
    softmax_rows(s, padded_rows, keys, buf.limits.data(), buf.denominators.data());
    values_f32<D>(s, keys, p.values.get() + head_offset, buf.limits.data(), padded_rows, buf.out.data());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = w.first_pos + r / G, head = w.kv_head * G + r % G;
    const float inv = 1.f / buf.denominators[r];
    Q* dst = static_cast<Q*>(p.out) + (pos * H + head) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(buf.out[r * D + d] * inv);
  }
}

using AttendFn = void (*)(const Prompt&, const Work&, int64_t, int64_t, float, Scratch&);

template <typename Q, bool DOT_BF16>
AttendFn pick(int64_t head_dim) {
  switch (head_dim) {
    case 16: return &attend<16, Q, DOT_BF16>;
    case 32: return &attend<32, Q, DOT_BF16>;
    case 64: return &attend<64, Q, DOT_BF16>;
    case 128: return &attend<128, Q, DOT_BF16>;
    case 256: return &attend<256, Q, DOT_BF16>;
    default: return nullptr;
  }
}

template <typename T>
void run(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
         const at::Tensor& block_tables, const std::vector<int64_t>& q_lens, const std::vector<int64_t>& seq_lens,
         const std::vector<int64_t>& q_starts, float scale, const at::Tensor& out) {
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2), G = H / KVH;
  const int64_t P = static_cast<int64_t>(q_lens.size()), MAXB = block_tables.size(1);
  constexpr bool dot_bf16 = HAS_DOT_BF16 && std::is_same_v<T, at::BFloat16>;
  const bool bf16_query = query.scalar_type() == at::kBFloat16;
  const AttendFn fn = dot_bf16 && bf16_query ? pick<at::BFloat16, dot_bf16>(D)
                      : bf16_query           ? pick<at::BFloat16, false>(D)
                                             : pick<float, false>(D);
  TORCH_CHECK(fn != nullptr && H % KVH == 0, "unsupported head_dim ", D, " / heads ", H, " on ", KVH);
  const auto tables = block_tables.contiguous();
  const int32_t* bt = tables.data_ptr<int32_t>();
  const size_t element = query.element_size();
  std::vector<Prompt> prompts(P);
  std::vector<Work> work;
  const int64_t positions_per_item = std::max<int64_t>(1, TILE_ROWS / G);
  for (int64_t i = 0; i < P; ++i) {
    Prompt& p = prompts[i];
    p.query = static_cast<const char*>(query.data_ptr()) + q_starts[i] * query.stride(0) * element;
    p.row_stride = query.stride(0);
    p.head_stride = query.stride(1);
    p.out = static_cast<char*>(out.data_ptr()) + q_starts[i] * H * D * element;
    p.q_len = q_lens[i];
    p.seq_len = seq_lens[i];
    p.padded = (p.seq_len + 2 * W - 1) / (2 * W) * (2 * W);
    p.keys.reset(new float[KVH * D * p.padded]);  // uninitialized: the layout pass writes every element read
    p.values.reset(new float[KVH * D * p.padded]);
    for (int64_t kvh = 0; kvh < KVH; ++kvh)
      for (int64_t pos = 0; pos < p.q_len; pos += positions_per_item)
        work.push_back({i, kvh, pos, std::min(positions_per_item, p.q_len - pos)});
  }
  const T* kc = key_cache.data_ptr<T>();
  const T* vc = value_cache.data_ptr<T>();
  const bool paired = dot_bf16 && bf16_query;
  parallel_chunks(0, P * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int32_t* table = bt + (j / KVH) * MAXB;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (paired) {
          pair_prompt(prompts[j / KVH], kc, vc, table, BS, KVH, D, j % KVH);
          continue;
        }
      }
      widen_prompt<T>(prompts[j / KVH], kc, vc, table, BS, KVH, D, j % KVH);
    }
  });
  // costliest first (the keys an item reads grow with its last position), so the last to finish are cheap
  auto cost = [&](const Work& w) { return prompts[w.prompt].seq_len - prompts[w.prompt].q_len + w.first_pos; };
  std::stable_sort(work.begin(), work.end(), [&](const Work& a, const Work& b) { return cost(a) > cost(b); });
  deal_items(static_cast<int64_t>(work.size()), [] { return Scratch(); },
             [&](int64_t n, Scratch& scratch) { fn(prompts[work[n].prompt], work[n], H, G, scale, scratch); });
}

}  // namespace

// Built for AVX-512 (and measured there); with 256-bit vectors (an AVX2 build of this source on the
// AVX-512 EPYC) a 2048-token prompt took 53 ms against SDPA's 41, so those hosts keep SDPA.
bool prefill_supported(int64_t head_dim) { return W == 16 && pick<float, false>(head_dim) != nullptr; }

// Writes each chunk's attention into `out` at the chunk's own rows; rows of `out` outside every chunk (the
// step's decode rows) are left alone.
void paged_prefill(const at::Tensor& query,         // [N, H, D] float32 or bfloat16: the step's query rows, any
                                                     // row and head strides (a view of a fused QKV output)
                   const at::Tensor& out,           // [N, H, D] contiguous, the query's dtype
                   const at::Tensor& key_cache,     // [NB, BS, KVH, D] float32, float16 or bfloat16
                   const at::Tensor& value_cache,   // same dtype as key_cache
                   const at::Tensor& block_tables,  // [P, MAXB] int32, one row per chunk
                   at::IntArrayRef q_starts,        // [P] each chunk's first row
                   at::IntArrayRef q_lens,          // [P] its rows
                   at::IntArrayRef seq_lens,        // [P] its keys, cached prefix included
                   double scale) {
  TORCH_CHECK(query.dtype() == at::kFloat || query.dtype() == at::kBFloat16, "the query must be float32 or bfloat16");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "the query's head_dim must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.dtype() == query.dtype() && out.is_contiguous(),
              "out must be a contiguous tensor of the query's shape and dtype");
  TORCH_CHECK(key_cache.dtype() == value_cache.dtype(), "key and value caches differ in dtype");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(q_starts.size() == q_lens.size() && q_lens.size() == seq_lens.size() &&
                  static_cast<int64_t>(q_lens.size()) == block_tables.size(0),
              "one start, length, context and table per chunk");
  for (size_t i = 0; i < q_lens.size(); ++i) {
    TORCH_CHECK(q_lens[i] >= 1 && q_lens[i] <= seq_lens[i] && q_starts[i] >= 0 &&
                    q_starts[i] + q_lens[i] <= query.size(0) &&
                    (seq_lens[i] + key_cache.size(1) - 1) / key_cache.size(1) <= block_tables.size(1),
                "chunk ", i, " out of range");
  }
  const std::vector<int64_t> st(q_starts.begin(), q_starts.end()), q(q_lens.begin(), q_lens.end()),
      l(seq_lens.begin(), seq_lens.end());
  const float fscale = static_cast<float>(scale);
  switch (key_cache.scalar_type()) {
    case at::kFloat: run<float>(query, key_cache, value_cache, block_tables, q, l, st, fscale, out); break;
    case at::kHalf: run<at::Half>(query, key_cache, value_cache, block_tables, q, l, st, fscale, out); break;
    case at::kBFloat16: run<at::BFloat16>(query, key_cache, value_cache, block_tables, q, l, st, fscale, out); break;
    default: TORCH_CHECK(false, "unsupported cache dtype ", key_cache.scalar_type());
  }
}

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("paged_prefill(Tensor query, Tensor(a!) out, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "int[] q_starts, int[] q_lens, int[] seq_lens, float scale) -> ()", &paged_prefill);
  m.def("prefill_supported(int head_dim) -> bool", &prefill_supported);
}
