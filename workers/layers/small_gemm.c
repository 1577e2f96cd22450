/* y = x W^T for a few rows of bf16 input against a plain bf16 weight `[N, K]` (CPU, AVX-512
   BF16): the decode step's linear layers, where the GEMM library on an unpacked weight reads
   it at a fraction of the memory bandwidth. Built by workers/native_build.py, loaded with
   ctypes (workers/layers/small_gemm.py). Float32 accumulation, the result rounded to bf16 to
   nearest even (as torch rounds).

   Up to ROWS_MAX rows, "rows" kernel: per block of NB weight rows, MB input rows at a time,
   each dot product in a 16-lane accumulator of bf16 pair products (`vdpbf16ps`), summed
   across lanes at the end; the weight block is read from memory once and reused from cache
   for every input row. More rows, "lanes" kernel: the input is transposed once into k-pairs of
   16 rows (`xt`), and each weight pair is broadcast against it, so 16 rows advance in one
   instruction with no sum across lanes. Both split the weight rows between the OpenMP
   threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int small_gemm_native(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return 1;
#else
  return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "native_math.h"

#define NB 4        /* weight rows per block, rows kernel */
#define NT 8        /* weight rows per block, lanes kernel */
#define ROWS_MAX 4  /* the rows kernel takes up to this many input rows */
/* the `count` weight rows of a block from row n0, the first nn of them real: the others repeat
   row n0 (their results are not written) */
INLINE void block_rows(const uint16_t **rows, const uint16_t *w, int64_t n0, int nn, int count,
                       int64_t K) {
  for (int j = 0; j < count; j++) rows[j] = w + (n0 + (j < nn ? j : 0)) * K;
}

/* MB input rows from m0 against a block's NB weight rows (`block_rows`) */
#define ROWS(MB)                                                                               \
  INLINE void rows##MB(const uint16_t *x, const uint16_t *const *wr, uint16_t *y, int64_t m0,  \
                       int64_t n0, int nn, int64_t N, int64_t K) {                             \
    const int64_t kfull = K / 32 * 32;                                                         \
    const __mmask32 tail = (__mmask32)((1ull << (K - kfull)) - 1);                             \
    __m512 acc[MB][NB];                                                                        \
    for (int i = 0; i < MB; i++)                                                               \
      for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();                            \
    for (int64_t k = 0; k < kfull; k += 32) {                                                  \
      __m512bh wv[NB];                                                                         \
      for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);            \
      for (int i = 0; i < MB; i++) {                                                           \
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * K + k);                \
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);       \
      }                                                                                        \
    }                                                                                          \
    if (tail) {                                                                                \
      __m512bh wv[NB];                                                                         \
      for (int j = 0; j < NB; j++)                                                             \
        wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr[j] + kfull);                       \
      for (int i = 0; i < MB; i++) {                                                           \
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + (m0 + i) * K + kfull); \
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);       \
      }                                                                                        \
    }                                                                                          \
    for (int i = 0; i < MB; i++)                                                               \
      for (int j = 0; j < nn; j++)                                                             \
        y[(m0 + i) * N + n0 + j] = to_bf16(_mm512_reduce_add_ps(acc[i][j]));                   \
  }
ROWS(1)
ROWS(2)
ROWS(3)
ROWS(4)

static void gemm_rows(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N,
                      int64_t K, int threads) {
  const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t n0 = b * NB;
    const int nn = (int)(N - n0 < NB ? N - n0 : NB);
    const uint16_t *wr[NB];
    block_rows(wr, w, n0, nn, NB, K);
    if (b + 1 < blocks) /* the next block, while this one computes */
      for (int64_t line = 0; line < NB * K * 2; line += 64)
        __builtin_prefetch((const char *)(w + (n0 + NB) * K) + line, 0, 0);
    switch (M) {
      case 4: rows4(x, wr, y, 0, n0, nn, N, K); break;
      case 3: rows3(x, wr, y, 0, n0, nn, N, K); break;
      case 2: rows2(x, wr, y, 0, n0, nn, N, K); break;
      default: rows1(x, wr, y, 0, n0, nn, N, K); break;
    }
  }
}

