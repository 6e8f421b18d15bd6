// The block-quantized linear kernel on AVX2 (included by kernels.c where AVX-512 VNNI is
// not compiled in): weights in tiles of NT = 4 output channels. Q4 blocks are 16 bytes of
// nibbles per channel: byte j holds element j in its low nibble and element j + 16 in its
// high one.
//
// Every row count reads the weights straight into registers, two channels per 256-bit
// register, and runs up to 4 rows against each loaded block (tile_rows_q4 / tile_rows_q8);
// a thread's tile (a few KB) stays in L1 across its groups of 4 rows, so the weights are read
// from memory once per call. (Until 2026-12-05, 4+ rows went through a tile unpacked to int16
// in a buffer, two rows at a time: 1.2-1.5x slower at 2-8 rows, benchmarks/HISTORY.md.) The
// activations' 128-bit quarters are read from quantize_rows' broadcast copy (qrows.e), each
// block's scale products d_w * d_x are formed in the loop from the weight scales all the rows
// share, and one Q4 row runs with the blocks outer (tile_row1_q4): 1.1-1.2x faster than
// broadcasting at every use and tabling the products per row (stop 31, HISTORY), the same floats.

#define NT 4
#define ROW_CHUNK_BYTES 16384
#define PREFETCH 1024  // bytes of Q4 nibbles ahead of the one-row loop (Q8: twice that)

// Weights are stored in tiles of NT = 4 output channels: for tile t and block b, the NT
// channels' blocks lie side by side (Q4: 16 bytes of nibbles each, Q8: 32 int8 each), and
// d [N/NT][nb][NT] (and Q4's m) alike, so a thread reads each tile as one sequential stream
// and takes the NT channels' scales in one vector.
//
// A block's integer dot product is exact and kept as 4 int32 lanes, each the sum of a fixed
// set of 8 of the 32 products, whichever path computes it:
//   Q4: lane i holds elements 4i..4i+3 and 16+4i..19+4i (activations in Q4 order);
//   Q8: lane i holds elements 2i, 2i+1, 8+2i, 9+2i and the same + 16 (natural order).
// Each lane goes to float (exact for Q4: |sum| < 2^24) and into the channel's accumulator as
// acc += lanes * (d_w * d_x); Q4's m term (sum_b m_b * d_x * sum(q_x)) is accumulated for the
// NT channels in one vector; tile_out sums the lanes in a fixed order. So a row's result does
// not depend on which path ran it, or on what else is in the batch.

// Q4 from its nibbles, in registers: of a 256-bit load t (two channels' 16 bytes), int16 lane l
// of each half holds elements 2l (bits 0-3), 16+2l (4-7), 2l+1 (8-11) and 17+2l (12-15); the
// masks take them without widening (w0 = t & 0x000F, w1 = (t >> 4) & 0x000F, w2 = t & 0x0F00,
// w3 = (t >> 4) & 0x0F00), the odd elements scaled by 256, which an exact shift removes from
// their sums. Against the activations' quarters (Q4 order, each broadcast to both halves) each
// half's lanes are the Q4 lanes above: exact int32 sums.
static inline __m256i q4_sums(__m256i w0, __m256i w1, __m256i w2, __m256i w3, __m256i xa, __m256i xc, __m256i xb,
                              __m256i xd) {
    const __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(w0, xa), _mm256_madd_epi16(w1, xb));
    const __m256i p2 = _mm256_add_epi32(_mm256_madd_epi16(w2, xc), _mm256_madd_epi16(w3, xd));
    return _mm256_add_epi32(p1, _mm256_srai_epi32(p2, 8));  // products of 256 * e: |p2| < 2^29
}

// 32 int16 weights (two halves of 16) against the matching activations.
static inline __m128i block_sums16(__m256i w0, __m256i w1, __m256i x0, __m256i x1) {
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
    return _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
}

static inline __m128i q8_block_sums(const int8_t *wb, __m256i x0, __m256i x1) {
    return block_sums16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wb)),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 16))), x0, x1);
}

// 4 float16 values (the tile's channels) as float32.
static inline __m128 half4(const uint16_t *h) { return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h)); }

// The NT channels' outputs: each accumulator's lanes summed as (l0 + l2) + (l1 + l3), plus m.
static inline __m128 tile_out(const __m128 *acc, __m128 m) {
    const __m128 t0 = _mm_add_ps(_mm_unpacklo_ps(acc[0], acc[1]), _mm_unpackhi_ps(acc[0], acc[1]));
    const __m128 t1 = _mm_add_ps(_mm_unpacklo_ps(acc[2], acc[3]), _mm_unpackhi_ps(acc[2], acc[3]));
    return _mm_add_ps(_mm_add_ps(_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0)), m);
}

