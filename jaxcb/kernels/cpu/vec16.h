// 16 floats as one value, written with GCC's vector extensions: one AVX-512 register, or two AVX2
// ones, from one source. Shared by the multi-LoRA code (batched_lora.cc, and the MLP's LoRA in
// packed_matmul.cc), whose weights are float32 or bf16 (the MLP's B blocks: rank rows in pairs).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxcb::vec16 {

typedef float F16 __attribute__((vector_size(64)));  // 16 floats
typedef uint16_t H16 __attribute__((vector_size(32)));  // 16 bf16
typedef uint32_t W16 __attribute__((vector_size(64)));

inline F16 Load(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline F16 Load(const uint16_t* p) {  // bf16 -> float: the bf16 is the float's top half
#if defined(__AVX512F__)
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<F16>(_mm512_castsi512_ps(w));
#else
  H16 h;
  std::memcpy(&h, p, sizeof(h));
  const W16 w = __builtin_convertvector(h, W16) << 16;
  F16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#endif
}

inline void Store(float* p, F16 v) { std::memcpy(p, &v, sizeof(v)); }

// 16 columns of a pair of bf16 rows stored interleaved (row 2j's element, then row 2j + 1's: the
// layout of packed_matmul.py's `pair_rows`, 32 bf16 from p) as two rows of floats.
inline void LoadPair(const uint16_t* p, F16& even, F16& odd) {
#if defined(__AVX512F__)
  const __m512i v = _mm512_loadu_si512(p);
  even = reinterpret_cast<F16>(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  odd = reinterpret_cast<F16>(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))));
#else
  W16 w;
  std::memcpy(&w, p, sizeof(w));
  const W16 e = w << 16, o = w & 0xffff0000u;
  std::memcpy(&even, &e, sizeof(even));
  std::memcpy(&odd, &o, sizeof(odd));
#endif
}

}  // namespace jaxcb::vec16
