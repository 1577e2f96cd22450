/* Decode attention on the KV pool's pages (CPU): one query token per request attends to the
   keys and values at its slots, read in place from `[num_slots, num_kv_heads, HEAD_DIM]`
   buffers. Built by workers/native_build.py for one model's head sizes (HEAD_DIM, GROUP: the
   query heads per KV head), loaded with ctypes (workers/attention/paged_decode.py).

   Per request and KV heads, on OpenMP threads (a lone request's heads together where the batch
   gives the threads enough tasks so, its keys in pieces too when the batch is small: "The
   tasks" below): the GROUP queries of each head are scaled and kept in float32; keys are taken
   BLOCK at a time: scores, then an online softmax (running maximum and sum, the accumulator
   rescaled when the maximum grows), then the values weighted into the accumulator. Each key
   and value row is read from its page once; float32 inside, bf16 or float32 in and out (bf16
   rounded to nearest even, as torch rounds). In bf16 on a CPU with AVX-512-BF16 (and HEAD_DIM
   a multiple of 32) the products are dot products of bf16 pairs on the rows as they lie
   (`pass_keys_dot`), the weights rounded to bf16 for their product with the values. A
   request's slots are scattered over the pool once the cache has freed and reused them, so the
   rows of the next block of keys and of this block's values are prefetched while the scores
   are computed (30 layers' pools, cold caches, slots at random: 16 requests of 420 keys 815
   against 1,062 us a layer; slots in runs: no change).

   Requests whose rows start with the same slots (a prefix the radix cache gave them all) read
   it once: such a group's queries (up to MAX_Q of them, MAX_Q / GROUP requests) take the shared
   keys in one pass, each key and value row against every member's queries, and then each
   member goes on over its own keys from the same running maximum, sum and accumulator (the
   online softmax does not care where the keys come from), which gives the attention over the
   whole row. Same slots are the same keys, so any common run of slots can be shared; the groups
   are found at each call (rows ordered by their first slot, each compared with the first of its
   run), an O(batch x shared keys) walk of the slots, small beside the reads it saves. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "HEAD_DIM and GROUP must be defined"
#endif

#define BLOCK 32
INLINE void prefetch_row(const void *base, int64_t offset, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    __builtin_prefetch((const char *)base + offset + line, 0, 3);
}

/* a pass's prefetches: before its first block, that block's keys and values; then each row
   one block ahead, as the row a block before it is read (`prefetch_ahead`). A block's rows
   prefetched in one burst ask for more lines than a core keeps in flight, and the loads stall
   on the rest: 4 groups of 4 requests sharing 512 float32 keys (+80 each), AMD EPYC Zen 4, two
   threads, 30 layers' pools, a row ahead per row read against a burst per block: 0.72-0.80x
   the time of the call. */
INLINE void prefetch_first(const void *k_buf, const void *v_buf, const int64_t *slots,
                           int64_t n_keys, int64_t h, int nh, int64_t num_kv_heads,
                           int64_t row_bytes) {
  for (int64_t j = 0; j < n_keys && j < BLOCK; j++) {
    prefetch_row(k_buf, (slots[j] * num_kv_heads + h) * row_bytes, nh * row_bytes);
    prefetch_row(v_buf, (slots[j] * num_kv_heads + h) * row_bytes, nh * row_bytes);
  }
}

/* the rows of KV heads [h, h + nh) at slot l of `buf` (keys or values; side by side in the
   pool), a block before they are read; nothing past the pass's keys, nothing where nh is 0 */
INLINE void prefetch_ahead(const void *buf, const int64_t *slots, int64_t l, int64_t n_keys,
                           int64_t h, int nh, int64_t num_kv_heads, int64_t row_bytes) {
  if (l >= n_keys) return;
  const char *at = (const char *)buf + (slots[l] * num_kv_heads + h) * row_bytes;
  for (int i = 0; i < nh; i++) prefetch_row(at, i * row_bytes, row_bytes);
}

INLINE void load_row(float *dst, const void *base, int64_t row, const int bf16) {
  if (bf16) {
    const uint16_t *src = (const uint16_t *)base + row * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; d++) dst[d] = from_bf16(src[d]);
  } else {
    const float *src = (const float *)base + row * HEAD_DIM;
    for (int d = 0; d < HEAD_DIM; d++) dst[d] = src[d];
  }
}

/* a row as float32: float32 rows read where they are, bf16 rows converted into `buf` */
INLINE const float *row_at(float *buf, const void *base, int64_t row, const int bf16) {
  if (!bf16) return (const float *)base + row * HEAD_DIM;
  load_row(buf, base, row, 1);
  return buf;
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

#define MAX_Q (GROUP > 32 ? GROUP : 32) /* queries that share one pass over a prefix's keys */
#define MAX_MEMBERS (MAX_Q / GROUP)     /* requests in one such pass */
#define MIN_SHARED 32                   /* shorter common prefixes are read per request */

/* one query's running maximum, sum and accumulator take a block's n scores (`sc`, replaced
   by their weights) */
INLINE void softmax_step(float *sc, int n, float *m, float *s, float *acc) {
  float top = *m;
#pragma omp simd reduction(max : top)
  for (int j = 0; j < n; j++) top = sc[j] > top ? sc[j] : top;
  const float alpha = exp_nonpos(*m - top);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < n; j++) {
    const float p = exp_nonpos(sc[j] - top);
    sc[j] = p;
    sum += p;
  }
  *s = *s * alpha + sum;
  *m = top;
  for (int d = 0; d < HEAD_DIM; d++) acc[d] *= alpha;
}

#if defined(__AVX512F__) && HEAD_DIM % 16 == 0 && BLOCK % 16 == 0
#define LANE_SUMS 1
/* the sums of 16 vectors' lanes, as one vector (lane i: the sum of v[i]'s 16 lanes): pairs of
   vectors interleaved and added, then pairs of pairs, then 128-bit quarters exchanged and
   added, 45 instructions where summing each vector alone takes about 8 a vector and a chain
   of dependent steps. A request's own keys' scores so (`pass_keys`), on an AVX-512 Xeon, two
   threads, bf16, the whole call against summing each dot product alone: 16 lone requests of
   600 keys 0.92-0.93x the time, 64 of 300 0.90-0.91x, shared-prefix groups (their members'
   own keys) 0.92-0.98x. */
INLINE __m512 lane_sums16(const __m512 *v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; i++)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; i++)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

