/* Causal attention of a request's new tokens (a prompt or a chunk of one, after `prefix` keys
   already in the cache): out = softmax(q k^T * scale, causal) v, float32 scores and sums.
   Built by workers/native_build.py, called with ctypes (extend_kernel.py), as one of three
   kinds: TILES=1 bf16 with the products on AMX tiles; TILES=0 bf16 as AVX-512-BF16 dot
   products (CPUs without AMX); F32=1 float32 as AVX-512 multiply-adds. In bf16 the weights are
   rounded to bf16 for their product with v (as torch's flash kernel does); in float32
   everything stays float32.

   q [n, hq, d] and out [n, hq, d]; k and v [hk, L, d] (L = prefix + n), or, given `kv_rows`
   [hk, L], the KV pool's buffers read in place: key j of head h is row kv_rows[h * L + j] of k
   and v seen as [rows, d] (no copy of a request's keys and values gathered first). Head h of
   the queries reads head h / (hq / hk) of the keys. Each task is 16 query rows of one head
   (the last rows of the prompt first: they see the most keys): their scores against 64 keys
   at a time (a round), the rows' softmax on the 16 x (up to) 512 scores in memory, and the
   weights times the values summed into 16 x d floats. Keys come in chunks of 512: the running maximum and
   sum rescale the sums between chunks (online softmax).

   The bf16 products read their second operand as pairs of rows side by side (the "VNNI"
   layout: a 32-bit lane holds two bf16 of the same column), so k and v are rearranged once per
   call, per key head: k as 16-key blocks of dim pairs (kt), v as key pairs of dims (vt), both
   padded with zero keys to a multiple of 64. In float32 k is rearranged as 16-key blocks of
   dims (a dim of 16 keys in one vector) and v is read where it is, key by key. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_math.h"

#if TILES && (!defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__))
#error "the tiles' attention needs AMX-BF16"
#endif
#if !TILES && !F32 && !defined(__AVX512BF16__)
#error "the dot products' attention needs AVX-512-BF16"
#endif
#if F32 && (TILES || !defined(__AVX512F__))
#error "the float32 attention needs AVX-512 and no tiles"
#endif

#define QB 16  /* query rows a task */
#define KC 512 /* keys a chunk */
#define LOWEST -1e30f /* a maximum before any score (finite: built with finite math) */

/* key (or value) row j of one key head: at `base` + j rows, or at the row `rows` names */
#define KV_ROW(base, rows, j, d) ((base) + ((rows) ? (rows)[j] : (j)) * (d))