/* K even: xt holds, per chunk of 16 input rows, each k pair of each row (rows past M zero) */
static void gemm_lanes(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N,
                       int64_t K, int threads) {
  const int64_t pairs = K / 2, chunks = (M + 15) / 16;
  const size_t bytes = (size_t)(chunks * pairs * 16 * 4 + 63) / 64 * 64;
  uint32_t *xt = aligned_alloc(64, bytes);
  if (xt == NULL) abort();
  for (int64_t c = 0; c < chunks; c++)
    for (int r = 0; r < 16; r++) {
      const int64_t m = c * 16 + r;
      const uint16_t *row = x + m * K;
      for (int64_t p = 0; p < pairs; p++) {
        uint32_t pair = 0;
        if (m < M) memcpy(&pair, row + 2 * p, 4);
        xt[(c * pairs + p) * 16 + r] = pair;
      }
    }
  const int64_t blocks = (N + NT - 1) / NT;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t n0 = b * NT;
    const int nn = (int)(N - n0 < NT ? N - n0 : NT);
    const uint16_t *wr[NT];
    block_rows(wr, w, n0, nn, NT, K);
    for (int64_t c = 0; c < chunks; c++) {
      __m512 acc[NT];
      for (int j = 0; j < NT; j++) acc[j] = _mm512_setzero_ps();
      const uint32_t *xc = xt + c * pairs * 16;
      for (int64_t p = 0; p < pairs; p++) {
        const __m512bh xv = (__m512bh)_mm512_load_si512(xc + p * 16);
        for (int j = 0; j < NT; j++) {
          uint32_t pair;
          memcpy(&pair, wr[j] + 2 * p, 4);
          acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_set1_epi32((int)pair));
        }
      }
      float tile[NT][16];
      for (int j = 0; j < NT; j++) _mm512_storeu_ps(tile[j], acc[j]);
      const int rows = (int)(M - c * 16 < 16 ? M - c * 16 : 16);
      for (int r = 0; r < rows; r++)
        for (int j = 0; j < nn; j++) y[(c * 16 + r) * N + n0 + j] = to_bf16(tile[j][r]);
    }
  }
  free(xt);
}

/* x [M, K], w [N, K], y [M, N]: bf16, row-major, contiguous; M >= 1 */
void small_gemm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N,
                     int64_t K, int threads) {
  if (M <= ROWS_MAX || K % 2)
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_MAX) {
      const int64_t rows = M - m0 < ROWS_MAX ? M - m0 : ROWS_MAX;
      gemm_rows(x + m0 * K, w, y + m0 * N, rows, N, K, threads);
    }
  else
    gemm_lanes(x, w, y, M, N, K, threads);
}
#else
void small_gemm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N,
                     int64_t K, int threads) {
  abort(); /* small_gemm_native() said no: never called */
}
#endif

/* ---- float32 (AVX2 + FMA) ----
   y = x W^T for a few float32 rows against a plain float32 weight `[N, K]`. Up to
   F32_ROWS_MAX rows, "rows" kernel: per block of NF weight rows (read from memory once), the
   input rows two at a time, each dot product in an 8-lane FMA accumulator summed across lanes
   at the end; the block stays in cache while the row pairs pass over it. More rows, "lanes"
   kernel: the input is transposed once into chunks of 16 rows (8 for a last chunk of no more
   than 8; `xt`, rows past M zero), and for each block of NLB weight rows every weight element
   is broadcast against its chunk's k column, so a chunk's rows advance together with no sum
   across lanes (past 4 rows the rows kernel is bound by its loads and sums). Both split the
   weight rows between the OpenMP threads. */

int small_gemm_f32_native(void) {
#if defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define NF 4 /* weight rows per block (4 weight rows x 2 input rows: 8 accumulators, the
                best of 2x4, 3x3, 3x4 and 4x3 on a Zen 3) */

static inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

/* MB (1 or 2) input rows from m0 against NF weight rows `wr`, the first nn of them real */
#define ROWS_F32(MB)                                                                           \
  static inline void rows_f32_##MB(const float *x, const float *const *wr, float *y,           \
                                   int64_t m0, int64_t n0, int nn, int64_t N, int64_t K) {     \
    const int64_t kfull = K / 8 * 8;                                                           \
    __m256 acc[MB][NF];                                                                        \
    for (int i = 0; i < MB; i++)                                                               \
      for (int j = 0; j < NF; j++) acc[i][j] = _mm256_setzero_ps();                            \
    for (int64_t k = 0; k < kfull; k += 8) {                                                   \
      __m256 wv[NF];                                                                           \
      for (int j = 0; j < NF; j++) wv[j] = _mm256_loadu_ps(wr[j] + k);                         \
      for (int i = 0; i < MB; i++) {                                                           \
        const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);                               \
        for (int j = 0; j < NF; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);        \
      }                                                                                        \
    }                                                                                          \
    for (int i = 0; i < MB; i++)                                                               \
      for (int j = 0; j < nn; j++) {                                                           \
        float s = hsum8(acc[i][j]);                                                            \
        for (int64_t k = kfull; k < K; k++) s += x[(m0 + i) * K + k] * wr[j][k];               \
        y[(m0 + i) * N + n0 + j] = s;                                                          \
      }                                                                                        \
  }
ROWS_F32(1)
ROWS_F32(2)

#define F32_ROWS_MAX 4 /* the rows kernel takes up to this many input rows */
#define NLB 12         /* weight rows per block, lanes kernel */