// One Q8 row (the LM head at decode) against one tile read from the packed weights, one
// channel at a time (measured faster than tile_rows_q8 for one row). prod: NT * nb floats of
// scratch for the block scale products d_w * d_x.
static inline __m128 tile_row_q8(const int16_t *xq, const float *xd, int nb, const uint8_t *wt, const uint16_t *dt,
                                 float *prod) {
    for (int b = 0; b < nb; b++) _mm_store_ps(prod + NT * b, _mm_mul_ps(half4(dt + NT * b), _mm_broadcast_ss(xd + b)));
    __m128 acc[NT];
    for (int c = 0; c < NT; c++) acc[c] = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + b * QK + 16));
        const int8_t *wb = (const int8_t *)wt + (size_t)b * NT * QK;
        _mm_prefetch((const char *)(wb + 2 * PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + 2 * PREFETCH + 64), _MM_HINT_T0);
        if ((b & 7) == 0) _mm_prefetch((const char *)(dt + NT * b + PREFETCH / 16), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int c = 0; c < NT; c++)
            acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(q8_block_sums(wb + c * QK, x0, x1)),
                                  _mm_broadcast_ss(prod + NT * b + c), acc[c]);
    }
    return tile_out(acc, _mm_setzero_ps());
}

// Q4 in registers for up to 4 rows at once: 2 channels per 256-bit register (a block's two
// adjacent channels are 32 contiguous bytes), against the activations' 128-bit quarters
// broadcast to both halves (read from quantize_rows' copy of them, r->e: a plain 256-bit load
// there measured 10-15% faster on Zen 3 than a vbroadcasti128 per use): q4_sums' exact lanes,
// then one fma of the lane sums and the channels' d_w * d_x (formed in the loop from the
// block's weight scales, which all the rows share). tile_row1_q4 does the same for one row.

// The tile's weight scales of one block for channel pair p, as [d_2p x4 | d_2p+1 x4].
static inline __m256 pair_scales(const uint16_t *dt, int p) {
    const __m256i idx = p ? _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3) : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(half4(dt)), idx);
}

// R rows' two-channel-pair accumulators to their 4 outputs each (tile_out: the one-row order).
static inline __attribute__((always_inline)) void rows_out(int R, __m256 acc[][2], const __m128 *mterm, __m128 *out) {
    for (int i = 0; i < R; i++) {
        const __m128 c[NT] = {_mm256_castps256_ps128(acc[i][0]), _mm256_extractf128_ps(acc[i][0], 1),
                              _mm256_castps256_ps128(acc[i][1]), _mm256_extractf128_ps(acc[i][1], 1)};
        out[i] = tile_out(c, mterm[i]);
    }
}

// Row m0 + i's activations (the quarter-broadcast copy, r->e), scales and (Q4) scaled sums:
// tile_rows_q4's and tile_rows_q8's set-up.
static inline __attribute__((always_inline)) void rows_setup(const qrows *r, int m0, int R, int nb, const int16_t **xq,
                                                              const float **xd, const float **xs, __m128 *mterm) {
    for (int i = 0; i < R; i++) {
        const size_t m = (size_t)(m0 + i);
        xq[i] = r->e + m * nb * 2 * QK, xd[i] = r->d + m * nb, xs[i] = r->s + m * nb;
        mterm[i] = _mm_setzero_ps();
    }
}

static inline __attribute__((always_inline)) void tile_rows_q4(const qrows *r, int m0, int R, int nb,
                                                                const uint8_t *wt, const uint16_t *dt,
                                                                const uint16_t *mt, __m128 *out) {
    const __m256i lo = _mm256_set1_epi16(0x000F), hi = _mm256_set1_epi16(0x0F00);
    const int16_t *xq[4];
    const float *xd[4], *xs[4];
    __m128 mterm[4];
    __m256 acc[4][2];
    rows_setup(r, m0, R, nb, xq, xd, xs, mterm);
    for (int p = 0; p < 2; p++) {  // channels 2p, 2p + 1
        __m256 a[4];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) a[i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const uint8_t *wb = wt + (size_t)b * NT * 16 + 32 * p;
            if (p == 0) _mm_prefetch((const char *)(wb + PREFETCH), _MM_HINT_T0);
            const __m256i t = _mm256_loadu_si256((const __m256i *)wb), s = _mm256_srli_epi16(t, 4);
            const __m256i w0 = _mm256_and_si256(t, lo), w1 = _mm256_and_si256(s, lo);
            const __m256i w2 = _mm256_and_si256(t, hi), w3 = _mm256_and_si256(s, hi);
            const __m256 dw = pair_scales(dt + NT * b, p);
            const __m128 mw = p == 0 ? half4(mt + NT * b) : _mm_setzero_ps();
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const int16_t *xb = xq[i] + b * 2 * QK;
                const __m256i xa = _mm256_load_si256((const __m256i *)xb);
                const __m256i xc = _mm256_load_si256((const __m256i *)(xb + 16));
                const __m256i xb_ = _mm256_load_si256((const __m256i *)(xb + 32));
                const __m256i xd_ = _mm256_load_si256((const __m256i *)(xb + 48));
                const __m256i sums = q4_sums(w0, w1, w2, w3, xa, xc, xb_, xd_);
                const __m256 prod = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd[i] + b));
                a[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), prod, a[i]);
                if (p == 0) mterm[i] = _mm_fmadd_ps(mw, _mm_broadcast_ss(xs[i] + b), mterm[i]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) acc[i][p] = a[i];
    }
    rows_out(R, acc, mterm, out);
}