#if TILES
typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* every tile 16 rows of 64 bytes: 16 x 16 float sums, 16 x 32 bf16 operands */
static void configure(void) {
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

#endif

#if F32
typedef float elem; /* q, k, v, out and the softmax's weights */
typedef float key_block; /* kt's lanes */

/* kt[(j * d + c) * 16 + key] = k[j * 16 + key][c]; zero past L */
static void pack_k(const float *k, const int64_t *rows, int64_t L, int64_t lp, int64_t d,
                   float *kt) {
  for (int64_t j = 0; j < lp / 16; j++)
    for (int64_t key = 0; key < 16; key++) {
      const int64_t row = j * 16 + key;
      const float *src = row < L ? KV_ROW(k, rows, row, d) : NULL;
      for (int64_t c = 0; c < d; c++) kt[(j * d + c) * 16 + key] = src ? src[c] : 0.f;
    }
}

#else
typedef uint16_t elem;
typedef uint32_t key_block;

/* kt[(j * d/2 + p) * 16 + key] (32-bit pairs) = k[j * 16 + key][2p, 2p + 1]; zero past L */
static void pack_k(const uint16_t *k, const int64_t *rows, int64_t L, int64_t lp, int64_t d,
                   uint32_t *kt) {
  const int64_t pairs = d / 2;
  for (int64_t j = 0; j < lp / 16; j++)
    for (int64_t key = 0; key < 16; key++) {
      const int64_t row = j * 16 + key;
      const uint32_t *src = row < L ? (const uint32_t *)KV_ROW(k, rows, row, d) : NULL;
      for (int64_t p = 0; p < pairs; p++)
        kt[(j * pairs + p) * 16 + key] = src ? src[p] : 0u;
    }
}

/* vt[(kp * d + c) * 2 + e] = v[2 kp + e][c]; zero past L */
static void pack_v(const uint16_t *v, const int64_t *rows, int64_t L, int64_t lp, int64_t d,
                   uint16_t *vt) {
  for (int64_t kp = 0; kp < lp / 2; kp++) {
    const int64_t r0 = 2 * kp, r1 = 2 * kp + 1;
    const uint16_t *v0 = r0 < L ? KV_ROW(v, rows, r0, d) : NULL;
    const uint16_t *v1 = r1 < L ? KV_ROW(v, rows, r1, d) : NULL;
    for (int64_t c = 0; c < d; c++) {
      vt[(kp * d + c) * 2] = v0 ? v0[c] : 0;
      vt[(kp * d + c) * 2 + 1] = v1 ? v1[c] : 0;
    }
  }
}

#endif

#if F32 /* R query rows against four 16-key blocks (or 64 dims) at a time, 4R sums in
           registers: six rows, then six, then four (QB = 16). Against four rows a pass on an
           AMD EPYC Zen 4 (two threads, 9 query heads and 3 key heads of 64, 30 calls, ten
           alternated rounds): 0.89-0.93x the time for a 512-token prompt, 0.87-0.95x for 16
           chunks of 64 tokens after 512 cached; the same sums in the same order */

/* rows 0..R of qpad against the four key blocks at kb: s[(b * 16 + row) * 16 + key] */
#define SCORE_ROWS(R)                                                                        \
  static void score_rows_##R(const float *qpad, const float *kb, int64_t d, float *s) {      \
    __m512 acc[R][4];                                                                        \
    _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++)                                   \
      _Pragma("GCC unroll 4") for (int b = 0; b < 4; b++) acc[rr][b] = _mm512_setzero_ps();  \
    for (int64_t c = 0; c < d; c++) {                                                        \
      __m512 kv[4];                                                                          \
      _Pragma("GCC unroll 4") for (int b = 0; b < 4; b++)                                    \
        kv[b] = _mm512_load_ps(kb + (b * d + c) * 16);                                       \
      _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++) {                               \
        const __m512 qv = _mm512_set1_ps(qpad[rr * d + c]);                                  \
        _Pragma("GCC unroll 4") for (int b = 0; b < 4; b++)                                  \
          acc[rr][b] = _mm512_fmadd_ps(qv, kv[b], acc[rr][b]);                               \
      }                                                                                      \
    }                                                                                        \
    _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++)                                   \
      _Pragma("GCC unroll 4") for (int b = 0; b < 4; b++)                                    \
        _mm512_store_ps(s + (b * 16 + rr) * 16, acc[rr][b]);                                 \
  }
SCORE_ROWS(6)
SCORE_ROWS(4)
_Static_assert(QB == 6 + 6 + 4, "the float32 passes take a task's rows as 6, 6 and 4");

static void scores(const float *qpad, const float *kt, int64_t c0, int64_t cnp, int64_t d,
                   float *s) {
  const float *kc = kt + (c0 / 16) * d * 16; /* the chunk's first key block */
  for (int64_t j = 0; j < cnp / 16; j += 4) {
    const float *kb = kc + j * d * 16;
    score_rows_6(qpad, kb, d, s + j * 16 * 16);
    score_rows_6(qpad + 6 * d, kb, d, s + (j * 16 + 6) * 16);
    score_rows_4(qpad + 12 * d, kb, d, s + (j * 16 + 12) * 16);
  }
}

/* o[R][64 dims from dg] += p[R][0, cn) v[c0 .. c0 + cn] (v's rows of one key head, read in
   place: at v, or where `rows` names them) */
