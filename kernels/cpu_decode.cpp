// Paged decode attention for CPU: one query token per request, read straight from the block
// cache (no gather copy, no padding, no mask). A work item is one request (or one of its kv heads
// when requests are too few to feed every thread); ATen's threads take items from a shared counter,
// longest first. An item walks its request's blocks once with an online softmax. Per block and kv
// head, each query head sharing it (GQA) scores the block's keys, 8 per reduction tree, and folds
// in its values while both are still in L1; the next block (scattered, so the hardware prefetcher
// cannot guess it) is prefetched into L2 a slice per query head, spread over the block's work: one
// burst of a whole block's prefetches fills the core's miss buffers and stalls it, and prefetches
// into L1 held those buffers until the lines arrived (into L2: the 30 layers of a batch-48 decode
// step at context ~269 took 28 ms instead of 37 in float32 on one thread, from DRAM). At batch 64,
// context 256 a step reads ~750 MB of fp32 K/V, every row exactly once.
//
// Vectors are GCC/Clang vector extensions one hardware register wide (16 floats on AVX-512, 8 on
// AVX2, 4 elsewhere), so the same source builds on any x86-64 or Arm host with -march=native. The
// cache may hold float32, float16 or bfloat16 (half the bytes to stream); the math is float32 (a bfloat16
// model's products on AVX512-BF16: see DOT_BF16). Head dims 16, 32, 64, 128 and 256 are compile-time (the
// query row lives in registers); the GQA group is a runtime loop (of up to 4 heads in lockstep on the
// bfloat16 path), which keeps the build to seconds of compile on a fresh machine, not minutes.
// paged_decode_supported() tells the caller when to use its torch fallback instead.
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
#if defined(__AVX__)
inline __m256 sum_rows8(const vfloat* dots) {
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
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

inline void sum_rows8(const vfloat* dots, float* out) { _mm256_storeu_ps(out, sum_rows8(dots)); }
#else
inline void sum_rows8(const vfloat* dots, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = horizontal_sum(dots[i]);
}
#endif

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

// A block whose max beats the head's running max: what it summed so far (its denominator and the NV output
// accumulators the caller holds in registers, V one register wide) shrinks by exp(old max - new max).
template <typename V, int NV>
inline void raise_max(HeadState<NV * W>& st, float block_max, V* acc) {
  if (block_max <= st.running_max) return;
  const float correction = exp_nonpositive(st.running_max - block_max);
  st.denominator *= correction;
  for (int j = 0; j < NV; ++j) acc[j] *= correction;
  st.running_max = block_max;
}

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
// P.V likewise: V's rows of one block and kv head are laid out once as bfloat16 pairs of keys (t, t+1),
// so that VDPBF16PS folds two keys' values into 16 outputs an instruction (the widening loop took three
// instructions and an FMA per 16 elements and key, for each query head of the group), with the
// probabilities rounded to bfloat16 pairs as in the prefill kernel. A sub-block's 16 scores stay in one
// register from Q.K to P.V: written to memory in pieces and read back whole, every pass over them
// stalled on store forwarding (measured: a third of the kernel's time).
#if defined(__AVX512BF16__)
template <typename T, int NV>
constexpr bool DOT_BF16 = std::is_same_v<T, at::BFloat16> && W == 16 && NV % 2 == 0;
constexpr int64_t SUB_BLOCK = W;  // keys a register of scores holds

// exp(x) of 16 lanes, x <= 0: cpu_math.h's exp_nonpositive, which the compiler vectorizes over the 16 (a store
// and a load of the same width, which forward)
inline __m512 exp_nonpositive16(__m512 x) {
  alignas(64) float lanes[SUB_BLOCK];
  _mm512_store_ps(lanes, x);
  exp_nonpositive_all(lanes, SUB_BLOCK);
  return _mm512_load_ps(lanes);
}

// scores of one query head against n <= SUB_BLOCK keys, scaled, in one register (lanes past n: anything)
template <int NV>
inline __m512 sub_block_scores(const __m512bh* q, const at::BFloat16* keys, int64_t row, int64_t n, float scale) {
  __m256 halves[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int h = 0; h * 8 < n; ++h) {
    vfloat dots[8];
    for (int i = 0; i < 8; ++i) {
      const int64_t t = h * 8 + i;
      if (t < n) {
        const at::BFloat16* k = keys + t * row;
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
        for (int c = 1; c < NV / 2; ++c) dot = _mm512_dpbf16_ps(dot, q[c], (__m512bh)_mm512_loadu_si512(k + c * 2 * W));
        dots[i] = reinterpret_cast<const vfloat&>(dot);
      } else {
        dots[i] = vfloat{};
      }
    }
    halves[h] = sum_rows8(dots);
  }
  return _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(halves[0]), halves[1], 1), _mm512_set1_ps(scale));
}

