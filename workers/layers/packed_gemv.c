/* Products of a few rows with a weight in oneDNN's packed layout (packed.py), read in place:
   y[m, o] = sum_i x[m, i] W[o, i] with float32 sums. Built by workers/native_build.py, called
   with ctypes (packed_gemv.py). Three kernels: bf16 rows with AVX-512-BF16's dot products of
   pairs (`packed_gemv_bf16`, rounded once to bf16, to nearest even, as oneDNN rounds), bf16 up
   to a few dozen rows on the AMX tiles where the CPU has them (`packed_amx_bf16`), and float32
   rows with AVX-512's FMAs (`packed_gemv_f32`).

   oneDNN packs a bf16 weight [out, in] for its AMX products as AB16b<BA>a2b: blocks of BA output
   rows (32 or 64, by the batch hint) by 32 inputs, the blocks of one output block consecutive;
   inside a block 16 pairs of inputs, each pair's BA outputs side by side, the pair's two
   inputs adjacent. So a pair of inputs meets 16 outputs' weights in one 64-byte load, and
   AVX-512-BF16's dot product of pairs (vdpbf16ps) takes them with the pair of x broadcast:
   the weight is read once, in order, in whole cache lines. A float32 weight packed for a batch
   of more than one row is the same without the pairs: blocks of 64 output rows, each input's 64
   outputs side by side (for one row oneDNN keeps it as it is). packed_gemv.py checks the layout
   on each packed weight against oneDNN's own product before it uses this. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if !defined(__AVX512F__)
#error "the packed products need AVX-512"
#endif

/* rows a pass over an output block takes: 6 x 4 vectors of sums, the block's 4 weight vectors
   and x's broadcast in AVX-512's 32 registers. Against four a pass on an AMD EPYC Zen 4 (two
   threads, SmolLM2-135M's 30 layers and LM head from memory, medians of six passes): float32
   0.76-0.86x the time at 6 to 32 rows; bf16 0.87-0.94x at 6 to 16, 0.97-1.05x at 24 to 64 */
#define ROWS 6

/* R float32 rows of output block ob (64 outputs: four vectors), sums in registers. As it goes
   the pass also asks for `lines` cache lines of the next output block's weight (the block this
   thread takes next), from line `first`, spread evenly over its inputs: with several passes
   over a block the next block then streams in while they compute, where without it the first
   pass of each block waits on memory and the others on the cores */
#define F32_BLOCK_PRODUCT(R)                                                                   \
  do {                                                                                         \
    __m512 acc[R][4];                                                                          \
    for (int m = 0; m < R; m++)                                                                \
      for (int c = 0; c < 4; c++) acc[m][c] = _mm512_setzero_ps();                             \
    const float *blk = w + ob * ic * 64;                                                       \
    const char *next = (const char *)(blk + ic * 64) + first * 64;                             \
    int64_t due = 0;                                                                           \
    for (int64_t i = 0; i < ic; i++) {                                                         \
      for (due += lines; due >= ic; due -= ic, next += 64) _mm_prefetch(next, _MM_HINT_T2);    \
      __m512 wv[4];                                                                            \
      for (int c = 0; c < 4; c++) wv[c] = _mm512_loadu_ps(blk + i * 64 + c * 16);              \
      for (int m = 0; m < R; m++) {                                                            \
        const __m512 xv = _mm512_set1_ps(x[m * ic + i]);                                       \
        for (int c = 0; c < 4; c++) acc[m][c] = _mm512_fmadd_ps(wv[c], xv, acc[m][c]);         \
      }                                                                                        \
    }                                                                                          \
    for (int m = 0; m < R; m++)                                                                \
      for (int c = 0; c < 4; c++) _mm512_storeu_ps(y + m * oc + ob * 64 + c * 16, acc[m][c]);  \
  } while (0)

#define F32_FUNCTION(R)                                                                        \
  static void f32_block_##R(const float *x, const float *w, float *y, int64_t ob, int64_t ic,  \
                            int64_t oc, int64_t first, int64_t lines) {                        \
    F32_BLOCK_PRODUCT(R);                                                                      \
  }
F32_FUNCTION(1)
F32_FUNCTION(2)
F32_FUNCTION(3)
F32_FUNCTION(4)
F32_FUNCTION(5)
F32_FUNCTION(6)

typedef void (*f32_block_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t,
                             int64_t, int64_t);
static const f32_block_fn F32_BLOCKS[ROWS] = {f32_block_1, f32_block_2, f32_block_3,
                                              f32_block_4, f32_block_5, f32_block_6};