#define WEIGH_ROWS(R)                                                                        \
  static void weigh_rows_##R(const float *p, const float *v, const int64_t *rows, int64_t c0, \
                             int64_t cn, int64_t d, int64_t dg, float *o) {                   \
    __m512 acc[R][4];                                                                        \
    _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++)                                   \
      _Pragma("GCC unroll 4") for (int b = 0; b < 4; b++)                                    \
        acc[rr][b] = _mm512_loadu_ps(o + rr * d + dg + 16 * b);                              \
    for (int64_t key = 0; key < cn; key++) {                                                 \
      const float *vb = KV_ROW(v, rows, c0 + key, d) + dg;                                   \
      __m512 vv[4];                                                                          \
      _Pragma("GCC unroll 4") for (int b = 0; b < 4; b++) vv[b] = _mm512_loadu_ps(vb + 16 * b); \
      _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++) {                               \
        const __m512 pv = _mm512_set1_ps(p[rr * KC + key]);                                  \
        _Pragma("GCC unroll 4") for (int b = 0; b < 4; b++)                                  \
          acc[rr][b] = _mm512_fmadd_ps(pv, vv[b], acc[rr][b]);                               \
      }                                                                                      \
    }                                                                                        \
    _Pragma("GCC unroll 8") for (int rr = 0; rr < R; rr++)                                   \
      _Pragma("GCC unroll 4") for (int b = 0; b < 4; b++)                                    \
        _mm512_storeu_ps(o + rr * d + dg + 16 * b, acc[rr][b]);                              \
  }
WEIGH_ROWS(6)
WEIGH_ROWS(4)

/* o[16][d] += p[16][0, cn) v[c0 .. c0 + cn] */
static void weigh(const float *p, const float *v, const int64_t *rows, int64_t c0, int64_t cn,
                  int64_t d, float *o) {
  for (int64_t dg = 0; dg < d; dg += 64) {
    weigh_rows_6(p, v, rows, c0, cn, d, dg, o);
    weigh_rows_6(p + 6 * KC, v, rows, c0, cn, d, dg, o + 6 * d);
    weigh_rows_4(p + 12 * KC, v, rows, c0, cn, d, dg, o + 12 * d);
  }
}

#elif TILES
/* the scores of 16 query rows (qpad) against keys c0 .. c0 + cnp of kt, each 16 keys' tile
   stored whole: s[(j * 16 + row) * 16 + key] for key block j. The query's tiles stay loaded;
   64 dims take 64 keys a round (four sums in flight), 128 dims 32 keys. */
static void scores(const uint16_t *qpad, const uint32_t *kt, int64_t c0, int64_t cnp, int64_t d,
                   float *s) {
  const uint32_t *kc = kt + (c0 / 16) * (d / 2) * 16; /* the chunk's first key block */
/* sum C += the query's dims 32 db on (tile Q) times key block b's (through tile T); a key
   block's dims 32 db on start at kb + (b * d/2 + db * 16) * 16 */
#define KEYS(C, Q, T, b, db)                                       \
  _tile_loadd(T, kb + ((b) * (d / 2) + (db) * 16) * 16, 64);       \
  _tile_dpbf16ps(C, Q, T);
  if (d == 64) { /* the query in tiles 4-5, four key blocks (tiles 0-3) a round */
    _tile_loadd(4, qpad, 128);
    _tile_loadd(5, qpad + 32, 128);
    for (int64_t j = 0; j < cnp / 16; j += 4) {
      const uint32_t *kb = kc + j * 32 * 16;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      KEYS(0, 4, 6, 0, 0) KEYS(1, 4, 7, 1, 0) KEYS(2, 4, 6, 2, 0) KEYS(3, 4, 7, 3, 0)
      KEYS(0, 5, 6, 0, 1) KEYS(1, 5, 7, 1, 1) KEYS(2, 5, 6, 2, 1) KEYS(3, 5, 7, 3, 1)
      _tile_stored(0, s + j * 256, 64);
      _tile_stored(1, s + (j + 1) * 256, 64);
      _tile_stored(2, s + (j + 2) * 256, 64);
      _tile_stored(3, s + (j + 3) * 256, 64);
    }
  } else { /* 128 dims: the query in tiles 4-7, two key blocks (tiles 0-1) a round */
    _tile_loadd(4, qpad, 256);
    _tile_loadd(5, qpad + 32, 256);
    _tile_loadd(6, qpad + 64, 256);
    _tile_loadd(7, qpad + 96, 256);
    for (int64_t j = 0; j < cnp / 16; j += 2) {
      const uint32_t *kb = kc + j * 64 * 16;
      _tile_zero(0);
      _tile_zero(1);
      KEYS(0, 4, 2, 0, 0) KEYS(1, 4, 3, 1, 0) KEYS(0, 5, 2, 0, 1) KEYS(1, 5, 3, 1, 1)
      KEYS(0, 6, 2, 0, 2) KEYS(1, 6, 3, 1, 2) KEYS(0, 7, 2, 0, 3) KEYS(1, 7, 3, 1, 3)
      _tile_stored(0, s + j * 256, 64);
      _tile_stored(1, s + (j + 1) * 256, 64);
    }
  }
#undef KEYS
}

