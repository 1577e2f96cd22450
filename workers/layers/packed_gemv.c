/* Products of one or two rows with a bf16 weight in oneDNN's packed layout (packed.py),
   read in place: y[m, o] = sum_i x[m, i] W[o, i], bf16 in and out, float32 sums, rounded once
   (to nearest even, as oneDNN rounds). Built by workers/native_build.py, called with ctypes
   (packed_gemv.py).

   oneDNN packs a bf16 weight [out, in] for its AMX products as AB16b<BA>a2b: blocks of BA output
   rows (32 or 64, by the batch hint) by 32 inputs, the blocks of one output block consecutive;
   inside a block 16 pairs of inputs, each pair's BA outputs side by side, the pair's two
   inputs adjacent. So a pair of inputs meets 16 outputs' weights in one 64-byte load, and
   AVX-512-BF16's dot product of pairs (vdpbf16ps) takes them with the pair of x broadcast:
   the weight is read once, in order, in whole cache lines. packed_gemv.py checks the layout
   on each packed weight against oneDNN's own product before it uses this. */

#include <immintrin.h>
#include <stdint.h>

#if !defined(__AVX512BF16__) || !defined(__AVX512F__)
#error "the packed bf16 products need AVX-512-BF16"
#endif


/* R rows of output block ob, 16 * CH outputs (CH vectors); R and CH constants, so that the
   sums stay in registers */
#define BLOCK_PRODUCT(CH, R)                                                                   \
  do {                                                                                         \
    __m512 acc[R][CH];                                                                         \
    for (int m = 0; m < R; m++)                                                                \
      for (int c = 0; c < CH; c++) acc[m][c] = _mm512_setzero_ps();                            \
    const uint16_t *blk = w + ob * nib * 32 * (16 * CH);                                       \
    for (int64_t ib = 0; ib < nib; ib++) {                                                     \
      const uint16_t *wb = blk + ib * 32 * (16 * CH);                                          \
      for (int p = 0; p < 16; p++) {                                                           \
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

/* x [rows, ic] and y [rows, oc] bf16, contiguous; w the packed weight of [oc, ic] with output
   blocks of `block` (32 or 64); oc a multiple of block, ic of 32; rows 1 or 2 */
void packed_gemv_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows,
                      int64_t oc, int64_t ic, int64_t block, int threads) {
  const int64_t nob = oc / block, nib = ic / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t ob = 0; ob < nob; ob++) {
    switch ((rows - 1) * 2 + (block == 64)) {
      case 0: BLOCK_PRODUCT(2, 1); break;
      case 1: BLOCK_PRODUCT(4, 1); break;
      case 2: BLOCK_PRODUCT(2, 2); break;
      default: BLOCK_PRODUCT(4, 2); break;
    }
  }
}
