// Math shared by kvloom's C++ CPU kernels (cpu_decode.cpp, cpu_prefill.cpp, cpu_fused.cpp). The build folder's name
// includes a hash of this header (cpu_extensions.py), since torch's loader hashes only the sources.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

// exp(x) for x <= 0: Cephes-style range reduction and a degree-6 polynomial, ~1 ulp, as plain float
// math that the compiler vectorizes inside a loop (std::exp does not).
inline float exp_nonpositive(float x) {
  const float v = std::max(x, -87.0f);
  const float k = std::floor(v * 1.44269504088896341f + 0.5f);
  const float r = v - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
}

// exp in place over n scores (all <= 0 after subtracting the max): a loop the compiler vectorizes (with the
// sum in the same loop it did not: a 256-token prefill spent as long in its softmax as in Q.K)
inline void exp_nonpositive_all(float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = exp_nonpositive(x[i]);
}
