// SIMD vectors shared by kvloom's C++ attention kernels (cpu_decode.cpp, cpu_prefill.cpp): GCC/Clang
// vector extensions one hardware register wide, so the same source builds on any x86-64 or Arm host
// with -march=native, and loads that widen float16/bfloat16 cache rows to float32.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
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
#if defined(__AVX512F__)  // GCC 12 scalarizes the generic widening below (batch 64: 0.99 vs 0.71 ms a layer)
  const __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<const vfloat&>(v);
#elif defined(__AVX2__)
  const __m256i v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return reinterpret_cast<const vfloat&>(v);
#else
  const vuint bits = __builtin_convertvector(*reinterpret_cast<const vbits_unaligned*>(p), vuint) << 16;
  return reinterpret_cast<const vfloat&>(bits);
#endif
}
inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat_unaligned*>(p) = v; }

// one element: float32 math on float32 or bfloat16 storage; bfloat16 is rounded to nearest even, as torch rounds
inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) { return x; }
template <>  // round to nearest even in plain integer ops the compiler vectorizes (c10's has a NaN branch)
inline at::BFloat16 narrow<at::BFloat16>(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  return at::BFloat16(static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16), at::BFloat16::from_bits());
}

}  // namespace
