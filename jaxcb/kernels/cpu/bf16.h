// bfloat16 <-> float, shared by the kernels that read or write a bfloat16 KV cache.

#pragma once

#include <cstdint>
#include <cstring>

namespace jaxcb {

inline float Bf16ToFloat(uint16_t x) {  // a bf16 is the top half of its f32
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16(float f) {  // round to nearest even, as XLA converts
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace jaxcb
