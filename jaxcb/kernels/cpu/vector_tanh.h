// tanh(x) on 1, 8 (AVX2) or 16 (AVX-512) float lanes: attention's logit soft-cap (Gemma 2),
// c * tanh(score / c), in the CPU attention kernel's every path.
//
// Eigen's rational approximation (generic_fast_tanh_float): an odd degree-13 polynomial over an
// even degree-6 one, on x clamped to +-7.905 (where tanh is 1 in float32 to within 3e-7). Within
// 3e-7 of tanh, relative, over every float32 (measured against long double): no exp, and no
// cancellation near 0 as 1 - 2 / (exp(2x) + 1) would have. The three widths are the same
// arithmetic, FMA for FMA, so that a score gets the same cap whichever path scores it.

#pragma once

#include <algorithm>
#include <cmath>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace jaxcb {
namespace tanh_coefficients {
constexpr float kClamp = 7.90531110763549805f;
constexpr float kAlpha1 = 4.89352455891786e-03f, kAlpha3 = 6.37261928875436e-04f, kAlpha5 = 1.48572235717979e-05f,
                kAlpha7 = 5.12229709037114e-08f, kAlpha9 = -8.60467152213735e-11f,
                kAlpha11 = 2.00018790482477e-13f, kAlpha13 = -2.76076847742355e-16f;
constexpr float kBeta0 = 4.89352518554385e-03f, kBeta2 = 2.26843463243900e-03f, kBeta4 = 1.18534705686654e-04f,
                kBeta6 = 1.19825839466702e-06f;
}  // namespace tanh_coefficients

inline float Tanh(float x) {
  using namespace tanh_coefficients;
  x = std::max(std::min(x, kClamp), -kClamp);  // NaN stays NaN (std::min/max return their first argument)
  const float x2 = x * x;
  float p = std::fma(x2, kAlpha13, kAlpha11);
  p = std::fma(x2, p, kAlpha9);
  p = std::fma(x2, p, kAlpha7);
  p = std::fma(x2, p, kAlpha5);
  p = std::fma(x2, p, kAlpha3);
  p = std::fma(x2, p, kAlpha1);
  float q = std::fma(x2, kBeta6, kBeta4);
  q = std::fma(x2, q, kBeta2);
  q = std::fma(x2, q, kBeta0);
  return x * p / q;
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 Tanh8(__m256 x) {
  using namespace tanh_coefficients;
  // The constant first: min/max return their second operand where either is NaN, and NaN stays NaN.
  x = _mm256_max_ps(_mm256_set1_ps(-kClamp), _mm256_min_ps(_mm256_set1_ps(kClamp), x));
  const __m256 x2 = _mm256_mul_ps(x, x);
  __m256 p = _mm256_fmadd_ps(x2, _mm256_set1_ps(kAlpha13), _mm256_set1_ps(kAlpha11));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(kAlpha9));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(kAlpha7));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(kAlpha5));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(kAlpha3));
  p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(kAlpha1));
  __m256 q = _mm256_fmadd_ps(x2, _mm256_set1_ps(kBeta6), _mm256_set1_ps(kBeta4));
  q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(kBeta2));
  q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(kBeta0));
  return _mm256_div_ps(_mm256_mul_ps(x, p), q);
}
#endif

#if defined(__AVX512F__)
inline __m512 Tanh16(__m512 x) {
  using namespace tanh_coefficients;
  // The constant first: min/max return their second operand where either is NaN, and NaN stays NaN.
  x = _mm512_max_ps(_mm512_set1_ps(-kClamp), _mm512_min_ps(_mm512_set1_ps(kClamp), x));
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_fmadd_ps(x2, _mm512_set1_ps(kAlpha13), _mm512_set1_ps(kAlpha11));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(kAlpha9));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(kAlpha7));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(kAlpha5));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(kAlpha3));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(kAlpha1));
  __m512 q = _mm512_fmadd_ps(x2, _mm512_set1_ps(kBeta6), _mm512_set1_ps(kBeta4));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(kBeta2));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(kBeta0));
  return _mm512_div_ps(_mm512_mul_ps(x, p), q);
}
#endif

}  // namespace jaxcb
