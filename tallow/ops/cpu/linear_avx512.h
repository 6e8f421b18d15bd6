// The block-quantized linear kernel on AVX-512 VNNI (included by kernels.c when compiled for
// it): vpdpwssd multiplies 32 int16 pairs and adds each pair's two products to one of 16 int32
// lanes, and here each lane is one output channel, so a block's dot products need no
// horizontal sums.
//
// Weights are stored in tiles of NT = 16 output channels (the last tile padded with zero
// channels); for tile t and block b:
//   Q4: 8 groups of 32 bytes; group g holds elements 4g .. 4g+3 of the 16 channels: byte
//       2c + e = q(c, 4g + e) | q(c, 4g + 2 + e) << 4 (e = 0, 1). Widened to int16, one mask
//       and one shift give two vectors whose 32-bit lane c holds (q(c, 4g), q(c, 4g + 1)) and
//       (q(c, 4g + 2), q(c, 4g + 3)).
//   Q8: 16 groups of 32 int8; group j: byte 2c + e = q(c, 2j + e); widened to int16, lane c
//       holds (q(c, 2j), q(c, 2j + 1)).
// d (and Q4's m) [tiles][nb][NT] float16, a block's 16 channels side by side.
//
// So a block's j-th weight vector (j = 0..15) multiplies the activation pair (x[2j], x[2j+1])
// broadcast to every lane; after the 16, lane c holds channel c's exact integer dot product
// over the block (|sum| < 2^24 for Q4, exact in float; Q8's is rounded to float's 24 bits). It
// goes into channel c's float accumulator as acc += sum * (d_w * d_x), block by block in
// order; Q4's m term (sum_b m_b * d_x * sum(q_x)) is a second accumulator, added at the end.
// Every row is computed by this arithmetic in this order whatever the rows around it and the
// threads (threads split the tiles; an integer sum is exact in any grouping), so a row's
// result does not depend on the batch.
//
// A tile's blocks are visited once per CHUNK rows: each block's weights are widened into
// registers once and run against every row of the chunk, ROWS rows at a time, the rows'
// float accumulators in a small per-thread buffer.

#define NT 16
#define ROWS 4
#define CHUNK 64
#define PREFETCH 1024  // bytes of Q4 weights ahead of the current block (Q8: twice that)

static inline __attribute__((always_inline)) void load_block(const uint8_t *wb, int q8, __m512i w[16]) {
    if (q8) {
        for (int j = 0; j < 16; j++) w[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wb + 32 * j)));
        return;
    }
    const __m512i lo = _mm512_set1_epi16(0x0F);
    for (int g = 0; g < 8; g++) {
        const __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wb + 32 * g)));
        w[2 * g] = _mm512_and_si512(t, lo);
        w[2 * g + 1] = _mm512_srli_epi16(t, 4);
    }
}

// acc += w * (x[0], x[1]) in every lane: the pair broadcast from memory within the instruction
// (gcc loads it with a separate vpbroadcastd otherwise).
static inline __attribute__((always_inline)) __m512i dpwssd_bcast(__m512i acc, __m512i w, const int16_t *x) {
    typedef int32_t __attribute__((may_alias)) pair;
    __asm__("vpdpwssd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*(const pair *)x));
    return acc;
}

// The block's integer dot products of R rows (xb[r]: 32 int16 activations each) with the 16
// channels, each row in CH independent chains of vpdpwssd (their latency hidden).
static inline __attribute__((always_inline)) void block_dots(const __m512i w[16], const int16_t *const *xb, int R,
                                                              int CH, __m512i *sums) {
    __m512i a[ROWS * 4];
    for (int i = 0; i < R * CH; i++) a[i] = _mm512_setzero_si512();
    for (int j = 0; j < 16; j += CH)
        for (int r = 0; r < R; r++)
            for (int c = 0; c < CH; c++)
                a[r * CH + c] = dpwssd_bcast(a[r * CH + c], w[j + c], xb[r] + 2 * (j + c));
    for (int r = 0; r < R; r++) {
        __m512i s = a[r * CH];
        for (int c = 1; c < CH; c++) s = _mm512_add_epi32(s, a[r * CH + c]);
        sums[r] = s;
    }
}

// One row's float math for a block (d, mv: the block's weight scales and offsets; dx, sx: the
// row's): the dot accumulator a and Q4's m term am. linear_amx.h runs the same.
static inline __attribute__((always_inline)) void block_scale(__m512i sum, __m512 d, __m512 mv, float dx, float sx,
                                                               int q4, __m512 *a, __m512 *am) {
    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(dx)), *a);
    if (q4) *am = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx), *am);
}

// R rows (from row m of the call, at acc in the chunk's accumulators) through block b.
static inline __attribute__((always_inline)) void rows_block(const qrows *r, int m, int R, int CH, int K, int b,
                                                              const __m512i w[16], __m512 d, __m512 mv, int q4,
                                                              float *acc) {
    const int nb = K / QK;
    const int16_t *xb[ROWS];
    for (int i = 0; i < R; i++) xb[i] = r->q + (size_t)(m + i) * K + (size_t)b * QK;
    __m512i sums[ROWS];
    block_dots(w, xb, R, CH, sums);
    for (int i = 0; i < R; i++) {
        float *ai = acc + (size_t)i * 2 * NT;
        const size_t k = (size_t)(m + i) * nb + b;
        __m512 a = _mm512_load_ps(ai), am = _mm512_load_ps(ai + NT);
        block_scale(sums[i], d, mv, r->d[k], r->s[k], q4, &a, &am);
        _mm512_store_ps(ai, a);
        if (q4) _mm512_store_ps(ai + NT, am);
    }
}

