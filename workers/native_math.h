/* Scalar helpers the workers' C kernels share (included as "native_math.h"; native_build.py
   puts this folder on the include path and hashes the header into each library's name). Plain
   arithmetic, so loops that call them are vectorised. */

#ifndef RAYDIX_NATIVE_MATH_H
#define RAYDIX_NATIVE_MATH_H

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* e^x for x <= 0 (a score less its row's maximum), to about 2e-7 relative: 2^(x log2 e) split
   into an integer part, put into the exponent bits, and a degree-6 polynomial for the
   fraction */
INLINE float exp_nonpos(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504088896341f;
  int32_t i = (int32_t)t; /* toward zero; t <= 0, so one less where that is above t */
  i -= (float)i > t;
  const float f = t - (float)i; /* [0, 1) */
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = (uint32_t)(i + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}

INLINE float from_bf16(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* rounded to nearest even, as torch rounds; NaN stays NaN */
INLINE uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) : u + 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

#endif
