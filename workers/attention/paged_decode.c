/* Decode attention on the KV pool's pages (CPU): one query token per request attends to the
   keys and values at its slots, read in place from `[num_slots, num_kv_heads, HEAD_DIM]`
   buffers. Built by workers/native_build.py for one model's head sizes (HEAD_DIM, GROUP: the
   query heads per KV head), loaded with ctypes (workers/attention/paged_decode.py).

   Per (request, KV head), on OpenMP threads: the GROUP queries are scaled and kept in float32;
   keys are taken BLOCK at a time: scores, then an online softmax (running maximum and sum, the
   accumulator rescaled when the maximum grows), then the values weighted into the accumulator.
   Each key and value row is read from its page once; float32 inside, bf16 or float32 in and
   out (bf16 rounded to nearest even, as torch rounds). A request's slots are scattered over the
   pool once the cache has freed and reused them, so the rows of the next block of keys and of
   this block's values are prefetched while the scores are computed (30 layers' pools, cold
   caches, slots at random: 16 requests of 420 keys 815 against 1,062 us a layer; slots in
   runs: no change). */

#include <stdint.h>
#include <string.h>

#include "native_math.h"

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "HEAD_DIM and GROUP must be defined"
#endif

#define BLOCK 32
INLINE void prefetch_row(const void *base, int64_t offset, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    __builtin_prefetch((const char *)base + offset + line, 0, 3);
}

INLINE void load_row(float *dst, const void *base, int64_t row, const int bf16) {
  if (bf16) {
    const uint16_t *src = (const uint16_t *)base + row * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; d++) dst[d] = from_bf16(src[d]);
  } else {
    memcpy(dst, (const float *)base + row * HEAD_DIM, HEAD_DIM * sizeof(float));
  }
}

INLINE void store_row(void *base, int64_t row, const float *src, float mul, const int bf16) {
  if (bf16) {
    uint16_t *dst = (uint16_t *)base + row * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; d++) dst[d] = to_bf16(src[d] * mul);
  } else {
    float *dst = (float *)base + row * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; d++) dst[d] = src[d] * mul;
  }
}

/* request b's GROUP queries of KV head h against its first `len` slots */
INLINE void attend(const void *q, const void *k_buf, const void *v_buf, const int64_t *slots,
                   int64_t len, void *out, int64_t b, int64_t h, int64_t num_kv_heads,
                   float scale, const int bf16) {
  float qf[GROUP][HEAD_DIM], acc[GROUP][HEAD_DIM], m[GROUP], s[GROUP], sc[GROUP][BLOCK];
  float row[HEAD_DIM];
  for (int g = 0; g < GROUP; g++) {
    load_row(qf[g], q, (b * num_kv_heads + h) * GROUP + g, bf16);
    for (int d = 0; d < HEAD_DIM; d++) {
      qf[g][d] *= scale;
      acc[g][d] = 0.f;
    }
    m[g] = -3.0e38f;
    s[g] = 0.f;
  }
  const int64_t row_bytes = HEAD_DIM * (bf16 ? 2 : 4);
  for (int64_t j = 0; j < len && j < BLOCK; j++)  /* the first block's keys */
    prefetch_row(k_buf, (slots[j] * num_kv_heads + h) * row_bytes, row_bytes);
  for (int64_t l0 = 0; l0 < len; l0 += BLOCK) {
    const int n = (int)(len - l0 < BLOCK ? len - l0 : BLOCK);
    /* the rows this block reads next and the next block's keys: their loads overlap */
    for (int j = 0; j < n; j++)
      prefetch_row(v_buf, (slots[l0 + j] * num_kv_heads + h) * row_bytes, row_bytes);
    for (int64_t j = l0 + BLOCK; j < len && j < l0 + 2 * BLOCK; j++)
      prefetch_row(k_buf, (slots[j] * num_kv_heads + h) * row_bytes, row_bytes);
    for (int j = 0; j < n; j++) {
      load_row(row, k_buf, slots[l0 + j] * num_kv_heads + h, bf16);
      for (int g = 0; g < GROUP; g++) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < HEAD_DIM; d++) dot += qf[g][d] * row[d];
        sc[g][j] = dot;
      }
    }
    for (int g = 0; g < GROUP; g++) {
      float top = m[g];
#pragma omp simd reduction(max : top)
      for (int j = 0; j < n; j++) top = sc[g][j] > top ? sc[g][j] : top;
      const float alpha = exp_nonpos(m[g] - top);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < n; j++) {
        const float p = exp_nonpos(sc[g][j] - top);
        sc[g][j] = p;
        sum += p;
      }
      s[g] = s[g] * alpha + sum;
      m[g] = top;
      for (int d = 0; d < HEAD_DIM; d++) acc[g][d] *= alpha;
    }
    for (int j = 0; j < n; j++) {
      load_row(row, v_buf, slots[l0 + j] * num_kv_heads + h, bf16);
      for (int g = 0; g < GROUP; g++) {
        const float p = sc[g][j];
        for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p * row[d];
      }
    }
  }
  for (int g = 0; g < GROUP; g++)
    store_row(out, (b * num_kv_heads + h) * GROUP + g, acc[g], 1.f / s[g], bf16);
}

/* q and out `[batch, num_kv_heads, GROUP, HEAD_DIM]`; slots `[batch, max_len]`, of which the
   first lens[b] are request b's (1 <= lens[b]; past max_len: max_len); all contiguous */
#define ENTRY(NAME, BF16)                                                                      \
  void NAME(const void *q, const void *k_buf, const void *v_buf, const int64_t *slots,         \
            const int64_t *lens, void *out, int64_t batch, int64_t max_len,                    \
            int64_t num_kv_heads, float scale, int threads) {                                  \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                     \
    for (int64_t item = 0; item < batch * num_kv_heads; item++) {                              \
      const int64_t b = item / num_kv_heads;                                                   \
      const int64_t len = lens[b] < max_len ? lens[b] : max_len;                               \
      attend(q, k_buf, v_buf, slots + b * max_len, len, out, b, item % num_kv_heads,           \
             num_kv_heads, scale, BF16);                                                       \
    }                                                                                          \
  }

ENTRY(paged_decode_bf16, 1)
ENTRY(paged_decode_f32, 0)
