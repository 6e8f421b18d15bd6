// The block-quantized linear kernel on AVX2 (included by kernels.c where AVX-512 VNNI is not
// compiled in), over linear_avx512.h's weight layout: tiles of NT = 16 output channels (the
// last tile padded with zero channels), for tile t and block b:
//   Q4: 8 groups of 32 bytes; group g holds elements 4g .. 4g+3 of the 16 channels: byte
//       2c + e = q(c, 4g + e) | q(c, 4g + 2 + e) << 4 (e = 0, 1);
//   Q8: 16 groups of 32 int8; group j: byte 2c + e = q(c, 2j + e);
// d (and Q4's m) [tiles][nb][NT] float16.
//
// A 256-bit register holds 8 channels, one per 32-bit lane: a group's low 16 bytes (channels
// 0-7) and its high 16 bytes (channels 8-15) are widened to int16 apart (vpmovzxbw / vpmovsxbw;
// Q4: then one mask and one shift give the pairs (4g, 4g+1) and (4g+2, 4g+3)), and madd
// multiplies each by the activation pair broadcast to every lane, adding each pair's two
// products. One broadcast serves both halves; a row's two int32 accumulators (channels 0-7,
// 8-15) hold the block's exact dot products (|sum| < 2^24 for Q4; Q8's is rounded to float's
// 24 bits when converted), with no horizontal sums.
//
// The float arithmetic is linear_avx512.h's, lane for lane: per channel, acc += sum * (d_w *
// d_x) block by block in order, Q4's m term (sum_b m_b * d_x * sum(q_x)) in a second
// accumulator added at the end, then the bias. So the two builds compute the same floats, and
// a row's result does not depend on the rows around it or the threads (threads split the
// tiles; an integer sum is exact in any grouping).
//
// (Until stop 32, 2026-12-05, this build had a layout of its own, tiles of 4 channels two to a
// register, which needed a horizontal sum and a float conversion per 4 multiply-adds: 1.1-1.9x
// slower at 2-7,500 rows, level at one; benchmarks/HISTORY.md.)
//
// Many rows: the rows in chunks of about ROW_CHUNK_BYTES of activations (they stay in L2 while a
// thread's tiles go by: 1.03-1.1x at 512-2048 rows against a tile-outer loop), each block's
// weights widened once for every ROWS rows (registers hold ROWS rows' accumulators: 3 rows is
// the most that fits in 16 registers without spills; 4 with AVX-VNNI, whose products need no
// temporaries), the rows' float accumulators in a small per-thread buffer. One row (decode):
// blocks in order with the float accumulators in registers (row1).

#define NT 16
#if TL_VNNI256
#define ROWS 4
#else
#define ROWS 3
#endif
#define ROW_CHUNK_BYTES 65536
#define PREFETCH 2048  // bytes of Q4 weights ahead of the current block (Q8: 4x: measured best on Zen 3)

// Group g's four weight vectors: w[0], w[1] = the pair (2g) of channels 0-7, 8-15 (Q4: the
// elements 4g, 4g+1; Q8: 2(2g), 2(2g)+1), w[2], w[3] = the pair (2g+1) likewise. Q4 has 8 groups
// of pairs (2g, 2g+1) per block, Q8 16 groups of one pair, taken two at a time (g: 0..7 either).
static inline __attribute__((always_inline)) void group_weights(const uint8_t *wb, int q8, int g, __m256i w[4]) {
    if (q8) {
        const int8_t *p = (const int8_t *)wb + 64 * g;
        for (int i = 0; i < 4; i++) w[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * i)));
        return;
    }
    const __m256i lo = _mm256_set1_epi16(0x0F);
    const __m256i t0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + 32 * g)));
    const __m256i t1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + 32 * g + 16)));
    w[0] = _mm256_and_si256(t0, lo), w[1] = _mm256_and_si256(t1, lo);
    w[2] = _mm256_srli_epi16(t0, 4), w[3] = _mm256_srli_epi16(t1, 4);
}