// V rows of n keys -> pairs of keys: vector 2c of a pair holds elements c*2W + {0-3, 8-11, 16-19, 24-27} of both
// keys and vector 2c+1 the others (the 16-bit unpacks work within 128-bit lanes); a missing odd last key reads
// as zero, not as the slot past the block's end (which may hold anything)
template <int NV>
inline void pair_values(const at::BFloat16* values, int64_t row, int64_t n, uint32_t* pairs) {
  for (int64_t t = 0; t < n; t += 2) {
    for (int c = 0; c < NV / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(values + t * row + c * 2 * W);
      const __m512i b = t + 1 < n ? _mm512_loadu_si512(values + (t + 1) * row + c * 2 * W) : _mm512_setzero_si512();
      _mm512_storeu_si512(pairs + (t / 2 * NV + 2 * c) * W, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(pairs + (t / 2 * NV + 2 * c + 1) * W, _mm512_unpackhi_epi16(a, b));
    }
  }
}

// Folds n <= SUB_BLOCK scores of each of GB query heads into its running softmax, then P.V over those keys'
// value pairs. The heads go in lockstep, each step's GB chains independent of one another: one head at a time
// waited on each step's latency in turn (a sub-block's reductions, exp and the accumulators' VDPBF16PS chain
// are one long chain per head), and the value pairs are loaded once for all of them.
template <int NV, int GB>
inline void sub_block_update(HeadState<NV * W>* st, const __m512* scores, int64_t n, const uint32_t* pairs) {
  const __mmask16 live = n >= SUB_BLOCK ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  __m512i rounded[GB];  // head g's probabilities as bfloat16 pairs, pair k in 32-bit lane k
  __m512 acc[GB][NV];
  for (int g = 0; g < GB; ++g) {
    const __m512 s = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), scores[g]);
    const float block_max = std::max(st[g].running_max, _mm512_reduce_max_ps(s));
    const __m512 p = _mm512_maskz_mov_ps(live, exp_nonpositive16(_mm512_sub_ps(s, _mm512_set1_ps(block_max))));
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_loadu_ps(st[g].acc + j * W);
    raise_max<__m512, NV>(st[g], block_max, acc[g]);
    st[g].denominator += _mm512_reduce_add_ps(p);
    rounded[g] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(p));
  }
  for (int64_t k = 0; k < (n + 1) / 2; ++k) {
    const __m512i lane = _mm512_set1_epi32(static_cast<int>(k));
    __m512bh v[NV];
    for (int j = 0; j < NV; ++j) v[j] = (__m512bh)_mm512_loadu_si512(pairs + (k * NV + j) * W);
    for (int g = 0; g < GB; ++g) {
      const __m512bh pk = (__m512bh)_mm512_permutexvar_epi32(lane, rounded[g]);
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], pk, v[j]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(st[g].acc + j * W, acc[g][j]);
}

// GB query heads (consecutive, sharing one kv head) over one block of a bfloat16 cache: SUB_BLOCK keys at a time.
// `fetch()` prefetches a slice of the next block, once after each head's scores (see decode_item).
template <int NV, int GB, typename Fetch>
inline void heads_block_bf16(HeadState<NV * W>* st, const at::BFloat16* query, int64_t head_stride,
                             const at::BFloat16* keys, int64_t row, int64_t n, float scale, const uint32_t* value_pairs,
                             const Fetch& fetch) {
  __m512bh q[GB][NV / 2];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV / 2; ++c) q[g][c] = (__m512bh)_mm512_loadu_si512(query + g * head_stride + c * 2 * W);
  for (int64_t t = 0; t < n; t += SUB_BLOCK) {
    const int64_t m = std::min(SUB_BLOCK, n - t);
    __m512 scores[GB];
    for (int g = 0; g < GB; ++g) {
      scores[g] = sub_block_scores<NV>(q[g], keys + t * row, row, m, scale);
      fetch();
    }
    sub_block_update<NV, GB>(st, scores, m, value_pairs + t / 2 * NV * W);
  }
}

constexpr int MAX_LOCKSTEP = 4;  // heads at a time: 4 x NV accumulators, NV value vectors and 4 roundings in registers

