/* The fused-op seam's elementwise steps for bf16 on the CPU (native_ops.py): RMSNorm with and
   without the residual add, SiLU times up, and rotary embedding, each one pass over its rows
   on the OpenMP threads, float32 inside and rounded to bf16 where torch's code rounds (to
   nearest even), so the results are torch's but for the order of the sum of squares. Built by
   workers/native_build.py, called with ctypes. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_math.h"

/* e^x for any x (clamped to [-87, 88]): exp_nonpos's polynomial with the floor for both signs */
INLINE float exp_any(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
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

/* one row: out = rmsnorm(x) as FusedOps.rmsnorm computes it */
INLINE void norm_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t h, float eps,
                     int gemma) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < h; d++) {
    const float v = from_bf16(x[d]);
    ss += v * v;
  }
  const float r = 1.f / sqrtf(ss / (float)h + eps);
  if (gemma) /* the scale in float32, then one cast */
    for (int64_t d = 0; d < h; d++) out[d] = to_bf16(from_bf16(x[d]) * r * (1.f + from_bf16(w[d])));
  else /* cast back, then scale in bf16 */
    for (int64_t d = 0; d < h; d++)
      out[d] = to_bf16(from_bf16(w[d]) * from_bf16(to_bf16(from_bf16(x[d]) * r)));
}

/* x, out [rows, h] */
void rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows, int64_t h,
                  float eps, int gemma, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; r++) norm_row(x + r * h, w, out + r * h, h, eps, gemma);
}

/* residual = x + residual (bf16), x = rmsnorm(residual): both in place, [rows, h] */
void add_rmsnorm_bf16(uint16_t *x, uint16_t *residual, const uint16_t *w, int64_t rows,
                      int64_t h, float eps, int gemma, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; r++) {
    uint16_t *xr = x + r * h, *rr = residual + r * h;
    for (int64_t d = 0; d < h; d++) rr[d] = to_bf16(from_bf16(xr[d]) + from_bf16(rr[d]));
    norm_row(rr, w, xr, h, eps, gemma);
  }
}

/* x [rows, 2 * inter] = [gate | up]; out [rows, inter] = bf16(bf16(silu(gate)) * up) */
void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t inter,
                       int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t r = 0; r < rows; r++) {
    const uint16_t *gate = x + r * 2 * inter, *up = gate + inter;
    uint16_t *o = out + r * inter;
#pragma omp simd
    for (int64_t d = 0; d < inter; d++) {
      const float g = from_bf16(gate[d]);
      const float s = from_bf16(to_bf16(g / (1.f + exp_any(-g))));
      o[d] = to_bf16(s * from_bf16(up[d]));
    }
  }
}

/* rotate-half rotary embedding, in place, over the first `rot` dims of each head of q
   [tokens, hq, dim] and k [tokens, hk, dim] (rows `q_stride` / `k_stride` elements apart, heads
   contiguous in a row); cos_sin [positions, rot] float32, each row [cos | sin] */
void rope_bf16(uint16_t *q, int64_t q_stride, int64_t hq, uint16_t *k, int64_t k_stride,
               int64_t hk, int64_t tokens, int64_t dim, int64_t rot, const int64_t *positions,
               const float *cos_sin, int threads) {
  const int64_t half = rot / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tokens; t++) {
    const float *cs = cos_sin + positions[t] * rot;
    for (int64_t h = 0; h < hq + hk; h++) {
      uint16_t *x = h < hq ? q + t * q_stride + h * dim : k + t * k_stride + (h - hq) * dim;
      for (int64_t d = 0; d < half; d++) {
        const float x1 = from_bf16(x[d]), x2 = from_bf16(x[d + half]);
        const float c = cs[d], s = cs[half + d];
        x[d] = to_bf16(x1 * c - x2 * s);
        x[d + half] = to_bf16(x2 * c + x1 * s);
      }
    }
  }
}
