// Linear layers on AVX-512 CPUs without AMX tiles: bfloat16 (AMD Zen 4 with AVX512-BF16 dot products; Intel Xeons
// with AVX-512 and no bfloat16 units) and float32.
//
// oneDNN's packed GEMMs are weak at the row counts decode runs at on these CPUs: measured on the 2-core AMD EPYC
// (Zen 4), SmolLM2's 30 layers at 48 rows ran 290 GFLOP/s in bfloat16 (16 rows 207, 1 row ~13) where the same
// CPU reaches ~440 on large matrices; without bfloat16 units oneDNN emulates bfloat16 outright. Here the weight
// is laid out once in blocks of 32 outputs by 32-bit words of inputs, [ceil(N/32), K/E, 32, E] (E = 2 bfloat16
// or 1 float32; zero rows pad N), which cpu_blocked.h's register kernel and schedule run.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <cstdint>
#include <optional>

#include "cpu_blocked.h"
#include "cpu_deal.h"

namespace {

bool blocked_linear_supported(at::ScalarType dtype) {
#if defined(__AVX512F__)
  return dtype == at::kFloat || dtype == at::kBFloat16;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
// bfloat16 [M, K] -> float32 [M, K] on the kernels' threads (torch's copy would run on its one thread)
at::Tensor widened(const at::Tensor& x) {
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const auto* in = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* bits = reinterpret_cast<uint32_t*>(out.data_ptr());
  parallel_chunks(0, x.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) bits[i] = static_cast<uint32_t>(in[i]) << 16;
  });
  return out;
}
#endif

// x [M, K] and weight [ceil(N/32), K/E, 32, E] of one dtype (E inputs a 32-bit word: 2 bfloat16, 1 float32),
// bias [N] float32 or none -> [M, N] of x's dtype
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& weight, int64_t N,
                          const std::optional<at::Tensor>& bias) {
  const int64_t per_word = x.scalar_type() == at::kBFloat16 ? 2 : 1;
  TORCH_CHECK(blocked_linear_supported(x.scalar_type()), "blocked_linear: no kernel for ", x.scalar_type(),
              " on this CPU (check blocked_linear_supported())");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K]");
  const int64_t M = x.size(0), K = x.size(1), nblocks = weight.size(0);
  TORCH_CHECK(weight.dim() == 4 && weight.size(1) * per_word == K && weight.size(2) == BLOCK_N &&
                  weight.size(3) == per_word && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "weight: [ceil(N/32), K/E, 32, E] of x's dtype, E = 4 bytes / its element size");
  TORCH_CHECK(nblocks == (N + BLOCK_N - 1) / BLOCK_N, "N does not match the weight's blocks");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat),
              "bias: [N] float32");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
#if defined(__AVX512F__)
  const auto* wp = reinterpret_cast<const uint32_t*>(weight.data_ptr());
  if (per_word == 2) {
    const at::Tensor words = BFloat16Pairs::X_WORDS == 1 ? x : widened(x);
    run_blocks<BFloat16Pairs>(reinterpret_cast<const uint32_t*>(words.data_ptr()), M, K / 2, wp, bp,
                              reinterpret_cast<uint16_t*>(y.data_ptr()), N);
  } else {
    run_blocks<Float32>(reinterpret_cast<const uint32_t*>(x.data_ptr()), M, K, wp, bp, y.data_ptr<float>(), N);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvloom, m) {
  m.def("blocked_linear(Tensor x, Tensor weight, int N, Tensor? bias) -> Tensor", &blocked_linear);
  m.def("blocked_linear_supported(ScalarType dtype) -> bool", &blocked_linear_supported);
}