/* the GROUP queries each (scaled, float32; head i's from row i * GROUP) of the nh KV heads from
   h, with their running maxima `m`, sums `s` and accumulators `acc`, go on over the n keys and
   values at `slots[l0..l0 + n)`: key after key, the heads' rows of a slot (side by side in the
   pool) one after another, and the next block's rows asked for as these are read */
INLINE void block_keys(const void *k_buf, const void *v_buf, const int64_t *slots, int64_t l0,
                       int n, int64_t n_keys, int64_t h, int nh, int64_t num_kv_heads,
                       float (*qf)[HEAD_DIM], float (*acc)[HEAD_DIM], float *m, float *s,
                       float (*sc)[BLOCK], const int bf16) {
  float row[HEAD_DIM];
  const int64_t row_bytes = HEAD_DIM * (bf16 ? 2 : 4);
  const int nq = nh * GROUP;
#ifdef LANE_SUMS
  /* each key's products with each query in 16 lanes, then the lanes of 16 keys summed
     together (lane_sums16): no sum across one vector's lanes per key and query */
  __m512 part[nq][BLOCK]; /* as many rows as queries: a lone head's few stay near the rest */
  for (int j = 0; j < n; j++) {
    prefetch_ahead(k_buf, slots, l0 + BLOCK + j, n_keys, h, nh, num_kv_heads, row_bytes);
    for (int i = 0; i < nh; i++) {
      const float *key = row_at(row, k_buf, slots[l0 + j] * num_kv_heads + h + i, bf16);
      __m512 kv[HEAD_DIM / 16];
      for (int c = 0; c < HEAD_DIM / 16; c++) kv[c] = _mm512_loadu_ps(key + 16 * c);
      for (int g = i * GROUP; g < (i + 1) * GROUP; g++) {
        __m512 p = _mm512_mul_ps(_mm512_loadu_ps(qf[g]), kv[0]);
        for (int c = 1; c < HEAD_DIM / 16; c++)
          p = _mm512_fmadd_ps(_mm512_loadu_ps(qf[g] + 16 * c), kv[c], p);
        part[g][j] = p;
      }
    }
  }
  for (int j = n; j < BLOCK; j++) /* a last block's empty keys: sums never read */
    for (int g = 0; g < nq; g++) part[g][j] = _mm512_setzero_ps();
  for (int g = 0; g < nq; g++)
    for (int j0 = 0; j0 < n; j0 += 16) _mm512_storeu_ps(sc[g] + j0, lane_sums16(part[g] + j0));
#else
  for (int j = 0; j < n; j++) {
    prefetch_ahead(k_buf, slots, l0 + BLOCK + j, n_keys, h, nh, num_kv_heads, row_bytes);
    for (int i = 0; i < nh; i++) {
      const float *key = row_at(row, k_buf, slots[l0 + j] * num_kv_heads + h + i, bf16);
      for (int g = i * GROUP; g < (i + 1) * GROUP; g++) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < HEAD_DIM; d++) dot += qf[g][d] * key[d];
        sc[g][j] = dot;
      }
    }
  }
#endif
  for (int g = 0; g < nq; g++) softmax_step(sc[g], n, &m[g], &s[g], acc[g]);
  for (int j = 0; j < n; j++) {
    prefetch_ahead(v_buf, slots, l0 + BLOCK + j, n_keys, h, nh, num_kv_heads, row_bytes);
    for (int i = 0; i < nh; i++) {
      const float *value = row_at(row, v_buf, slots[l0 + j] * num_kv_heads + h + i, bf16);
      for (int g = i * GROUP; g < (i + 1) * GROUP; g++) {
        const float p = sc[g][j];
        for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p * value[d];
      }
    }
  }
}

/* the queries of the nh KV heads from h (GROUP each, head i's from row i * GROUP of qf and of
   the states) go on over the keys and values at `slots[0..n_keys)`, a block at a time */
INLINE void pass_keys(const void *k_buf, const void *v_buf, const int64_t *slots, int64_t n_keys,
                      int64_t h, int nh, int64_t num_kv_heads, float (*qf)[HEAD_DIM],
                      float (*acc)[HEAD_DIM], float *m, float *s, float (*sc)[BLOCK],
                      const int bf16) {
  prefetch_first(k_buf, v_buf, slots, n_keys, h, nh, num_kv_heads, HEAD_DIM * (bf16 ? 2 : 4));
  for (int64_t l0 = 0; l0 < n_keys; l0 += BLOCK) {
    const int n = (int)(n_keys - l0 < BLOCK ? n_keys - l0 : BLOCK);
    if (nh == 1) /* the loops over heads and queries known when compiled */
      block_keys(k_buf, v_buf, slots, l0, n, n_keys, h, 1, num_kv_heads, qf, acc, m, s, sc, bf16);
    else
      block_keys(k_buf, v_buf, slots, l0, n, n_keys, h, nh, num_kv_heads, qf, acc, m, s, sc,
                 bf16);
  }
}

#if defined(__AVX512BF16__) && defined(LANE_SUMS) && HEAD_DIM % 32 == 0
#define DOT_BF16 1
#define NP (HEAD_DIM / 32) /* 32 bf16 (16 pairs) a vector */
/* queries a round of scores takes (each 16 keys' sums kept apart) */
#define QG (GROUP < 4 ? GROUP : 4)
/* queries whose values' sums stay in registers at once: HEAD_DIM / 16 vectors each, 16 in all */
#define QV (GROUP * (HEAD_DIM / 16) <= 16 ? GROUP : (HEAD_DIM <= 256 ? 256 / HEAD_DIM : 1))

/* the values of two keys' rows (bf16, HEAD_DIM each) as pairs for vdpbf16ps: vv[2c] the pairs
   of elements 32c..32c + 16, vv[2c + 1] of the next 16 */
INLINE void pair_rows(const uint16_t *r0, const uint16_t *r1, __m512bh *vv) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int c = 0; c < NP; c++) {
    const __m512i x = _mm512_loadu_si512(r0 + 32 * c), y = _mm512_loadu_si512(r1 + 32 * c);
    vv[2 * c] = (__m512bh)_mm512_permutex2var_epi16(x, lo, y);
    vv[2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(x, hi, y);
  }
}

/* the nq queries' running states take a block's n scores, whose weights go into wb in bf16
   (zero past n: a last odd key's partner) */
