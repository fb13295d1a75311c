// Fused elementwise ops of the CPU decoder (engine/decoder.py): each replaces a chain of torch ops
// that would each stream the whole activation through memory once (rotary embedding as torch ops
// is six of them: two slices, a negation, a concatenation, two multiply-adds) and, at small
// batches, costs more in dispatch than in math. Rows are split over ATen's thread pool and the
// inner loops are plain float loops the compiler vectorizes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <optional>

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

// The residual stream's step between sublayers: residual += delta (in place; no delta before the
// first layer), then return RMSNorm(residual) * weight. One pass for the sum of squares, one to
// scale, where torch adds and normalizes in about eight ops per call (~130 us each even for one row).
at::Tensor add_rms_norm_(const at::Tensor& residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                         double eps) {
  TORCH_CHECK(residual.dtype() == at::kFloat && weight.dtype() == at::kFloat);
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && weight.is_contiguous());
  const int64_t T = residual.size(0), H = residual.size(1);
  TORCH_CHECK(weight.numel() == H, "weight has ", weight.numel(), " elements for rows of ", H);
  if (delta.has_value())
    TORCH_CHECK(delta->dtype() == at::kFloat && delta->is_contiguous() && delta->sizes() == residual.sizes());
  auto out = at::empty_like(residual);
  float* base = residual.data_ptr<float>();
  const float* add = delta.has_value() ? delta->data_ptr<float>() : nullptr;
  const float* __restrict w = weight.data_ptr<float>();
  float* normed = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* __restrict x = base + t * H;
      float squares = 0.f;
      if (add != nullptr) {
        const float* __restrict d = add + t * H;
        for (int64_t i = 0; i < H; ++i) {
          x[i] += d[i];
          squares += x[i] * x[i];
        }
      } else {
        for (int64_t i = 0; i < H; ++i) squares += x[i] * x[i];
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(H) + feps);
      float* __restrict y = normed + t * H;
      for (int64_t i = 0; i < H; ++i) y[i] = x[i] * inv * w[i];
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps) -> Tensor", &add_rms_norm_);
  m.def("rotary_embedding_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_rotated_heads, int head_dim) -> ()",
        &rotary_embedding_);
}