// One Q4 row (decode) with the blocks outer: its activations are loaded once per block for both
// channel pairs. The arithmetic is tile_rows_q4's (q4_sums, d_w * d_x, fma and m order).
static inline __attribute__((always_inline)) void tile_row1_q4(const qrows *r, int m0, int nb, const uint8_t *wt,
                                                                const uint16_t *dt, const uint16_t *mt, __m128 *out) {
    const __m256i lo = _mm256_set1_epi16(0x000F), hi = _mm256_set1_epi16(0x0F00);
    const __m256i i01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), i23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const int16_t *xq = r->e + (size_t)m0 * nb * 2 * QK;
    const float *xd = r->d + (size_t)m0 * nb, *xs = r->s + (size_t)m0 * nb;
    __m256 acc[1][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}};
    __m128 m = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int16_t *xb = xq + b * 2 * QK;
        const __m256i xa = _mm256_load_si256((const __m256i *)xb);
        const __m256i xc = _mm256_load_si256((const __m256i *)(xb + 16));
        const __m256i xb_ = _mm256_load_si256((const __m256i *)(xb + 32));
        const __m256i xd_ = _mm256_load_si256((const __m256i *)(xb + 48));
        const uint8_t *wb = wt + (size_t)b * NT * 16;
        _mm_prefetch((const char *)(wb + PREFETCH), _MM_HINT_T0);
        const __m256 dw = _mm256_castps128_ps256(half4(dt + NT * b)), dx = _mm256_broadcast_ss(xd + b);
        m = _mm_fmadd_ps(half4(mt + NT * b), _mm_broadcast_ss(xs + b), m);
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {
            const __m256i t = _mm256_loadu_si256((const __m256i *)(wb + 32 * p)), s = _mm256_srli_epi16(t, 4);
            const __m256i sums = q4_sums(_mm256_and_si256(t, lo), _mm256_and_si256(s, lo), _mm256_and_si256(t, hi),
                                         _mm256_and_si256(s, hi), xa, xc, xb_, xd_);
            const __m256 prod = _mm256_mul_ps(_mm256_permutevar8x32_ps(dw, p ? i23 : i01), dx);
            acc[0][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), prod, acc[0][p]);
        }
    }
    rows_out(1, acc, &m, out);
}

// Q8 likewise: a block's two adjacent channels widened to int16 and regrouped by eighths, so
// one register holds [channel 2p: elements 8g..8g+7 | channel 2p + 1: the same]; against the
// activations' eighth broadcast to both halves, the 4 eighths' madds summed give each half
// q8_block_sums' lanes (elements 2i, 2i+1, 8+2i, 9+2i and the same + 16: exact integers).
static inline __attribute__((always_inline)) void tile_rows_q8(const qrows *r, int m0, int R, int nb,
                                                                const uint8_t *wt, const uint16_t *dt, __m128 *out) {
    const int16_t *xq[4];
    const float *xd[4], *xs[4];
    __m128 mterm[4];
    __m256 acc[4][2];
    rows_setup(r, m0, R, nb, xq, xd, xs, mterm);
    for (int p = 0; p < 2; p++) {  // channels 2p, 2p + 1
        __m256 a[4];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) a[i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const int8_t *wb = (const int8_t *)wt + (size_t)b * NT * QK + 2 * QK * p;
            if (p == 0) {
                _mm_prefetch((const char *)(wb + 2 * PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(wb + 2 * PREFETCH + 64), _MM_HINT_T0);
            }
            const __m256i a0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wb));
            const __m256i a1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 16)));
            const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + QK)));
            const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + QK + 16)));
            const __m256i w0 = _mm256_permute2x128_si256(a0, b0, 0x20), w1 = _mm256_permute2x128_si256(a0, b0, 0x31);
            const __m256i w2 = _mm256_permute2x128_si256(a1, b1, 0x20), w3 = _mm256_permute2x128_si256(a1, b1, 0x31);
            const __m256 dw = pair_scales(dt + NT * b, p);
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const int16_t *xb = xq[i] + b * 2 * QK;
                const __m256i x0 = _mm256_load_si256((const __m256i *)xb);
                const __m256i x1 = _mm256_load_si256((const __m256i *)(xb + 16));
                const __m256i x2 = _mm256_load_si256((const __m256i *)(xb + 32));
                const __m256i x3 = _mm256_load_si256((const __m256i *)(xb + 48));
                const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1)),
                                                      _mm256_add_epi32(_mm256_madd_epi16(w2, x2), _mm256_madd_epi16(w3, x3)));
                const __m256 prod = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd[i] + b));
                a[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), prod, a[i]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) acc[i][p] = a[i];
    }
    rows_out(R, acc, mterm, out);
}