// The block's integer dot products of R rows (x + i * K: 32 int16 activations each) with the 16
// channels: sums[2i] (channels 0-7), sums[2i + 1] (8-15).
static inline __attribute__((always_inline)) void block_dots(const uint8_t *wb, int q8, const int16_t *x, int K, int R,
                                                              __m256i *sums) {
    for (int i = 0; i < 2 * R; i++) sums[i] = _mm256_setzero_si256();
    // AVX-VNNI, one row: the pairs (4g + 2, 4g + 3) in chains of their own (four chains, not two:
    // their latency hidden); more rows have chains enough
    __m256i t[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        __m256i w[4];
        group_weights(wb, q8, g, w);
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const __m256i xa = pair_bcast(x + (size_t)i * K + 4 * g), xb = pair_bcast(x + (size_t)i * K + 4 * g + 2);
#if TL_VNNI256
            __m256i *sb = R == 1 ? t : sums + 2 * i;
            sums[2 * i] = dpwssd256(sums[2 * i], w[0], xa), sb[0] = dpwssd256(sb[0], w[2], xb);
            sums[2 * i + 1] = dpwssd256(sums[2 * i + 1], w[1], xa), sb[1] = dpwssd256(sb[1], w[3], xb);
#else
            sums[2 * i] = _mm256_add_epi32(sums[2 * i], _mm256_add_epi32(_mm256_madd_epi16(w[0], xa),
                                                                         _mm256_madd_epi16(w[2], xb)));
            sums[2 * i + 1] = _mm256_add_epi32(sums[2 * i + 1], _mm256_add_epi32(_mm256_madd_epi16(w[1], xa),
                                                                                 _mm256_madd_epi16(w[3], xb)));
#endif
            // keeps each group's adds in place: gcc otherwise computes the block's madds first
            // and spills them (1.4x slower)
            __asm__("" : "+x"(sums[2 * i]), "+x"(sums[2 * i + 1]));
        }
    }
    if (TL_VNNI256 && R == 1) sums[0] = _mm256_add_epi32(sums[0], t[0]), sums[1] = _mm256_add_epi32(sums[1], t[1]);
}

// R rows (from row m of the call, at acc in the chunk's accumulators: per row dot[16], m[16])
// through block b.
static inline __attribute__((always_inline)) void rows_block(const qrows *r, int m, int R, int K, int b,
                                                              const uint8_t *wb, int q8, const __m256 d[2],
                                                              const __m256 mv[2], float *acc) {
    const int nb = K / QK;
    __m256i sums[2 * ROWS];
    block_dots(wb, q8, r->q + (size_t)m * K + (size_t)b * QK, K, R, sums);
    for (int i = 0; i < R; i++) {
        float *ai = acc + (size_t)i * 2 * NT;
        const __m256 dx = _mm256_broadcast_ss(r->d + (size_t)(m + i) * nb + b);
        for (int h = 0; h < 2; h++)
            _mm256_store_ps(ai + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[2 * i + h]), _mm256_mul_ps(d[h], dx),
                                                        _mm256_load_ps(ai + 8 * h)));
        if (!q8) {
            const __m256 sx = _mm256_broadcast_ss(r->s + (size_t)(m + i) * nb + b);
            for (int h = 0; h < 2; h++)
                _mm256_store_ps(ai + NT + 8 * h, _mm256_fmadd_ps(mv[h], sx, _mm256_load_ps(ai + NT + 8 * h)));
        }
    }
}

// One row (row m) against one tile, blocks in order, the accumulators in registers: the
// outputs of its 16 channels (rows_block's arithmetic).
static inline __attribute__((always_inline)) void row1(const qrows *r, int m, int K, const uint8_t *wt,
                                                        const uint16_t *dt, const uint16_t *mt, int q8, float *out) {
    const int nb = K / QK;
    const size_t block_bytes = (size_t)NT * (q8 ? QK : QK / 2);
    const int16_t *x = r->q + (size_t)m * K;
    const float *xd = r->d + (size_t)m * nb, *xs = r->s + (size_t)m * nb;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = wt + (size_t)b * block_bytes;
        for (size_t p = 0; p < block_bytes; p += 64)  // the hardware's prefetch alone lags
            _mm_prefetch((const char *)(wb + (q8 ? 4 : 1) * PREFETCH + p), _MM_HINT_T0);
        __m256i s[2];
        block_dots(wb, q8, x + (size_t)b * QK, K, 1, s);
        const __m256 dx = _mm256_broadcast_ss(xd + b);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(half8(dt + NT * b), dx), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1]), _mm256_mul_ps(half8(dt + NT * b + 8), dx), a1);
        if (mt) {
            const __m256 sx = _mm256_broadcast_ss(xs + b);
            c0 = _mm256_fmadd_ps(half8(mt + NT * b), sx, c0);
            c1 = _mm256_fmadd_ps(half8(mt + NT * b + 8), sx, c1);
        }
    }
    _mm256_storeu_ps(out, _mm256_add_ps(a0, c0));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(a1, c1));
}

