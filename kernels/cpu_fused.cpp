// Fused elementwise ops of the CPU decoder (engine/decoder.py): each replaces a chain of torch ops
// that would each stream the whole activation through memory once (rotary embedding as torch ops
// is six of them: two slices, a negation, a concatenation, two multiply-adds). Rows are split over
// ATen's thread pool and the inner loops are plain float loops the compiler vectorizes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <cstdint>

constexpr int64_t GRAIN = 16;  // rows per task

// Rotary embedding in place on the query and key heads of a fused QKV projection [T, (H + 2 KVH) * D]
// (the first H + KVH heads), with HF's rotate-half convention: x * cos + rotate_half(x) * sin,
// cos/sin [T, D] as the model's rotary module returns them.
void rotary_embedding_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_rotated_heads,
                       int64_t head_dim) {
  TORCH_CHECK(qkv.dtype() == at::kFloat && cos.dtype() == at::kFloat && sin.dtype() == at::kFloat);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous());
  const int64_t T = qkv.size(0), stride = qkv.stride(0), half = head_dim / 2;
  float* base = qkv.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  at::parallel_for(0, T, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict c = cs + t * head_dim;
      const float* __restrict s = sn + t * head_dim;
      for (int64_t h = 0; h < num_rotated_heads; ++h) {
        float* __restrict x = base + t * stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s[i];
          x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("rotary_embedding_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_rotated_heads, int head_dim) -> ()",
        &rotary_embedding_);
}