/* o[16][d] += p[16][0, cnp) v[c0 .. c0 + cnp], 64 dims (four tiles) at a time */
static void weigh(const uint16_t *p, const uint16_t *vt, int64_t c0, int64_t cnp, int64_t d,
                  float *o) {
  for (int64_t dg = 0; dg < d; dg += 64) {
    _tile_loadd(0, o + dg, d * 4);
    _tile_loadd(1, o + dg + 16, d * 4);
    _tile_loadd(2, o + dg + 32, d * 4);
    _tile_loadd(3, o + dg + 48, d * 4);
    for (int64_t kb = 0; kb < cnp / 32; kb++) {
      const uint16_t *vb = vt + (c0 / 2 + kb * 16) * d * 2 + dg * 2;
      _tile_loadd(4, p + kb * 32, KC * 2);
      _tile_loadd(5, vb, d * 4);
      _tile_loadd(6, vb + 32, d * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, vb + 64, d * 4);
      _tile_loadd(6, vb + 96, d * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, o + dg, d * 4);
    _tile_stored(1, o + dg + 16, d * 4);
    _tile_stored(2, o + dg + 32, d * 4);
    _tile_stored(3, o + dg + 48, d * 4);
  }
}

#else /* AVX-512-BF16 dot products: four query rows against four 16-key blocks (or 64 dims)
         at a time, sixteen sums in registers */

/* the pair of bf16 at `at` (32 bits) in every lane */
static inline __m512bh pair(const void *at) {
  return (__m512bh)_mm512_set1_epi32(*(const int32_t *)at);
}

static void scores(const uint16_t *qpad, const uint32_t *kt, int64_t c0, int64_t cnp, int64_t d,
                   float *s) {
  const int64_t pairs = d / 2;
  const uint32_t *kc = kt + (c0 / 16) * pairs * 16; /* the chunk's first key block */
  for (int64_t j = 0; j < cnp / 16; j += 4) {
    const uint32_t *kb = kc + j * pairs * 16;
    for (int64_t r = 0; r < QB; r += 4) {
      __m512 acc[4][4];
#pragma GCC unroll 4
      for (int rr = 0; rr < 4; rr++)
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) acc[rr][b] = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; p++) {
        __m512bh kv[4];
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++)
          kv[b] = (__m512bh)_mm512_loadu_si512(kb + (b * pairs + p) * 16);
#pragma GCC unroll 4
        for (int rr = 0; rr < 4; rr++) {
          const __m512bh qv = pair(qpad + (r + rr) * d + 2 * p);
#pragma GCC unroll 4
          for (int b = 0; b < 4; b++) acc[rr][b] = _mm512_dpbf16_ps(acc[rr][b], qv, kv[b]);
        }
      }
#pragma GCC unroll 4
      for (int rr = 0; rr < 4; rr++)
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) _mm512_store_ps(s + ((j + b) * 16 + r + rr) * 16, acc[rr][b]);
    }
  }
}