// The 16 outputs (out) of a tile with `cols` real channels to y's row, plus the bias.
static inline void store_tile(const float *out, int cols, const float *bias, float *y) {
    for (int c = 0; c < cols; c++) y[c] = bias ? out[c] + bias[c] : out[c];
}

// y[M, N] = x[M, K] @ W^T (+ bias), W in tiles (above): Q4: wq [tiles][nb][8][32] bytes, wd and
// wm [tiles][nb][NT]; Q8: wq [tiles][nb][16][32] int8, wm NULL; tiles = ceil(N / NT).
// K % 32 == 0. Returns 0, or -1 out of memory.
static int linear(const float *x, int M, int K, int N, const uint8_t *wq, const uint16_t *wd,
                  const uint16_t *wm, const float *bias, float *y, int nthreads, int q8) {
    const int nb = K / QK, tiles = (N + NT - 1) / NT;
    const size_t block_bytes = (size_t)NT * (q8 ? QK : QK / 2), tile_bytes = (size_t)nb * block_bytes;
    // rows per chunk: about ROW_CHUNK_BYTES of int16 activations, a multiple of ROWS
    const int fit = ROW_CHUNK_BYTES / (2 * K) / ROWS * ROWS, per = fit > ROWS ? fit : ROWS, chunk = M < per ? M : per;
    qrows r;
    if (quantize_rows(x, M, K, nthreads, q8, &r)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        // per row: dot, m (one row needs none)
        float *acc = M > 1 ? (float *)aligned_alloc(64, sizeof(float) * 2 * NT * (size_t)chunk) : NULL;
        if (M > 1 && !acc) {
#pragma omp atomic write
            failed = 1;
        }
        // The rows in chunks whose activations stay in L2 while the thread's tiles go by; each
        // thread takes the same tiles in every chunk, so no barrier between them.
        for (int m0 = 0; m0 < M; m0 += chunk) {
            const int rows = M - m0 < chunk ? M - m0 : chunk;
#pragma omp for schedule(static) nowait
            for (int t = 0; t < tiles; t++) {
                if (M > 1 && !acc) continue;
                const uint8_t *wt = wq + (size_t)t * tile_bytes;
                const uint16_t *dt = wd + (size_t)t * nb * NT, *mt = wm ? wm + (size_t)t * nb * NT : NULL;
                const int cols = N - t * NT < NT ? N - t * NT : NT;
                const float *bt = bias ? bias + (size_t)t * NT : NULL;
                float out[NT] __attribute__((aligned(32)));
                if (M == 1) {
                    row1(&r, 0, K, wt, dt, mt, q8, out);
                    store_tile(out, cols, bt, y + (size_t)t * NT);
                    continue;
                }
                memset(acc, 0, sizeof(float) * 2 * NT * (size_t)rows);
                for (int b = 0; b < nb; b++) {
                    const uint8_t *wb = wt + (size_t)b * block_bytes;
                    for (size_t p = 0; p < block_bytes; p += 64)
                        _mm_prefetch((const char *)(wb + (q8 ? 4 : 1) * PREFETCH + p), _MM_HINT_T0);
                    const __m256 d[2] = {half8(dt + NT * b), half8(dt + NT * b + 8)};
                    const __m256 mv[2] = {mt ? half8(mt + NT * b) : _mm256_setzero_ps(),
                                          mt ? half8(mt + NT * b + 8) : _mm256_setzero_ps()};
                    int i = 0;
                    for (; i + ROWS <= rows; i += ROWS)
                        rows_block(&r, m0 + i, ROWS, K, b, wb, q8, d, mv, acc + (size_t)i * 2 * NT);
                    if (rows - i == 3) rows_block(&r, m0 + i, 3, K, b, wb, q8, d, mv, acc + (size_t)i * 2 * NT);
                    else if (rows - i == 2) rows_block(&r, m0 + i, 2, K, b, wb, q8, d, mv, acc + (size_t)i * 2 * NT);
                    else if (rows - i == 1) rows_block(&r, m0 + i, 1, K, b, wb, q8, d, mv, acc + (size_t)i * 2 * NT);
                }
                for (int i = 0; i < rows; i++) {
                    const float *ai = acc + (size_t)i * 2 * NT;
                    for (int h = 0; h < 2; h++)
                        _mm256_store_ps(out + 8 * h, _mm256_add_ps(_mm256_load_ps(ai + 8 * h), _mm256_load_ps(ai + NT + 8 * h)));
                    store_tile(out, cols, bt, y + (size_t)(m0 + i) * N + (size_t)t * NT);
                }
            }
        }
        free(acc);
    }
    free_rows(&r);
    return failed ? -1 : 0;
}