INLINE void weights_bf16(float (*sc)[BLOCK], int nq, int n, float *m, float *s,
                         float (*acc)[HEAD_DIM], uint16_t (*wb)[BLOCK]) {
  const uint32_t valid = n >= 32 ? ~0u : (1u << n) - 1u;
  for (int g = 0; g < nq; g++) {
    softmax_step(sc[g], n, &m[g], &s[g], acc[g]);
    const __m512 a = _mm512_maskz_loadu_ps((__mmask16)valid, sc[g]);
    const __m512 b = _mm512_maskz_loadu_ps((__mmask16)(valid >> 16), sc[g] + 16);
    _mm512_store_si512(wb[g], (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

/* `pass_keys` in bf16 on AVX-512-BF16's dot products of pairs (vdpbf16ps), the rows read as
   they lie in the pool: `nq` queries (`qb`, nq rows of bf16 as given, unscaled: each product
   exact in float32; the scale on the summed scores) against each key row, 32 dims a vector,
   QG queries a round, the lanes of 16 keys summed together (lane_sums16); then the values two
   keys at a time, their rows interleaved into pairs (vpermt2w) against the pair of weights,
   which are rounded to bf16 for that product (as the bf16 prompt kernels and torch's flash
   kernel round them), QV queries' sums in registers for the whole block. For a request's own
   keys (nq = GROUP) and for a shared prefix's pass (many queries, where `pass_shared` does
   float32 arithmetic on transposed keys). Own keys against the float32 arithmetic on the
   converted rows (`pass_keys`) on an AMD EPYC Zen 5, two threads, 3 KV heads of 64 with 3
   queries each, the whole call, 30 layers' pools: 16 lone requests of 592 keys 0.91x the time,
   1 of 600 0.83x, 4 of 300 0.89x, 4 groups of 4 sharing 512 keys (80 each of their own) 0.90x
   (one layer's pool, in the caches: 0.74-0.83x); two engines' steps alternated (four rounds):
   one stream 1.04x the tokens/s, four streams 1.00x, shared prefix 1.10x, mixed 1.08x. The
   shared prefixes' passes here too, against `pass_shared`: 4 groups of 4 sharing 512 keys
   0.70x the time (0.60x in the caches), their members' own keys as before; engines alternated:
   shared prefix 1.00x, four streams 1.05x, mixed 1.01x (the decode steps' share of those
   workloads: within the noise).

   This is one block of it for the nq queries of KV head h: its n keys and values at
   slots[l0..l0 + n), the next block's rows asked for as these are read. */
INLINE void block_keys_dot(const uint16_t *k_buf, const uint16_t *v_buf, const int64_t *slots,
                           int64_t l0, int n, int64_t n_keys, int64_t h, int64_t num_kv_heads,
                           int nq, const uint16_t *qb, float scale,
                           float (*acc)[HEAD_DIM], float *m, float *s, float (*sc)[BLOCK]) {
  _Static_assert(BLOCK == 32, "a block's weights are one vector of bf16");
  __m512 part[QG][16];
  uint16_t wb[MAX_Q][BLOCK] __attribute__((aligned(64))); /* the block's weights in bf16 */
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t row_bytes = HEAD_DIM * 2;
  for (int g0 = 0; g0 < nq; g0 += QG) {
    const int ng = nq - g0 < QG ? nq - g0 : QG;
    __m512bh qv[QG][NP];
    for (int i = 0; i < QG; i++) /* a last round's spare rows: the last query again */
      for (int c = 0; c < NP; c++)
        qv[i][c] = (__m512bh)_mm512_loadu_si512(qb + (g0 + (i < ng ? i : ng - 1)) * HEAD_DIM
                                                + 32 * c);
    for (int j0 = 0; j0 < n; j0 += 16) {
      const int nj = n - j0 < 16 ? n - j0 : 16;
      for (int j = 0; j < nj; j++) {
        if (g0 == 0) /* the first round reads the block's keys from memory */
          prefetch_ahead(k_buf, slots, l0 + BLOCK + j0 + j, n_keys, h, 1, num_kv_heads, row_bytes);
        const uint16_t *key = k_buf + (slots[l0 + j0 + j] * num_kv_heads + h) * HEAD_DIM;
        __m512bh kv[NP];
        for (int c = 0; c < NP; c++) kv[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
        for (int i = 0; i < QG; i++) {
          __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[i][0], kv[0]);
          for (int c = 1; c < NP; c++) p = _mm512_dpbf16_ps(p, qv[i][c], kv[c]);
          part[i][j] = p;
        }
      }
      for (int i = 0; i < ng; i++) {
        for (int j = nj; j < 16; j++) part[i][j] = _mm512_setzero_ps(); /* never read */
        _mm512_storeu_ps(sc[g0 + i] + j0, _mm512_mul_ps(lane_sums16(part[i]), vscale));
      }
    }
  }
  weights_bf16(sc, nq, n, m, s, acc, wb);
  for (int g0 = 0; g0 < nq; g0 += QV) {
    int g[QV];
    for (int i = 0; i < QV; i++) g[i] = g0 + i < nq ? g0 + i : nq - 1;
    __m512 a[QV][HEAD_DIM / 16];
    for (int i = 0; i < QV; i++)
      for (int c = 0; c < HEAD_DIM / 16; c++) a[i][c] = _mm512_loadu_ps(acc[g[i]] + 16 * c);
    for (int j = 0; j < n; j += 2) {
      if (g0 == 0) {
        prefetch_ahead(v_buf, slots, l0 + BLOCK + j, n_keys, h, 1, num_kv_heads, row_bytes);
        prefetch_ahead(v_buf, slots, l0 + BLOCK + j + 1, n_keys, h, 1, num_kv_heads, row_bytes);
      }
      const uint16_t *r0 = v_buf + (slots[l0 + j] * num_kv_heads + h) * HEAD_DIM;
      const uint16_t *r1 = j + 1 < n ? v_buf + (slots[l0 + j + 1] * num_kv_heads + h) * HEAD_DIM
                                     : r0; /* its weight is 0 */
      __m512bh vv[HEAD_DIM / 16];
      pair_rows(r0, r1, vv);
      for (int i = 0; i < QV; i++) {
        int32_t pair;
        memcpy(&pair, wb[g[i]] + j, 4);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < HEAD_DIM / 16; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], vv[c], w);
      }
    }
    for (int i = 0; i < QV; i++) /* repeats store the same sums */
      for (int c = 0; c < HEAD_DIM / 16; c++) _mm512_storeu_ps(acc[g[i]] + 16 * c, a[i][c]);
  }
}

/* `block_keys_dot` for the GROUP queries each of the nh KV heads from h (head i's from row
   i * GROUP of qb and of the states): key after key, the heads' rows of a slot (side by side in
   the pool) one after another; each product and weight as there */
INLINE void block_heads_dot(const uint16_t *k_buf, const uint16_t *v_buf, const int64_t *slots,
                            int64_t l0, int n, int64_t n_keys, int64_t h, int nh,
                            int64_t num_kv_heads, const uint16_t *qb, float scale,
                            float (*acc)[HEAD_DIM], float *m, float *s, float (*sc)[BLOCK]) {
  __m512 part[MAX_Q][16];
  uint16_t wb[MAX_Q][BLOCK] __attribute__((aligned(64))); /* the block's weights in bf16 */
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t row_bytes = HEAD_DIM * 2;
  const int nq = nh * GROUP;
  for (int j0 = 0; j0 < n; j0 += 16) {
    const int nj = n - j0 < 16 ? n - j0 : 16;
    for (int j = 0; j < nj; j++) {
      prefetch_ahead(k_buf, slots, l0 + BLOCK + j0 + j, n_keys, h, nh, num_kv_heads, row_bytes);
      const uint16_t *key = k_buf + (slots[l0 + j0 + j] * num_kv_heads + h) * HEAD_DIM;
      for (int i = 0; i < nh; i++) {
        __m512bh kv[NP];
        for (int c = 0; c < NP; c++)
          kv[c] = (__m512bh)_mm512_loadu_si512(key + i * HEAD_DIM + 32 * c);
        for (int g = i * GROUP; g < (i + 1) * GROUP; g++) {
          __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(),
                                      (__m512bh)_mm512_loadu_si512(qb + g * HEAD_DIM), kv[0]);
          for (int c = 1; c < NP; c++)
            p = _mm512_dpbf16_ps(p, (__m512bh)_mm512_loadu_si512(qb + g * HEAD_DIM + 32 * c),
                                 kv[c]);
          part[g][j] = p;
        }
      }
    }
    for (int g = 0; g < nq; g++) {
      for (int j = nj; j < 16; j++) part[g][j] = _mm512_setzero_ps(); /* never read */
      _mm512_storeu_ps(sc[g] + j0, _mm512_mul_ps(lane_sums16(part[g]), vscale));
    }
  }
  weights_bf16(sc, nq, n, m, s, acc, wb);
  for (int j = 0; j < n; j += 2) {
    prefetch_ahead(v_buf, slots, l0 + BLOCK + j, n_keys, h, nh, num_kv_heads, row_bytes);
    prefetch_ahead(v_buf, slots, l0 + BLOCK + j + 1, n_keys, h, nh, num_kv_heads, row_bytes);
    const uint16_t *r0 = v_buf + (slots[l0 + j] * num_kv_heads + h) * HEAD_DIM;
    const uint16_t *r1 = j + 1 < n ? v_buf + (slots[l0 + j + 1] * num_kv_heads + h) * HEAD_DIM
                                   : r0; /* its weight is 0 */
    for (int i = 0; i < nh; i++) {
      __m512bh vv[HEAD_DIM / 16];
      pair_rows(r0 + i * HEAD_DIM, r1 + i * HEAD_DIM, vv);
      for (int g = i * GROUP; g < (i + 1) * GROUP; g++) {
        int32_t pair;
        memcpy(&pair, wb[g] + j, 4);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < HEAD_DIM / 16; c++)
          _mm512_storeu_ps(acc[g] + 16 * c,
                           _mm512_dpbf16_ps(_mm512_loadu_ps(acc[g] + 16 * c), vv[c], w));
      }
    }
  }
}