static void weigh(const uint16_t *p, const uint16_t *vt, int64_t c0, int64_t cnp, int64_t d,
                  float *o) {
  for (int64_t dg = 0; dg < d; dg += 64)
    for (int64_t r = 0; r < QB; r += 4) {
      __m512 acc[4][4];
#pragma GCC unroll 4
      for (int rr = 0; rr < 4; rr++)
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) acc[rr][b] = _mm512_loadu_ps(o + (r + rr) * d + dg + 16 * b);
      for (int64_t kp = 0; kp < cnp / 2; kp++) {
        const uint16_t *vb = vt + (c0 / 2 + kp) * d * 2 + dg * 2;
        __m512bh vv[4];
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) vv[b] = (__m512bh)_mm512_loadu_si512(vb + 32 * b);
#pragma GCC unroll 4
        for (int rr = 0; rr < 4; rr++) {
          const __m512bh pv = pair(p + (r + rr) * KC + 2 * kp);
#pragma GCC unroll 4
          for (int b = 0; b < 4; b++) acc[rr][b] = _mm512_dpbf16_ps(acc[rr][b], pv, vv[b]);
        }
      }
#pragma GCC unroll 4
      for (int rr = 0; rr < 4; rr++)
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) _mm512_storeu_ps(o + (r + rr) * d + dg + 16 * b, acc[rr][b]);
    }
}
#endif

/* e^x for x <= 0, 16 at a time: 2^(x log2 e) as a polynomial of the fraction, scaled by 2 to
   the integer part (scalef: 0 far below the float range, so no clamp). bf16: degree 4 (2.7e-6
   relative error, far below the weights' bf16 rounding); float32: native_math.h's degree 6
   (about 1e-7, float32's own rounding) */
static inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, i);
#if F32
  __m512 p = _mm512_set1_ps(EXP2_C6);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C5));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C0));
#else
  __m512 p = _mm512_set1_ps(1.353560854e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.201292971e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.414383998e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930057245e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000002445f));
#endif
  return _mm512_scalef_ps(p, i);
}

/* 16 floats into elements at `dst` (bf16 rounded to nearest even) */
static inline void store16(elem *dst, __m512 x) {
#if F32
  _mm512_storeu_ps(dst, x);
#else
  _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(x));
#endif
}

/* the first `lim` of 16 lanes */
static inline __mmask16 first(int64_t lim) {
  return lim >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << lim) - 1u);
}

/* one row's softmax over `lim` valid scores of cnp (the row's 16 scores of key block j at
   s + j * 256): weights into p (zero past lim), the running maximum m and sum l updated, the
   row's sums so far (o, d floats) rescaled */
static void softmax_row(const float *s, int64_t lim, int64_t cnp, float scale, elem *p,
                        float *m, float *l, float *o, int64_t d) {
  if (lim <= 0) {
    memset(p, 0, cnp * sizeof(elem));
    return;
  }
  __m512 vmax = _mm512_set1_ps(LOWEST);
  for (int64_t t = 0; t < lim; t += 16)
    vmax = _mm512_mask_max_ps(vmax, first(lim - t), vmax, _mm512_load_ps(s + t * 16));
  const float mx = _mm512_reduce_max_ps(vmax) * scale;
  const float m_new = *m > mx ? *m : mx;
  const float alpha = exp_nonpos(*m - m_new); /* ~0 on the first chunk: l and o are 0 */
  const __m512 vscale = _mm512_set1_ps(scale), vm = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t < lim; t += 16) {
    const __m512 w = _mm512_maskz_mov_ps(
        first(lim - t), exp16(_mm512_fmsub_ps(_mm512_load_ps(s + t * 16), vscale, vm)));
    vsum = _mm512_add_ps(vsum, w);
    store16(p + t, w);
  }
  for (; t < cnp; t += 16) store16(p + t, _mm512_setzero_ps());
  *l = *l * alpha + _mm512_reduce_add_ps(vsum);
  *m = m_new;
  if (alpha != 1.f)
    for (int64_t c = 0; c < d; c += 16)
      _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), _mm512_set1_ps(alpha)));
}

