/* The row-block attention's softmax (block_causal.py), bf16 scores in and probabilities out,
   float32 inside, with the block's causal mask applied as it goes: row r of a block of `rows`
   query rows over `keys` keys sees the first keys - rows + (r % rows) + 1 of them, the others
   get 0. One pass for the maximum, one for the sum of the exponentials, one to compute them
   again, scale and round (to nearest even, as torch rounds: no buffer of a row's length);
   rows split between the OpenMP threads. Built by
   workers/native_build.py, called with ctypes. */

#include <stdint.h>
#include <string.h>

#include "native_math.h"

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