/* `nq` queries of KV head h (nh = 1), or GROUP queries each of the nh KV heads from h (head i's
   from row i * GROUP of qb and of the states), over the keys at slots[0..n_keys), a block at a
   time */
INLINE void pass_keys_dot(const uint16_t *k_buf, const uint16_t *v_buf, const int64_t *slots,
                          int64_t n_keys, int64_t h, int nh, int64_t num_kv_heads, int nq,
                          const uint16_t *qb, float scale, float (*acc)[HEAD_DIM], float *m,
                          float *s, float (*sc)[BLOCK]) {
  prefetch_first(k_buf, v_buf, slots, n_keys, h, nh, num_kv_heads, HEAD_DIM * 2);
  for (int64_t l0 = 0; l0 < n_keys; l0 += BLOCK) {
    const int n = (int)(n_keys - l0 < BLOCK ? n_keys - l0 : BLOCK);
    if (nh == 1)
      block_keys_dot(k_buf, v_buf, slots, l0, n, n_keys, h, num_kv_heads, nq, qb, scale, acc, m,
                     s, sc);
    else
      block_heads_dot(k_buf, v_buf, slots, l0, n, n_keys, h, nh, num_kv_heads, qb, scale, acc,
                      m, s, sc);
  }
}
#endif

/* `pass_keys` for the many queries of a shared prefix's pass, where the arithmetic, not the
   reads, takes the time: each block's keys transposed once, so that a query's scores are its
   elements times rows of keys, summed in vectors along the keys (no sums across lanes), QS
   queries at a time (8 independent sums); each query's accumulator takes the block's values key
   after key in registers, QW queries at a time. In vectors of VW floats (GCC's vector
   extension): 16 (AVX-512's registers) where the CPU has them and HEAD_DIM is a multiple of 16,
   else 8 (AVX2's, or two SSE ones) where HEAD_DIM is a multiple of 8, plain loops otherwise.
   Against 8-float vectors on an AVX-512 Xeon (two threads, 3 KV heads of 64, 3 queries each,
   the whole call, medians of five): 8 groups of 8 requests sharing 512 keys (+64 each) 0.82x
   the time in bf16, 0.91x in float32; 4 groups of 4, 0.72x / 0.87x; 2 groups of 10 sharing
   1,000 keys (+20), 0.84x / 0.86x. */
#if defined(__AVX512F__) && HEAD_DIM % 16 == 0 && BLOCK % 16 == 0
#define VW 16
#define QS 4
#define QW 2
#elif HEAD_DIM % 8 == 0
#define VW 8
#define QS 2
#define QW 1
#endif
#ifdef VW
typedef float vecw __attribute__((vector_size(4 * VW)));
typedef float vecwu __attribute__((vector_size(4 * VW), aligned(4), may_alias)); /* in memory */
#define NV (HEAD_DIM / VW)
#define NB (BLOCK / VW)
INLINE vecw vload(const float *p) { return *(const vecwu *)p; }
INLINE void vstore(float *p, vecw v) { *(vecwu *)p = v; }
INLINE vecw vsplat(float x) { return x - (vecw){0}; }

