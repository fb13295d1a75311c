// Fused elementwise ops of the CPU decoder (engine/decoder.py): each replaces a chain of torch ops
// that would each stream the whole activation through memory once (rotary embedding as torch ops
// is six of them: two slices, a negation, a concatenation, two multiply-adds) and, at small
// batches, costs more in dispatch than in math. Rows are dealt in chunks to the threads (cpu_deal.h) and the
// inner loops are plain float loops the compiler vectorizes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <optional>
#include <vector>

#include "cpu_deal.h"
#include "cpu_math.h"
#include "cpu_vec.h"

constexpr int64_t GRAIN = 16;  // rows per task

// Rotary embedding in place on the query and key heads of a fused QKV projection [T, (H + 2 KVH) * D]
// (the first H + KVH heads), with HF's rotate-half convention: x * cos + rotate_half(x) * sin,
// cos/sin [T, D] float32 as the model's rotary module returns them; qkv float32 or bfloat16.
template <typename T>
void rotate(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_rotated_heads,
            int64_t head_dim) {
  const int64_t T_ = qkv.size(0), stride = qkv.stride(0), half = head_dim / 2;
  T* base = qkv.data_ptr<T>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  parallel_chunks(0, T_, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict c = cs + t * head_dim;
      const float* __restrict s = sn + t * head_dim;
      for (int64_t h = 0; h < num_rotated_heads; ++h) {
        T* __restrict x = base + t * stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = widen(x[i]), x2 = widen(x[i + half]);
          x[i] = narrow<T>(x1 * c[i] - x2 * s[i]);
          x[i + half] = narrow<T>(x2 * c[i + half] + x1 * s[i + half]);
        }
      }
    }
  });
}

void rotary_embedding_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_rotated_heads,
                       int64_t head_dim) {
  TORCH_CHECK(cos.dtype() == at::kFloat && sin.dtype() == at::kFloat, "cos/sin must be float32");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous());
  switch (qkv.scalar_type()) {
    case at::kFloat: return rotate<float>(qkv, cos, sin, num_rotated_heads, head_dim);
    case at::kBFloat16: return rotate<at::BFloat16>(qkv, cos, sin, num_rotated_heads, head_dim);
    default: TORCH_CHECK(false, "rotary_embedding_: unsupported dtype ", qkv.scalar_type());
  }
}

// The residual stream's step between sublayers: residual += delta (in place; no delta before the
// first layer), then return RMSNorm(residual) * weight in `out_dtype`. One pass for the sum of squares,
// one to scale, where torch adds and normalizes in about eight ops per call (~130 us each even for one
// row). The residual and the norm weight stay float32 under a bfloat16 model: only what feeds the next
// GEMM (the output) and what comes out of one (delta) are bfloat16.
template <typename D, typename O>
void add_norm(float* base, const D* add, const float* __restrict w, O* normed, int64_t T, int64_t H, float eps) {
  parallel_chunks(0, T, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* __restrict x = base + t * H;
      float squares = 0.f;
      if (add != nullptr) {
        const D* __restrict d = add + t * H;
        for (int64_t i = 0; i < H; ++i) {
          x[i] += widen(d[i]);
          squares += x[i] * x[i];
        }
      } else {
        for (int64_t i = 0; i < H; ++i) squares += x[i] * x[i];
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(H) + eps);
      O* __restrict y = normed + t * H;
      for (int64_t i = 0; i < H; ++i) y[i] = narrow<O>(x[i] * inv * w[i]);
    }
  });
}

template <typename O>
void add_norm_to(const at::Tensor& residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                 at::Tensor& out, float eps) {
  const int64_t T = residual.size(0), H = residual.size(1);
  float* base = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  O* normed = out.data_ptr<O>();
  if (!delta.has_value()) return add_norm<float, O>(base, nullptr, w, normed, T, H, eps);
  if (delta->scalar_type() == at::kFloat) return add_norm<float, O>(base, delta->data_ptr<float>(), w, normed, T, H, eps);
  add_norm<at::BFloat16, O>(base, delta->data_ptr<at::BFloat16>(), w, normed, T, H, eps);
}