/* x [rows, ic] and y [rows, oc] float32, contiguous; w the packed weight of [oc, ic] in blocks
   of 64 outputs (`block`, for the same signature as the bf16 kernel: 64), oc a multiple of 64.
   Rows go ROWS at a time through each output block, as in the bf16 kernel below. From
   ROWS + ROWS / 2 rows each pass over a block asks for its share of the next block's 4 * ic
   cache lines (into L2, as the T2 hint places them); with fewer the passes after the first are
   too short to hide the reads (7 and 8 rows: 1.06-1.17x the time), and one pass alone streams
   with the core's own prefetchers (asking too was 1.1-1.4x). On an AMD EPYC Zen 4 (two threads,
   SmolLM2-135M's 30 layers and LM head from memory, 12-16 alternated passes, median of the
   pairs' ratios) the time against passes that do not ask: 0.94x at 9 rows, 0.86-0.93x at 10
   to 14, 0.83-0.84x at 16, 0.82-0.96x at 24, 0.86-0.88x at 32, 0.90-0.93x at 48. */
void packed_gemv_f32(const float *x, const float *w, float *y, int64_t rows, int64_t oc,
                     int64_t ic, int64_t block, int threads) {
  const int64_t nob = oc / block, passes = (rows + ROWS - 1) / ROWS;
  const int64_t share = rows >= ROWS + ROWS / 2 ? (4 * ic + passes - 1) / passes : 0;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t ob = 0; ob < nob; ob++)
    for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
      const int64_t r = rows - m0 < ROWS ? rows - m0 : ROWS;
      const int64_t lines = ob + 1 < nob ? share : 0;
      F32_BLOCKS[r - 1](x + m0 * ic, w, y + m0 * oc, ob, ic, oc, m0 / ROWS * share, lines);
    }
}


#if defined(__AVX512BF16__)
/* R rows of output block ob, 16 * CH outputs (CH vectors); R and CH constants, so that the
   sums stay in registers; `lines` of the next block's cache lines asked for from line `first`,
   as in F32_BLOCK_PRODUCT */
#define BLOCK_PRODUCT(CH, R)                                                                   \
  do {                                                                                         \
    __m512 acc[R][CH];                                                                         \
    for (int m = 0; m < R; m++)                                                                \
      for (int c = 0; c < CH; c++) acc[m][c] = _mm512_setzero_ps();                            \
    const uint16_t *blk = w + ob * nib * 32 * (16 * CH);                                       \
    const char *next = (const char *)(blk + nib * 32 * (16 * CH)) + first * 64;               \
    int64_t due = 0;                                                                           \
    for (int64_t ib = 0; ib < nib; ib++) {                                                     \
      const uint16_t *wb = blk + ib * 32 * (16 * CH);                                          \
      for (int p = 0; p < 16; p++) {                                                           \
        for (due += lines; due >= nib * 16; due -= nib * 16, next += 64)                       \
          _mm_prefetch(next, _MM_HINT_T2);                                                     \
        __m512bh wv[CH];                                                                       \
        for (int c = 0; c < CH; c++)                                                           \
          wv[c] = (__m512bh)_mm512_loadu_si512(wb + p * (32 * CH) + c * 32);                   \
        for (int m = 0; m < R; m++) {                                                          \
          int32_t pair;                                                                        \
          __builtin_memcpy(&pair, x + m * ic + ib * 32 + 2 * p, 4);                            \
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                               \
          for (int c = 0; c < CH; c++) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], wv[c], xv);     \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
    for (int m = 0; m < R; m++)                                                                \
      for (int c = 0; c < CH; c++)                                                             \
        _mm256_storeu_si256((__m256i *)(y + m * oc + ob * (16 * CH) + c * 16),                 \
                            (__m256i)_mm512_cvtneps_pbh(acc[m][c]));                           \
  } while (0)

/* R rows (x, y at their first) of output block ob with CH vectors of outputs: one function each */
#define BLOCK_FUNCTION(CH, R)                                                                  \
  static void block_##CH##_##R(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t ob,  \
                               int64_t nib, int64_t ic, int64_t oc, int64_t first,             \
                               int64_t lines) {                                                \
    BLOCK_PRODUCT(CH, R);                                                                      \
  }
BLOCK_FUNCTION(2, 1)
BLOCK_FUNCTION(2, 2)
BLOCK_FUNCTION(2, 3)
BLOCK_FUNCTION(2, 4)
BLOCK_FUNCTION(2, 5)
BLOCK_FUNCTION(2, 6)
BLOCK_FUNCTION(4, 1)
BLOCK_FUNCTION(4, 2)
BLOCK_FUNCTION(4, 3)
BLOCK_FUNCTION(4, 4)
BLOCK_FUNCTION(4, 5)
BLOCK_FUNCTION(4, 6)

typedef void (*block_fn)(const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t);
static const block_fn BLOCKS[2][ROWS] = {
    {block_2_1, block_2_2, block_2_3, block_2_4, block_2_5, block_2_6},
    {block_4_1, block_4_2, block_4_3, block_4_4, block_4_5, block_4_6}};