/* a block's scores of the QS queries g[0..QS) (repeats allowed: a last group's spare lanes) */
INLINE void scores_q(const float (*qf)[HEAD_DIM], const int *g, const float (*kt)[BLOCK],
                     float (*sc)[BLOCK]) {
  vecw a[QS][NB];
  _Pragma("GCC unroll 16") for (int i = 0; i < QS; i++)
    _Pragma("GCC unroll 16") for (int v = 0; v < NB; v++) a[i][v] = vsplat(0.f);
  for (int d = 0; d < HEAD_DIM; d++) {
    vecw x[QS];
    _Pragma("GCC unroll 16") for (int i = 0; i < QS; i++) x[i] = vsplat(qf[g[i]][d]);
    _Pragma("GCC unroll 16") for (int v = 0; v < NB; v++) {
      const vecw k = vload(kt[d] + VW * v);
      _Pragma("GCC unroll 16") for (int i = 0; i < QS; i++) a[i][v] += x[i] * k;
    }
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < QS; i++)
    _Pragma("GCC unroll 16") for (int v = 0; v < NB; v++) vstore(sc[g[i]] + VW * v, a[i][v]);
}

/* acc[g[i]] += the sum over the block's n keys of sc[g[i]][j] times their values, for the QW
   queries g[0..QW) (repeats allowed: each copy sums the same and stores the same) */
INLINE void weigh_q(float (*acc)[HEAD_DIM], const float (*sc)[BLOCK], const int *g,
                    const float (*vb)[HEAD_DIM], int n) {
  vecw a[QW][NV];
  _Pragma("GCC unroll 16") for (int i = 0; i < QW; i++)
    _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) a[i][v] = vload(acc[g[i]] + VW * v);
  for (int j = 0; j < n; j++) {
    vecw w[QW];
    _Pragma("GCC unroll 16") for (int i = 0; i < QW; i++) w[i] = vsplat(sc[g[i]][j]);
    _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) {
      const vecw x = vload(vb[j] + VW * v);
      _Pragma("GCC unroll 16") for (int i = 0; i < QW; i++) a[i][v] += w[i] * x;
    }
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < QW; i++)
    _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) vstore(acc[g[i]] + VW * v, a[i][v]);
}
#else
#define QS 1
#define QW 1
INLINE void scores_q(const float (*qf)[HEAD_DIM], const int *g, const float (*kt)[BLOCK],
                     float (*sc)[BLOCK]) {
  float a[BLOCK] = {0};
  for (int d = 0; d < HEAD_DIM; d++)
    for (int j = 0; j < BLOCK; j++) a[j] += qf[g[0]][d] * kt[d][j];
  for (int j = 0; j < BLOCK; j++) sc[g[0]][j] = a[j];
}

INLINE void weigh_q(float (*acc)[HEAD_DIM], const float (*sc)[BLOCK], const int *g,
                    const float (*vb)[HEAD_DIM], int n) {
  for (int j = 0; j < n; j++)
    for (int d = 0; d < HEAD_DIM; d++) acc[g[0]][d] += sc[g[0]][j] * vb[j][d];
}
#endif

INLINE void pass_shared(const void *k_buf, const void *v_buf, const int64_t *slots,
                        int64_t n_keys, int64_t h, int64_t num_kv_heads, int nq,
                        float (*qf)[HEAD_DIM], float (*acc)[HEAD_DIM], float *m, float *s,
                        float (*sc)[BLOCK], const int bf16) {
  float row[HEAD_DIM], kt[HEAD_DIM][BLOCK], vb[BLOCK][HEAD_DIM];
  const int64_t row_bytes = HEAD_DIM * (bf16 ? 2 : 4);
  prefetch_first(k_buf, v_buf, slots, n_keys, h, 1, num_kv_heads, row_bytes);
  for (int64_t l0 = 0; l0 < n_keys; l0 += BLOCK) {
    const int n = (int)(n_keys - l0 < BLOCK ? n_keys - l0 : BLOCK);
    for (int j = 0; j < n; j++) {
      prefetch_ahead(k_buf, slots, l0 + BLOCK + j, n_keys, h, 1, num_kv_heads, row_bytes);
      const float *key = row_at(row, k_buf, slots[l0 + j] * num_kv_heads + h, bf16);
      for (int d = 0; d < HEAD_DIM; d++) kt[d][j] = key[d];
    }
    for (int d = 0; d < HEAD_DIM; d++) /* a last block's empty columns: scores never read */
      for (int j = n; j < BLOCK; j++) kt[d][j] = 0.f;
    for (int g0 = 0; g0 < nq; g0 += QS) {
      int g[QS];
      for (int i = 0; i < QS; i++) g[i] = g0 + i < nq ? g0 + i : nq - 1;
      scores_q((const float (*)[HEAD_DIM])qf, g, (const float (*)[BLOCK])kt, sc);
    }
    for (int g = 0; g < nq; g++) softmax_step(sc[g], n, &m[g], &s[g], acc[g]);
    for (int j = 0; j < n; j++) {
      prefetch_ahead(v_buf, slots, l0 + BLOCK + j, n_keys, h, 1, num_kv_heads, row_bytes);
      load_row(vb[j], v_buf, slots[l0 + j] * num_kv_heads + h, bf16);
    }
    for (int g0 = 0; g0 < nq; g0 += QW) {
      int g[QW];
      for (int i = 0; i < QW; i++) g[i] = g0 + i < nq ? g0 + i : nq - 1;
      weigh_q(acc, (const float (*)[BLOCK])sc, g, (const float (*)[HEAD_DIM])vb, n);
    }
  }
}

/* request b's GROUP queries of KV head h, scaled, into rows r.. of qf, with their states */
INLINE void load_queries(const void *q, int64_t b, int64_t h, int64_t num_kv_heads, float scale,
                         int r, float (*qf)[HEAD_DIM], float (*acc)[HEAD_DIM], float *m, float *s,
                         const int bf16) {
  for (int g = 0; g < GROUP; g++) {
    load_row(qf[r + g], q, (b * num_kv_heads + h) * GROUP + g, bf16);
    for (int d = 0; d < HEAD_DIM; d++) {
      qf[r + g][d] *= scale;
      acc[r + g][d] = 0.f;
    }
    m[r + g] = -3.0e38f;
    s[r + g] = 0.f;
  }
}

#define STATE (HEAD_DIM + 2) /* a query's running maximum, sum and accumulator */