static void f32_rows(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                     int threads) {
  const int64_t blocks = (N + NF - 1) / NF;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t n0 = b * NF;
    const int nn = (int)(N - n0 < NF ? N - n0 : NF);
    const float *wr[NF];
    for (int j = 0; j < NF; j++) wr[j] = w + (n0 + (j < nn ? j : 0)) * K;
    if (b + 1 < blocks) /* the next block, while this one computes */
      for (int64_t line = 0; line < NF * K * 4; line += 64)
        __builtin_prefetch((const char *)(w + (n0 + NF) * K) + line, 0, 0);
    int64_t m0 = 0;
    for (; m0 + 2 <= M; m0 += 2) rows_f32_2(x, wr, y, m0, n0, nn, N, K);
    if (m0 < M) rows_f32_1(x, wr, y, m0, n0, nn, N, K);
  }
}

/* the lanes kernel on one chunk of `rows` input rows from m0, transposed in `xc` as V 8-lane
   vectors per k (lanes past `rows` zero), against weight rows `wr` [0, NJ) of a block: NJ x V
   accumulators (12) */
#define LANES_F32(V, NJ)                                                                       \
  static inline void lanes_f32_##V(const float *xc, const float *const *wr,                    \
                                   const float *const *next, float *y, int64_t m0, int rows,   \
                                   int64_t n0, int nn, int64_t N, int64_t K) {                 \
    __m256 acc[NJ][V];                                                                         \
    for (int j = 0; j < NJ; j++)                                                               \
      for (int v = 0; v < V; v++) acc[j][v] = _mm256_setzero_ps();                             \
    for (int64_t k = 0; k < K; k++) {                                                          \
      __m256 xv[V];                                                                            \
      for (int v = 0; v < V; v++) xv[v] = _mm256_load_ps(xc + (k * V + v) * 8);                \
      if (next != NULL && k % 16 == 0) /* a cache line of each row of the next block */        \
        for (int j = 0; j < NJ; j++) __builtin_prefetch(next[j] + k, 0, 3);                    \
      for (int j = 0; j < NJ; j++) {                                                           \
        const __m256 wv = _mm256_broadcast_ss(wr[j] + k);                                      \
        for (int v = 0; v < V; v++) acc[j][v] = _mm256_fmadd_ps(xv[v], wv, acc[j][v]);         \
      }                                                                                        \
    }                                                                                          \
    float tile[NJ][V * 8];                                                                     \
    for (int j = 0; j < NJ; j++)                                                               \
      for (int v = 0; v < V; v++) _mm256_storeu_ps(tile[j] + v * 8, acc[j][v]);               \
    for (int r = 0; r < rows; r++)                                                             \
      for (int j = 0; j < nn && j < NJ; j++) y[(m0 + r) * N + n0 + j] = tile[j][r];            \
  }
LANES_F32(1, 12)
LANES_F32(2, 6)

/* chunks of 16 rows, the last of 8 where no more than 8 are left; each chunk's columns k
   contiguous, at xt + m0 * K */
static void f32_lanes(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                      int threads) {
  const int64_t padded = (M + 7) / 8 * 8;
  float *xt = aligned_alloc(64, (size_t)(padded * K * 4 + 63) / 64 * 64);
  if (xt == NULL) abort();
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int width = M - m0 > 8 ? 16 : 8;
    for (int64_t k = 0; k < K; k++)
      for (int r = 0; r < width; r++)
        xt[m0 * K + k * width + r] = m0 + r < M ? x[(m0 + r) * K + k] : 0.0f;
  }
  const int64_t blocks = (N + NLB - 1) / NLB;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t n0 = b * NLB;
    const int nn = (int)(N - n0 < NLB ? N - n0 : NLB);
    const float *wr[NLB], *next[NLB];
    for (int j = 0; j < NLB; j++) {
      wr[j] = w + (n0 + (j < nn ? j : 0)) * K;
      next[j] = w + (n0 + NLB + j < N ? n0 + NLB + j : N - 1) * K; /* the last block: in place */
    }
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int rows = (int)(M - m0 < 16 ? M - m0 : 16);
      const float *const *pf = m0 == 0 ? next : NULL; /* the first chunk's pass fetches */
      if (rows > 8) {
        lanes_f32_2(xt + m0 * K, wr, pf, y, m0, rows, n0, nn, N, K);
        if (nn > 6)
          lanes_f32_2(xt + m0 * K, wr + 6, pf ? pf + 6 : NULL, y, m0, rows, n0 + 6, nn - 6, N, K);
      } else {
        lanes_f32_1(xt + m0 * K, wr, pf, y, m0, rows, n0, nn, N, K);
      }
    }
  }
  free(xt);
}

/* x [M, K], w [N, K], y [M, N]: float32, row-major, contiguous; M >= 1 */
void small_gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                    int threads) {
  if (M <= F32_ROWS_MAX)
    f32_rows(x, w, y, M, N, K, threads);
  else
    f32_lanes(x, w, y, M, N, K, threads);
}
#else
void small_gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                    int threads) {
  abort(); /* small_gemm_f32_native() said no: never called */
}
#endif