/* x [rows, ic] and y [rows, oc] bf16, contiguous; w the packed weight of [oc, ic] with output
   blocks of `block` (32 or 64); oc a multiple of block, ic of 32. Rows go ROWS at a time
   through each output block (up to 24 sums in registers): the block's weights come from the
   core's cache after the first pass, and from ROWS + ROWS / 2 rows each pass asks for its share
   of the next block's ic * block / 32 cache lines, as the float32 kernel does: on the Zen 4,
   0.90-0.94x the time of passes that do not ask at 9 to 64 rows (twelve alternated passes,
   median of the pairs' ratios). */
void packed_gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows,
                      int64_t oc, int64_t ic, int64_t block, int threads) {
  const int64_t nob = oc / block, nib = ic / 32, passes = (rows + ROWS - 1) / ROWS;
  const int64_t share = rows >= ROWS + ROWS / 2 ? (ic * block / 32 + passes - 1) / passes : 0;
  const block_fn *fns = BLOCKS[block == 64];
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t ob = 0; ob < nob; ob++)
    for (int64_t m0 = 0; m0 < rows; m0 += ROWS) {
      const int64_t r = rows - m0 < ROWS ? rows - m0 : ROWS;
      const int64_t lines = ob + 1 < nob ? share : 0;
      fns[r - 1](x + m0 * ic, w, y + m0 * oc, ob, nib, ic, oc, m0 / ROWS * share, lines);
    }
}


#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* The tiles. A block of 32 inputs of the packed weight is, for each 16 outputs, a tile of 16
   rows (the pairs of inputs) by 64 bytes (16 outputs' pairs), its rows 4 * block bytes apart:
   the B operand of the tiles' bf16 product as it lies in memory. x's rows, 32 inputs each, are
   the A operand, and each 16 outputs' sums one C tile of up to 16 rows. A block of 64 outputs
   takes four C tiles (0-3), x one (4), the weight three in turn (5-7). The tiles' product is
   far faster than memory: the kernel reads the weight once per 16 rows, at the speed one row
   does (AVX-512-BF16's dot products are bound by their own speed from three rows on). */

typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

static void configure(int rows) {
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 5; t++) {  /* C0-C3 and x: `rows` rows of 64 bytes */
    cfg.rows[t] = (uint8_t)rows;
    cfg.colsb[t] = 64;
  }
  for (int t = 5; t < 8; t++) {  /* the weight: 16 pairs of inputs by 16 outputs */
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

/* r <= 16 rows (tiles configured for r) of one output block `blk`, into y (its first output) */
static inline void tile_group(const uint16_t *x, const uint16_t *blk, uint16_t *y, float *c,
                              int64_t r, int64_t oc, int64_t ic, int64_t block) {
  const int64_t stride = 4 * block;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t ib = 0; ib < ic / 32; ib++) {
    const uint16_t *wb = blk + ib * 32 * block;
    _tile_loadd(4, x + ib * 32, ic * 2);
    _tile_loadd(5, wb, stride);
    _tile_loadd(6, wb + 32, stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    if (block == 64) {
      _tile_loadd(7, wb + 64, stride);
      _tile_loadd(5, wb + 96, stride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, block * 4);
  _tile_stored(1, c + 16, block * 4);
  if (block == 64) {
    _tile_stored(2, c + 32, block * 4);
    _tile_stored(3, c + 48, block * 4);
  }
  for (int64_t m = 0; m < r; m++)
    for (int64_t j = 0; j < block; j += 16)
      _mm256_storeu_si256((__m256i *)(y + m * oc + j),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + m * block + j)));
}

/* as packed_gemv_bf16, any number of rows (16 at a time); the caller has the tiles granted
   (cpu_features.amx_granted) */
void packed_amx_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows,
                     int64_t oc, int64_t ic, int64_t block, int threads) {
  const int64_t nob = oc / block, nib = ic / 32;
#pragma omp parallel num_threads(threads)
  {
    float c[16 * 64] __attribute__((aligned(64)));
    int configured = 0;
#pragma omp for schedule(static)
    for (int64_t ob = 0; ob < nob; ob++) {
      const uint16_t *blk = w + ob * nib * 32 * block;
      for (int64_t m0 = 0; m0 < rows; m0 += 16) {
        const int r = rows - m0 < 16 ? (int)(rows - m0) : 16;
        if (r != configured) {
          configure(r);
          configured = r;
        }
        tile_group(x + m0 * ic, blk, y + m0 * oc + ob * block, c, r, oc, ic, block);
      }
    }
    if (configured) _tile_release();
  }
}
#endif
#endif  /* __AVX512BF16__ */