/* the running maxima, sums and accumulators of `rows` queries into `state`, STATE floats each */
INLINE void save_states(float *state, int rows, const float *m, const float *s,
                        float (*acc)[HEAD_DIM]) {
  for (int g = 0; g < rows; g++) {
    float *st = state + g * STATE;
    st[0] = m[g];
    st[1] = s[g];
    memcpy(st + 2, acc[g], sizeof(float) * HEAD_DIM);
  }
}

/* request b's queries of KV heads [h, h + nh) (nh * GROUP <= MAX_Q) against keys [k0, k1) of
   its slots `row`: their attention into `out`, or, where `state` is given (a piece of its
   keys), each query's running maximum, sum and accumulator there, STATE floats a query */
INLINE void attend_own(const void *q, const void *k_buf, const void *v_buf, const int64_t *row,
                       int64_t k0, int64_t k1, int64_t b, int64_t h, int nh,
                       int64_t num_kv_heads, float scale, void *out, float *state,
                       const int bf16) {
  float qf[MAX_Q][HEAD_DIM], acc[MAX_Q][HEAD_DIM], m[MAX_Q], s[MAX_Q], sc[MAX_Q][BLOCK];
  for (int i = 0; i < nh; i++)
    load_queries(q, b, h + i, num_kv_heads, scale, i * GROUP, qf, acc, m, s, bf16);
#ifdef DOT_BF16
  if (bf16)
    pass_keys_dot(k_buf, v_buf, row + k0, k1 - k0, h, nh, num_kv_heads, GROUP,
                  (const uint16_t *)q + (b * num_kv_heads + h) * GROUP * HEAD_DIM, scale, acc, m,
                  s, sc);
  else
#endif
    pass_keys(k_buf, v_buf, row + k0, k1 - k0, h, nh, num_kv_heads, qf, acc, m, s, sc, bf16);
  if (state != NULL) {
    save_states(state, nh * GROUP, m, s, acc);
    return;
  }
  for (int g = 0; g < nh * GROUP; g++) /* the heads' queries are rows in a row of `out` */
    store_row(out, (b * num_kv_heads + h) * GROUP + g, acc[g], 1.f / s[g], bf16);
}

/* the requests `members[0..count)` (count >= 2) of KV head h, whose first `shared` slots are
   the same in each row (each row `max_len` slots of `slots`, request b's first `lens[b]`,
   capped at max_len, its own): their queries over the common slots [k0, k1) in one pass for
   all of them, then, with `own`, each over its own slots from `shared` on; the attention into
   `out`, or, where `state` is given (a piece of their keys), each query's running maximum, sum
   and accumulator there, member i's from row i * GROUP */
INLINE void attend_group(const void *q, const void *k_buf, const void *v_buf,
                         const int64_t *slots, const int64_t *lens, const int64_t *members,
                         int count, int64_t shared, int64_t max_len, int64_t k0, int64_t k1,
                         int own, void *out, float *state, int64_t h, int64_t num_kv_heads,
                         float scale, const int bf16) {
  float qf[MAX_Q][HEAD_DIM], acc[MAX_Q][HEAD_DIM], m[MAX_Q], s[MAX_Q], sc[MAX_Q][BLOCK];
  for (int i = 0; i < count; i++)
    load_queries(q, members[i], h, num_kv_heads, scale, i * GROUP, qf, acc, m, s, bf16);
  if (k1 > k0) {
#ifdef DOT_BF16
    if (bf16) { /* the members' queries side by side, as given */
      uint16_t qb[MAX_Q * HEAD_DIM];
      for (int i = 0; i < count; i++)
        memcpy(qb + i * GROUP * HEAD_DIM,
               (const uint16_t *)q + (members[i] * num_kv_heads + h) * GROUP * HEAD_DIM,
               GROUP * HEAD_DIM * 2);
      pass_keys_dot(k_buf, v_buf, slots + members[0] * max_len + k0, k1 - k0, h, 1,
                    num_kv_heads, count * GROUP, qb, scale, acc, m, s, sc);
    } else
#endif
      pass_shared(k_buf, v_buf, slots + members[0] * max_len + k0, k1 - k0, h, num_kv_heads,
                  count * GROUP, qf, acc, m, s, sc, bf16);
  }
  for (int i = 0; i < count && own; i++) {
    const int64_t b = members[i], len = lens[b] < max_len ? lens[b] : max_len;
    const int r = i * GROUP;
#ifdef DOT_BF16
    if (bf16)
      pass_keys_dot(k_buf, v_buf, slots + b * max_len + shared, len - shared, h, 1,
                    num_kv_heads, GROUP,
                    (const uint16_t *)q + (b * num_kv_heads + h) * GROUP * HEAD_DIM, scale,
                    acc + r, m + r, s + r, sc + r);
    else
#endif
      pass_keys(k_buf, v_buf, slots + b * max_len + shared, len - shared, h, 1, num_kv_heads,
                qf + r, acc + r, m + r, s + r, sc + r, bf16);
  }
  if (state != NULL) {
    save_states(state, count * GROUP, m, s, acc);
    return;
  }
  for (int i = 0; i < count; i++)
    for (int g = 0; g < GROUP; g++)
      store_row(out, (members[i] * num_kv_heads + h) * GROUP + g, acc[i * GROUP + g],
                1.f / s[i * GROUP + g], bf16);
}