// The G query heads of one kv head over one block, up to MAX_LOCKSTEP of them at a time.
template <int NV, typename Fetch>
inline void group_block_bf16(HeadState<NV * W>* st, int G, const at::BFloat16* query, int64_t head_stride,
                             const at::BFloat16* keys, int64_t row, int64_t n, float scale, const uint32_t* value_pairs,
                             const Fetch& fetch) {
  for (int g = 0; g < G; g += MAX_LOCKSTEP) {
    const at::BFloat16* q = query + g * head_stride;
    switch (std::min(G - g, MAX_LOCKSTEP)) {
      case 1: heads_block_bf16<NV, 1>(st + g, q, head_stride, keys, row, n, scale, value_pairs, fetch); break;
      case 2: heads_block_bf16<NV, 2>(st + g, q, head_stride, keys, row, n, scale, value_pairs, fetch); break;
      case 3: heads_block_bf16<NV, 3>(st + g, q, head_stride, keys, row, n, scale, value_pairs, fetch); break;
      default: heads_block_bf16<NV, 4>(st + g, q, head_stride, keys, row, n, scale, value_pairs, fetch); break;
    }
  }
}
#else
template <typename T, int NV>
constexpr bool DOT_BF16 = false;

template <int NV>
inline void pair_values(const at::BFloat16*, int64_t, int64_t, uint32_t*) {}
template <int NV, typename Fetch>
inline void group_block_bf16(HeadState<NV * W>*, int, const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t,
                             float, const uint32_t*, const Fetch&) {}
#endif

// position, in an output accumulated over value pairs (see pair_values), of natural element d
inline int64_t pair_output_index(int64_t d) {
  const int64_t r = d % (2 * W);
  return (d / (2 * W) * 2 + r % 8 / 4) * W + r / 8 * 4 + r % 4;
}

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
  raise_max<vfloat, NV>(st, block_max, acc);
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
  float* room = scores + BS + 8;  // paired queries, or one block's value pairs (dot_bf16)
  const bool dot_bf16 = DOT_BF16<T, NV> && item.query == nullptr;
  auto* value_pairs = reinterpret_cast<uint32_t*>(room);
  const float* queries = item.query;  // [KVH * G, D], paired like the rows where they are
  int64_t head_stride = item.query_head_stride;
  if (PAIRED<T, NV> && !dot_bf16) {
    float* paired = room;
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
  // the next block (contiguous BS rows of K, then of V) is fetched into L2 a slice per query head processed
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
    auto prefetch = [&] {  // the next block's slice for the query head just processed
      if (next_keys == nullptr) return;
      const int64_t stop = std::min(prefetched + slice, block_elems);
      for (; prefetched < stop; prefetched += LINE) {
        __builtin_prefetch(next_keys + prefetched, 0, 2);
        __builtin_prefetch(next_values + prefetched, 0, 2);
      }
    };
    for (int64_t kvh = item.first_head; kvh < item.last_head; ++kvh) {
      const T* keys = cache.keys + base + kvh * D;
      const T* values = cache.values + base + kvh * D;
      if (dot_bf16) {  // the group's heads together
        pair_values<NV>(reinterpret_cast<const at::BFloat16*>(values), cache.row, n, value_pairs);
        group_block_bf16<NV>(states + (kvh * G - first), G, item.query_bf16 + kvh * G * head_stride, head_stride,
                             reinterpret_cast<const at::BFloat16*>(keys), cache.row, n, scale, value_pairs, prefetch);
        continue;
      }
      for (int g = 0; g < G; ++g) {
        const int64_t head = kvh * G + g;
        vfloat q[NV];
        for (int j = 0; j < NV; ++j) q[j] = load(queries + head * head_stride + j * W) * scale;
        block_scores<T, NV>(q, keys, cache.row, n, scores);
        block_update<T, NV>(states[head - first], scores, values, cache.row, n);
        prefetch();
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.f / states[h].denominator;
    float* acc = states[h].acc;
    if (PAIRED<T, NV> || dot_bf16) {  // back to natural order, through the room (done with)
      float* natural = room;
      for (int64_t d = 0; d < D; ++d) natural[d] = acc[dot_bf16 ? pair_output_index(d) : paired_index(d)];
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
  // per thread: the heads' softmax states, one block's scores, and room for the paired queries (all H of
  // them, indexed by head) or, on the bfloat16 path, one block's value pairs
  const size_t scratch_floats = heads_per_item * G * sizeof(HeadState<256>) / sizeof(float) + BS + 8 +
                                std::max(H * D, (BS + 1) / 2 * D);
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
