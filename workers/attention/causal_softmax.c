/* The row-block attention's softmax (block_causal.py), bf16 scores in and probabilities out,
   float32 inside, with the block's causal mask applied as it goes: row r of a block of `rows`
   query rows over `keys` keys sees the first keys - rows + (r % rows) + 1 of them, the others
   get 0. One pass for the maximum, one for the sum of the exponentials, one to compute them
   again, scale and round (to nearest even, as torch rounds: no buffer of a row's length);
   rows split between the OpenMP threads. Built by
   workers/native_build.py, called with ctypes. */

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* e^x for x <= 0, to about 2e-7 relative (as in paged_decode.c) */
INLINE float exp_nonpos(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504088896341f;
  int32_t i = (int32_t)t;
  i -= (float)i > t;
  const float f = t - (float)i;
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

INLINE uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) : u + 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* scores and probs: [num_rows, keys] bf16 (may be the same buffer); num_rows a multiple of
   rows (the block's rows, repeated per head) */
void causal_softmax_bf16(const uint16_t *scores, uint16_t *probs, int64_t num_rows,
                         int64_t keys, int64_t rows, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < num_rows; r++) {
    const uint16_t *in = scores + r * keys;
    uint16_t *out = probs + r * keys;
    const int64_t seen = keys - rows + r % rows + 1;
    float top = -3.0e38f;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < seen; j++) {
      const float s = from_bf16(in[j]);
      top = s > top ? s : top;
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < seen; j++) sum += exp_nonpos(from_bf16(in[j]) - top);
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < seen; j++) out[j] = to_bf16(exp_nonpos(from_bf16(in[j]) - top) * inv);
    for (int64_t j = seen; j < keys; j++) out[j] = 0;
  }
}