static int by_key(const void *a, const void *b) {
  const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Parts of the batch that each make one pass: `order` holds the requests part by part, part p
   is order[start[p]..start[p + 1]) with `shared[p]` slots common to all its rows (0: a lone
   request); returns the number of parts. */
static int64_t find_parts(const int64_t *slots, const int64_t *lens, int64_t batch,
                          int64_t max_len, int64_t *order, int64_t *start, int64_t *shared) {
  int64_t *keyed = order; /* first slot * batch + request: sorted, runs of one first slot */
  for (int64_t b = 0; b < batch; b++) keyed[b] = slots[b * max_len] * batch + b;
  qsort(keyed, (size_t)batch, sizeof(int64_t), by_key);
  for (int64_t i = 0; i < batch; i++) keyed[i] %= batch;
  int64_t parts = 0, i = 0;
  while (i < batch) {
    const int64_t lead = order[i];
    const int64_t lead_len = lens[lead] < max_len ? lens[lead] : max_len;
    const int64_t *lead_slots = slots + lead * max_len;
    /* the run's other rows, each with its common prefix with the lead's row */
    int64_t end = i + 1, common = lead_len;
    start[parts] = i;
    while (end < batch && slots[order[end] * max_len] == lead_slots[0]) {
      const int64_t b = order[end];
      const int64_t len = lens[b] < max_len ? lens[b] : max_len;
      const int64_t *row = slots + b * max_len;
      int64_t c = 0;
      const int64_t limit = len < lead_len ? len : lead_len;
      while (c < limit && row[c] == lead_slots[c]) c++;
      if (c < MIN_SHARED) break; /* it and the rest of the run: parts of their own */
      if (end - start[parts] == MAX_MEMBERS) { /* a full part: the next one starts here */
        shared[parts++] = common;
        start[parts] = end;
        common = c;
      } else if (c < common) {
        common = c;
      }
      end++;
    }
    shared[parts] = end - start[parts] > 1 ? common : 0;
    parts++;
    i = end;
  }
  start[parts] = batch;
  return parts;
}

/* The tasks. A part of several requests (a shared prefix) is a task per KV head. A lone
   request's KV heads are one task (up to MAX_Q / GROUP of them; more make more tasks), which
   reads the keys key after key, each slot's rows of all those heads (side by side in the pool)
   one after another, so that the task reads its rows as one run of memory: one head's rows a
   task, as before, read a third of every slot's bytes (SmolLM2: 3 KV heads) and took about 1.3x
   the time of the same bytes read in runs (16 requests of 592 keys, float32). Whole heads a
   task against one, on the Zen 4 VM (SmolLM2's heads, two threads, 30 layers' pools, slots in
   runs, 4 KB pages, the caches flushed before each call, alternated in one process, medians of
   16 pairs): float32 4 requests of 300 keys 0.84x the time, 8 of 592 0.88x, 16 of 592 0.91x,
   16 of 1,400 0.89x, 32 of 300 0.89x, 64 of 150 0.82x, one of 600 (two pieces) 0.85x; bf16
   0.94x, 0.92x, 0.85x, 0.76x, 0.73x, 0.72x and 0.93x; shared-prefix groups unchanged
   (0.99-1.00x). On 2 MiB pages, as the server allocates the pool, 16 requests and more:
   float32 0.70-0.94x, bf16 0.87-0.94x (README, session 39). Where the batch so gives the
   threads too few tasks to share out evenly (fewer than BALANCED_TASKS a thread, and not a
   multiple of the threads), its lone requests take one head a task; and
   where the batch gives the threads too few tasks (`SPLIT_TASKS` each), a lone request's keys
   are split into pieces that threads take apart (`split_count`): one request had as many
   tasks as KV heads (3 for SmolLM2), so of two threads one did two heads and the other one.
   Each piece of keys leaves its queries' running maximum, sum and accumulator (a `state`: a
   row of STATE floats a query), which `merge` combines as the online softmax would have, had
   one pass taken them all. The tasks depend on the batch and the thread count (two and fewer
   alike), not on which thread runs what, and a head's arithmetic is the same whichever task
   takes it. Splitting, on the Zen 4 VM (30 layers' pools, two threads, slots in runs,
   alternated in one process with the unsplit kernel): one request of 576 to 4,096 keys
   0.80-0.82x the time in float32, 0.84-0.93x in bf16; two requests of 1,000 keys 0.99-1.00x;
   256 keys and fewer are not split (in pieces of 64, a request of 128-256 bf16 keys took
   1.1-1.2x the time). A group (a shared prefix) is likewise a task per KV head, and a lone
   group of a few requests (everyone's system prompt, say) gave two threads three tasks: where
   the batch gives the threads fewer than GROUP_SPLIT_TASKS tasks each, a group's common keys are
   split into pieces (of MIN_SHARED_PIECE keys or more), each piece a task for all the members'
   queries of a head, and the members' own keys one more task a head, whose states are merged.
   Against unsplit groups, same conditions as above: float32 one group of 8 requests sharing 512
   keys (+80 each) 0.85x the time, of 8 sharing 2,000 0.86x, of 4 sharing 1,000 0.87x, of 3
   sharing 300 0.98x; bf16 0.93x, 0.88x, 0.83x and 0.95x; splitting where the batch already
   gave two tasks a thread or more cost 1.01-1.10x (16 requests in two groups, four groups of
   four), and pieces down to 128 keys beside two pieces 1.05x. */
#define SPLIT_TASKS 8      /* tasks a thread should have to choose from before keys are split */
#define MIN_SPLIT_KEYS 256 /* no piece of a request's keys shorter */
#define BALANCED_TASKS 4   /* tasks a thread, or a multiple of the threads, for whole heads */
#define MIN_SHARED_PIECE 128 /* no piece of a group's common keys shorter */
#define GROUP_SPLIT_TASKS 2 /* tasks a thread should have before a group's common keys are split */

/* request b's output of KV head h from its `count` pieces' states (piece i's query g at row
   i * stride + g): the common maximum, each piece's sum and accumulator rescaled to it */
INLINE void merge(const float *states, int count, int stride, void *out, int64_t b, int64_t h,
                  int64_t num_kv_heads, const int bf16) {
  for (int g = 0; g < GROUP; g++) {
    float top = -3.0e38f, sum = 0.f, acc[HEAD_DIM] = {0};
    for (int i = 0; i < count; i++) {
      const float mi = states[(i * stride + g) * STATE];
      top = mi > top ? mi : top;
    }
    for (int i = 0; i < count; i++) {
      const float *st = states + (i * stride + g) * STATE;
      const float w = exp_nonpos(st[0] - top);
      sum += st[1] * w;
      for (int d = 0; d < HEAD_DIM; d++) acc[d] += st[2 + d] * w;
    }
    store_row(out, (b * num_kv_heads + h) * GROUP + g, acc, 1.f / sum, bf16);
  }
}

/* how many pieces each lone request's keys may be split into (1: none), for `tasks` unsplit */
static int split_count(int64_t tasks, int threads) {
  const int64_t want = (int64_t)SPLIT_TASKS * (threads > 2 ? threads : 2);
  return tasks >= want ? 1 : (int)((want + tasks - 1) / tasks);
}

/* the batch's tasks with `hpt` KV heads a lone request's task: pieces[p], part p's pieces of
   keys (a lone request's own, a group's common ones; 1: unsplit), and first[p], part p's first
   task; returns their number. A lone request's task takes one piece of `hpt` heads; a group's,
   unsplit, one head; split, one head's piece of the common keys, or one head's members' own
   keys. */
static int64_t plan(const int64_t *order, const int64_t *start, const int64_t *shared,
                    const int64_t *lens, int64_t parts, int64_t max_len, int64_t num_kv_heads,
                    int hpt, int threads, int64_t *pieces, int64_t *first) {
  int64_t lone = 0;
  for (int64_t p = 0; p < parts; p++) lone += start[p + 1] - start[p] == 1;
  const int64_t chunks = (num_kv_heads + hpt - 1) / hpt; /* a lone request's tasks, unsplit */
  const int64_t unsplit = lone * chunks + (parts - lone) * num_kv_heads;
  const int splits = split_count(unsplit, threads);
  const int64_t spread = threads > 2 ? threads : 2, want = GROUP_SPLIT_TASKS * spread;
  const int64_t group_splits = unsplit < want ? (want + unsplit - 1) / unsplit : 1;
  int64_t tasks = 0;
  for (int64_t p = 0; p < parts; p++) {
    first[p] = tasks;
    int64_t n;
    if (start[p + 1] - start[p] > 1) {
      n = shared[p] / MIN_SHARED_PIECE;
      n = n < 1 ? 1 : (n > group_splits ? group_splits : n);
      tasks += num_kv_heads * (n > 1 ? n + 1 : 1);
    } else {
      const int64_t b = order[start[p]];
      n = (lens[b] < max_len ? lens[b] : max_len) / MIN_SPLIT_KEYS;
      n = n < 1 ? 1 : (n > splits ? splits : n);
      tasks += n * chunks;
    }
    pieces[p] = n;
  }
  return tasks;
}

/* the batch's parts (`find_parts`) as tasks on `threads` OpenMP threads, then the split
   requests' heads merged; a task's states (a split part's) are MAX_Q rows apart */
static void attend_parts(const void *q, const void *k_buf, const void *v_buf,
                         const int64_t *slots, const int64_t *lens, void *out,
                         const int64_t *order, const int64_t *start, const int64_t *shared,
                         int64_t parts, int64_t max_len, int64_t num_kv_heads, float scale,
                         int threads, const int bf16) {
  int64_t *pieces = malloc(sizeof(int64_t) * 2 * (size_t)(parts + 1));
  int64_t *first = pieces + parts + 1;
  int hpt = (int)(num_kv_heads < MAX_Q / GROUP ? num_kv_heads : MAX_Q / GROUP);
  int64_t tasks = plan(order, start, shared, lens, parts, max_len, num_kv_heads, hpt, threads,
                       pieces, first);
  const int spread = threads > 2 ? threads : 2; /* one thread and two alike */
  if (hpt > 1 && tasks < (int64_t)BALANCED_TASKS * spread && tasks % spread != 0) {
    hpt = 1; /* too few tasks to share out evenly: one head a task */
    tasks = plan(order, start, shared, lens, parts, max_len, num_kv_heads, hpt, threads, pieces,
                 first);
  }
  int split = 0;
  for (int64_t p = 0; p < parts; p++) split |= pieces[p] > 1;
  const int64_t rows = MAX_Q; /* a task's states */
  float *states = split ? malloc(sizeof(float) * (size_t)(tasks * rows * STATE)) : NULL;
  _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
  for (int64_t task = 0; task < tasks; task++) {
    int64_t p = 0; /* the part of this task: the last whose first task is at or before it */
    int64_t lo = 0, hi = parts - 1;
    while (lo <= hi) {
      const int64_t mid = (lo + hi) / 2;
      if (first[mid] <= task) { p = mid; lo = mid + 1; } else { hi = mid - 1; }
    }
    const int64_t *members = order + start[p], k = task - first[p], n = pieces[p];
    const int count = (int)(start[p + 1] - start[p]);
    float *state = n > 1 ? states + task * rows * STATE : NULL;
    if (count > 1) { /* a group: unsplit, a head a task; split, n + 1 tasks a head */
      const int64_t h = n > 1 ? k / (n + 1) : k, i = n > 1 ? k % (n + 1) : 0;
      const int64_t k0 = n > 1 ? shared[p] * i / n : 0;
      const int64_t k1 = n > 1 ? (i < n ? shared[p] * (i + 1) / n : 0) : shared[p];
      attend_group(q, k_buf, v_buf, slots, lens, members, count, shared[p], max_len, k0, k1,
                   n == 1 || i == n, out, state, h, num_kv_heads, scale, bf16);
      continue;
    }
    const int64_t h = k / n * hpt, i = k % n, b = members[0];
    const int64_t len = lens[b] < max_len ? lens[b] : max_len;
    const int nh = (int)(num_kv_heads - h < hpt ? num_kv_heads - h : hpt);
    attend_own(q, k_buf, v_buf, slots + b * max_len, len * i / n, len * (i + 1) / n, b, h, nh,
               num_kv_heads, scale, out, state, bf16);
  }
  for (int64_t p = 0; p < parts && split; p++) {
    const int64_t n = pieces[p];
    const int count = (int)(start[p + 1] - start[p]);
    if (n == 1) continue;
    for (int64_t h = 0; h < num_kv_heads; h++) {
      if (count == 1) /* head h: in chunk h / hpt, its queries from row h % hpt * GROUP */
        merge(states + ((first[p] + h / hpt * n) * rows + h % hpt * GROUP) * STATE, (int)n,
              (int)rows, out, order[start[p]], h, num_kv_heads, bf16);
      else /* head h's n pieces of the common keys, then its members' own keys */
        for (int i = 0; i < count; i++)
          merge(states + ((first[p] + h * (n + 1)) * rows + i * GROUP) * STATE, (int)n + 1,
                (int)rows, out, order[start[p] + i], h, num_kv_heads, bf16);
    }
  }
  free(states);
  free(pieces);
}

/* q and out `[batch, num_kv_heads, GROUP, HEAD_DIM]`; slots `[batch, max_len]`, of which the
   first lens[b] are request b's (1 <= lens[b]; past max_len: max_len); all contiguous;
   scratch: 3 * batch + 1 int64s of the caller's (the rows' order and the parts) */
#define ENTRY(NAME, BF16)                                                                      \
  void NAME(const void *q, const void *k_buf, const void *v_buf, const int64_t *slots,         \
            const int64_t *lens, void *out, int64_t *scratch, int64_t batch, int64_t max_len,  \
            int64_t num_kv_heads, float scale, int threads) {                                  \
    int64_t *order = scratch, *start = order + batch, *shared = start + batch + 1;             \
    const int64_t parts = find_parts(slots, lens, batch, max_len, order, start, shared);       \
    attend_parts(q, k_buf, v_buf, slots, lens, out, order, start, shared, parts, max_len,      \
                 num_kv_heads, scale, threads, BF16);                                          \
  }

ENTRY(paged_decode_bf16, 1)
ENTRY(paged_decode_f32, 0)