#include "linear_amx.h"  // the same loop on AMX tiles, for many rows where the CPU runs them

// y[M, N] = x[M, K] @ W^T (+ bias), W in tiles (above): Q4: wq [tiles][nb][8][32] bytes, wd and
// wm [tiles][nb][NT]; Q8: wq [tiles][nb][16][32] int8, wm NULL; tiles = ceil(N / NT).
// K % 32 == 0. Returns 0, or -1 out of memory.
static int linear(const float *x, int M, int K, int N, const uint8_t *wq, const uint16_t *wd,
                  const uint16_t *wm, const float *bias, float *y, int nthreads, int q8) {
    const int nb = K / QK, tiles = (N + NT - 1) / NT, chunk = M < CHUNK ? M : CHUNK;
    const size_t block_bytes = (size_t)NT * (q8 ? QK : QK / 2), tile_bytes = (size_t)nb * block_bytes;
    const int on_tiles = amx_on && M >= (q8 ? AMX_MIN_ROWS_Q8 : AMX_MIN_ROWS_Q4);
    qrows r;
    if (quantize_rows(x, M, K, nthreads, q8, &r)) return -1;
    uint8_t *xs = NULL;  // the tiles' operands
    if (on_tiles) {
        xs = (uint8_t *)aligned_alloc(64, (size_t)nb * 64 * (size_t)M);
        if (!xs) {
            free_rows(&r);
            return -1;
        }
        amx_split_rows(&r, M, K, nthreads, q8, xs);
    }
    // many rows: tiles handed out by work_claim, else a static schedule (tile_walk)
    work_range *work = NULL;
    if (M >= STEAL_MIN_ROWS && !(work = work_ranges(nthreads, tiles))) {
        free(xs);
        free_rows(&r);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *acc = (float *)aligned_alloc(64, sizeof(float) * 2 * NT * (size_t)chunk);  // per row: dot, m
        amx_scratch scratch = {0};
        const int broken = !acc || (on_tiles && amx_scratch_alloc(&scratch));
        if (broken) {
#pragma omp atomic write
            failed = 1;
        }
        tile_walk walk = tile_walk_start(work, nthreads, tiles);  // this thread's tiles
        for (int t; !broken && (t = next_tile(&walk)) >= 0;) {
            const uint8_t *wt = wq + (size_t)t * tile_bytes;
            const uint16_t *dt = wd + (size_t)t * nb * NT, *mt = wm ? wm + (size_t)t * nb * NT : NULL;
            const int cols = N - t * NT < NT ? N - t * NT : NT;
            const __mmask16 keep = (__mmask16)((1u << cols) - 1);
            const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + (size_t)t * NT) : _mm512_setzero_ps();
            for (int m0 = 0; m0 < M; m0 += chunk) {
                const int rows = M - m0 < chunk ? M - m0 : chunk;
                if (on_tiles) {
                    amx_tile_rows(wt, dt, mt, block_bytes, nb, q8, &r, xs, m0, rows, acc, &scratch);
                } else {
                    memset(acc, 0, sizeof(float) * 2 * NT * (size_t)rows);
                    for (int b = 0; b < nb; b++) {
                        const uint8_t *wb = wt + (size_t)b * block_bytes;
                        for (size_t p = 0; p < block_bytes; p += 64)  // the hardware's prefetch alone lags
                            _mm_prefetch((const char *)(wb + (q8 ? 2 : 1) * PREFETCH + p), _MM_HINT_T0);
                        __m512i w[16];
                        load_block(wb, q8, w);
                        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + NT * b)));
                        const __m512 mv = mt ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mt + NT * b)))
                                             : _mm512_setzero_ps();
                        int i = 0;
                        for (; i + ROWS <= rows; i += ROWS)
                            rows_block(&r, m0 + i, ROWS, 2, K, b, w, d, mv, mt != NULL, acc + (size_t)i * 2 * NT);
                        for (; i < rows; i++)
                            rows_block(&r, m0 + i, 1, 4, K, b, w, d, mv, mt != NULL, acc + (size_t)i * 2 * NT);
                    }
                }
                for (int i = 0; i < rows; i++) {
                    const float *ai = acc + (size_t)i * 2 * NT;
                    __m512 out = _mm512_add_ps(_mm512_load_ps(ai), _mm512_load_ps(ai + NT));
                    if (bias) out = _mm512_add_ps(out, bv);
                    _mm512_mask_storeu_ps(y + (size_t)(m0 + i) * N + (size_t)t * NT, keep, out);
                }
            }
        }
        amx_scratch_free(&scratch);
        free(acc);
    }
    free(work);
    free(xs);
    free_rows(&r);
    return failed ? -1 : 0;
}
