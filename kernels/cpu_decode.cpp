// Paged decode attention for CPU: one query token per request, read straight from the block
// cache (no gather copy, no padding, no mask). Work is split over (request, kv head) with
// ATen's thread pool; the query heads sharing a kv head (GQA) reuse each K/V row while it is hot.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

torch::Tensor paged_decode(torch::Tensor query,        // [B, H, D] float32, contiguous
                           torch::Tensor key_cache,    // [NB, BS, KVH, D] float32
                           torch::Tensor value_cache,  // [NB, BS, KVH, D] float32
                           torch::Tensor block_tables, // [B, MAXB] int32
                           torch::Tensor seq_lens,     // [B] int32
                           double scale) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && key_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous());
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = key_cache.size(1), KVH = key_cache.size(2), G = H / KVH;
  const int64_t MAXB = block_tables.size(1);
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* bt = tables.data_ptr<int32_t>();
  const int32_t* sl = lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kvh = item % KVH;
      const int64_t L = sl[b];
      scores.resize(G * L);
      const float* qb = q + (b * H + kvh * G) * D;
      // pass 1: scores for every cached position, block by block
      for (int64_t t = 0; t < L; ++t) {
        const int64_t block = bt[b * MAXB + t / BS];
        const float* k = kc + ((block * BS + t % BS) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          scores[g * L + t] = dot * fscale;
        }
      }
      // softmax per query head
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        float mx = -INFINITY;
        for (int64_t t = 0; t < L; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      // pass 2: weighted sum of values
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t block = bt[b * MAXB + t / BS];
        const float* v = vc + ((block * BS + t % BS) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, o + (b * H + kvh * G + g) * D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, float32)");
}