at::Tensor add_rms_norm_(const at::Tensor& residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                         double eps, at::ScalarType out_dtype) {
  TORCH_CHECK(residual.dtype() == at::kFloat && weight.dtype() == at::kFloat, "residual and weight must be float32");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && weight.is_contiguous());
  TORCH_CHECK(weight.numel() == residual.size(1), "weight has ", weight.numel(), " elements for rows of ",
              residual.size(1));
  if (delta.has_value())
    TORCH_CHECK((delta->dtype() == at::kFloat || delta->dtype() == at::kBFloat16) && delta->is_contiguous() &&
                delta->sizes() == residual.sizes(), "delta must be float32 or bfloat16 rows like the residual");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "unsupported output dtype ", out_dtype);
  auto out = at::empty(residual.sizes(), residual.options().dtype(out_dtype));
  const float feps = static_cast<float>(eps);
  if (out_dtype == at::kFloat)
    add_norm_to<float>(residual, delta, weight, out, feps);
  else
    add_norm_to<at::BFloat16>(residual, delta, weight, out, feps);
  return out;
}

// SiLU(gate) * up over the gate | up halves of each row of [T, 2I], into [T, I]: one pass, where torch
// runs SiLU and the multiply as two (and its bfloat16 SiLU widens, computes and narrows element by
// element: 3 ns an element here, most of a prefill step's elementwise time).
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  parallel_chunks(0, rows, std::max<int64_t>(1, 16384 / inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* __restrict g = gate_up + t * 2 * inter;
      const T* __restrict u = g + inter;
      T* __restrict y = out + t * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float x = widen(g[i]);
        const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|): no overflow either side
        const float sigmoid = x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
        y[i] = narrow<T>(x * sigmoid * widen(u[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul takes contiguous [T, 2I] rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_mul<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, inter); break;
    case at::kBFloat16:
      silu_mul<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, inter);
      break;
    default: TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", gate_up.scalar_type());
  }
  return out;
}

// Greedy sampling's pick, each row's first maximum: torch's max over a row of bfloat16 logits runs ~1.3
// elements a nanosecond here (1.9 ms for 48 rows of SmolLM2's 49,152, a thirtieth of a decode step). One
// vectorized pass keeps each 256-element chunk's maximum, a second finds the first chunk holding the row's,
// and only that chunk is searched element by element. NaNs are skipped (a NaN row's pick is meaningless).
constexpr int64_t ARGMAX_CHUNK = 256;

template <typename T>
void argmax_rows(const T* logits, int64_t stride, int64_t rows, int64_t vocab, int64_t* out) {
  parallel_chunks(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> chunk_max((vocab + ARGMAX_CHUNK - 1) / ARGMAX_CHUNK);
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict x = logits + r * stride;
      float best = -INFINITY;
      for (size_t c = 0; c < chunk_max.size(); ++c) {
        const int64_t first = c * ARGMAX_CHUNK, n = std::min(ARGMAX_CHUNK, vocab - first);
        float m = -INFINITY;
        if (n == ARGMAX_CHUNK) {  // GCC leaves a scalar max reduction scalar: W lanes by hand
          vfloat lanes = vfloat{} - INFINITY;
          for (int64_t i = 0; i < ARGMAX_CHUNK; i += W) {
            const vfloat v = load(x + first + i);
            lanes = v > lanes ? v : lanes;  // a NaN compares false: skipped
          }
          for (int l = 0; l < W; ++l) m = std::max(m, lanes[l]);
        } else {
          for (int64_t i = 0; i < n; ++i) m = std::max(m, widen(x[first + i]));
        }
        chunk_max[c] = m;
        best = std::max(best, m);
      }
      const int64_t c = std::find(chunk_max.begin(), chunk_max.end(), best) - chunk_max.begin();
      int64_t i = c * ARGMAX_CHUNK;
      while (i < vocab && widen(x[i]) != best) ++i;
      out[r] = i < vocab ? i : 0;  // every logit NaN
    }
  });
}

at::Tensor argmax_rows_op(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0, "argmax_rows takes [R, V] rows");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  switch (logits.scalar_type()) {
    case at::kFloat:
      argmax_rows(logits.data_ptr<float>(), logits.stride(0), logits.size(0), logits.size(1), out.data_ptr<int64_t>());
      break;
    case at::kBFloat16:
      argmax_rows(logits.data_ptr<at::BFloat16>(), logits.stride(0), logits.size(0), logits.size(1),
                  out.data_ptr<int64_t>());
      break;
    default: TORCH_CHECK(false, "argmax_rows: unsupported dtype ", logits.scalar_type());
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor", &argmax_rows_op);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps, ScalarType out_dtype) -> Tensor",
        &add_rms_norm_);
  m.def("rotary_embedding_(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_rotated_heads, int head_dim) -> ()",
        &rotary_embedding_);
}