// y[M, N] = x[M, K] @ W^T (+ bias), W in tiles (above): Q4: wq [N/NT][nb][NT][16] nibbles, wd and
// wm [N/NT][nb][NT]; Q8: wq [N/NT][nb][NT][32] int8, wm NULL. K % 32 == 0, N % NT == 0.
// Returns 0, or -1 out of memory. Rows in groups of 4 against each tile (tile_rows_q4/_q8); one
// Q4 row through tile_row1_q4, one Q8 row (the LM head at decode) through tile_row_q8. Every path computes
// a row's outputs with the same arithmetic, so M and the other rows never change them.
static int linear(const float *x, int M, int K, int N, const uint8_t *wq, const uint16_t *wd,
                  const uint16_t *wm, const float *bias, float *y, int nthreads, int q8) {
    const int nb = K / QK;
    const size_t tile_bytes = (size_t)nb * NT * (q8 ? QK : QK / 2);
    const int one_q8 = q8 && M == 1;  // tile_row_q8
    qrows r;
    if (quantize_rows(x, M, K, nthreads, !q8, !one_q8, &r)) return -1;
    int failed = 0;
    const int tiles = N / NT;
#pragma omp parallel num_threads(nthreads)
    {
        // tile_row_q8's scale products (a multiple of 32 bytes, as aligned_alloc asks)
        float *prod = one_q8 ? (float *)aligned_alloc(32, sizeof(float) * NT * (size_t)(nb + (nb & 1))) : NULL;
        const int ok = prod != NULL || !one_q8;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        // Rows in chunks of about ROW_CHUNK_BYTES of activations (their broadcast copy stays in L1
        // while a thread's tiles go by: 1.3-1.4x at 512-2048 rows on Zen 3, stop 31); each thread
        // takes the same tiles in every chunk, so no barrier between them.
        const int rchunk = ROW_CHUNK_BYTES / (4 * K) < 4 ? 4 : ROW_CHUNK_BYTES / (4 * K) / 4 * 4;
        for (int c0 = 0; c0 < M; c0 += rchunk) {
            const int c1 = M - c0 < rchunk ? M : c0 + rchunk;
#pragma omp for schedule(static) nowait
            for (int t = 0; t < tiles; t++) {
                if (!ok) continue;
                const uint8_t *wt = wq + (size_t)t * tile_bytes;
                const uint16_t *dt = wd + (size_t)t * nb * NT, *mt = wm ? wm + (size_t)t * nb * NT : NULL;
                const __m128 bv = bias ? _mm_loadu_ps(bias + (size_t)t * NT) : _mm_setzero_ps();
#define STORE(m, out) _mm_storeu_ps(y + (size_t)(m) * N + (size_t)t * NT, bias ? _mm_add_ps(out, bv) : (out))
                if (one_q8) {
                    STORE(0, tile_row_q8(r.q, r.d, nb, wt, dt, prod));
                } else {
                    for (int m = c0; m < c1; m += 4) {
                        const int R = c1 - m < 4 ? c1 - m : 4;
                        __m128 out[4];
#define ROWS(n) (q8 ? tile_rows_q8(&r, m, n, nb, wt, dt, out) : tile_rows_q4(&r, m, n, nb, wt, dt, mt, out))
                        switch (R) {  // constant row counts: the rows' loops unrolled
                            case 4: ROWS(4); break;
                            case 3: ROWS(3); break;
                            case 2: ROWS(2); break;
                            default:
                                if (q8) tile_rows_q8(&r, m, 1, nb, wt, dt, out);
                                else tile_row1_q4(&r, m, nb, wt, dt, mt, out);
                                break;
                        }
#undef ROWS
                        for (int i = 0; i < R; i++) STORE(m + i, out[i]);
                    }
                }
#undef STORE
            }
        }
        free(prod);
    }
    free_rows(&r);
    return failed ? -1 : 0;
}

