/* Scalar helpers the workers' C kernels share (included as "native_math.h"; native_build.py
   puts this folder on the include path and hashes the header into each library's name). Plain
   arithmetic, so loops that call them are vectorised. */

#ifndef RAYDIX_NATIVE_MATH_H
#define RAYDIX_NATIVE_MATH_H

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* 2^f for f in [0, 1): a degree-6 polynomial (minimax for the relative error: 1.9e-9 in exact
   arithmetic, about 1e-7 in float32's), highest power first */
#define EXP2_C6 2.170225481e-4f
#define EXP2_C5 1.243968802e-3f
#define EXP2_C4 9.678840976e-3f
#define EXP2_C3 5.548334199e-2f
#define EXP2_C2 2.402298363e-1f
#define EXP2_C1 6.931469838e-1f
#define EXP2_C0 1.0f

/* e^x for x <= 0 (a score less its row's maximum), to about 1e-7 relative: 2^(x log2 e) split
   into an integer part, put into the exponent bits, and the polynomial for the fraction */
INLINE float exp_nonpos(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504088896341f;
  int32_t i = (int32_t)t; /* toward zero; t <= 0, so one less where that is above t */
  i -= (float)i > t;
  const float f = t - (float)i; /* [0, 1) */
  float p = EXP2_C6;
  p = p * f + EXP2_C5;
  p = p * f + EXP2_C4;
  p = p * f + EXP2_C3;
  p = p * f + EXP2_C2;
  p = p * f + EXP2_C1;
  p = p * f + EXP2_C0;
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