void extend_attention(const elem *q, const elem *k, const elem *v, const int64_t *kv_rows,
                      elem *out, int64_t n, int64_t L, int64_t hq, int64_t hk, int64_t d,
                      float scale, int threads) {
  const int64_t lp = (L + 63) / 64 * 64, prefix = L - n, group = hq / hk;
  const int64_t nqb = (n + QB - 1) / QB;
/* key head h's first row (contiguous k, v) or its row numbers (the pool's) */
#define HEAD(buf, h) (kv_rows ? (buf) : (buf) + (h) * L * d)
#define HEAD_ROWS(h) (kv_rows ? kv_rows + (h) * L : NULL)
  /* the keys rearranged (k's bytes, padded to lp keys); bf16 the values too */
  const int64_t k_lanes = lp * d * (int64_t)sizeof(elem) / (int64_t)sizeof(key_block);
  key_block *kt = aligned_alloc(64, (size_t)(hk * lp * d) * sizeof(elem));
#if F32
  const float *vt = v;
  const int64_t v_stride = kv_rows ? 0 : L * d; /* on the pool every head reads from v */
#else
  uint16_t *vt = aligned_alloc(64, (size_t)(hk * lp * d * 2));
  const int64_t v_stride = lp * d;
#endif
#pragma omp parallel num_threads(threads)
  {
#if F32
#pragma omp for schedule(static)
    for (int64_t h = 0; h < hk; h++) pack_k(HEAD(k, h), HEAD_ROWS(h), L, lp, d, kt + h * k_lanes);
#else
#pragma omp for schedule(static)
    for (int64_t h = 0; h < 2 * hk; h++) {
      if (h < hk)
        pack_k(HEAD(k, h), HEAD_ROWS(h), L, lp, d, kt + h * k_lanes);
      else
        pack_v(HEAD(v, h - hk), HEAD_ROWS(h - hk), L, lp, d, vt + (h - hk) * v_stride);
    }
#endif
#if TILES
    configure();
#endif
    float *s = aligned_alloc(64, QB * KC * 4);
    elem *p = aligned_alloc(64, QB * KC * sizeof(elem));
    float *o = aligned_alloc(64, (size_t)(QB * d * 4));
    elem *qpad = aligned_alloc(64, (size_t)(QB * d) * sizeof(elem));
    float m[QB], l[QB];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < nqb * hq; task++) {
      const int64_t qb = nqb - 1 - task / hq, head = task % hq, kvh = head / group;
      const int64_t i0 = qb * QB, rows = n - i0 < QB ? n - i0 : QB;
      const key_block *ktk = kt + kvh * k_lanes;
      const elem *vtk = vt + kvh * v_stride;
      for (int64_t r = 0; r < QB; r++) {
        if (r < rows)
          memcpy(qpad + r * d, q + ((i0 + r) * hq + head) * d, d * sizeof(elem));
        else
          memset(qpad + r * d, 0, d * sizeof(elem));
        m[r] = LOWEST;
        l[r] = 0.f;
      }
      memset(o, 0, QB * d * 4);
      const int64_t kv_end = prefix + i0 + rows; /* the last row's keys */
      for (int64_t c0 = 0; c0 < kv_end; c0 += KC) {
        const int64_t cn = kv_end - c0 < KC ? kv_end - c0 : KC, cnp = (cn + 63) / 64 * 64;
        scores(qpad, ktk, c0, cnp, d, s);
        for (int64_t r = 0; r < QB; r++) {
          const int64_t seen = prefix + i0 + r + 1 - c0; /* row r's keys in this chunk */
          const int64_t lim = r >= rows ? 0 : (seen < cn ? seen : cn);
          softmax_row(s + r * 16, lim, cnp, scale, p + r * KC, m + r, l + r, o + r * d, d);
        }
#if F32
        weigh(p, vtk, HEAD_ROWS(kvh), c0, cn, d, o); /* v read in place: only the chunk's keys */
#else
        weigh(p, vtk, c0, cnp, d, o);
#endif
      }
      for (int64_t r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / l[r]);
        elem *dst = out + ((i0 + r) * hq + head) * d;
        for (int64_t c = 0; c < d; c += 16)
          store16(dst + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), inv));
      }
    }
#if TILES
    _tile_release();
#endif
    free(s);
    free(p);
    free(o);
    free(qpad);
  }
  free(kt);
#if !F32
  free(vt);
#endif
#undef HEAD
#undef HEAD_ROWS
}
