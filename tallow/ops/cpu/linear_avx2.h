// The block-quantized linear kernel on AVX2 (included by kernels.c where AVX-512 VNNI is
// not compiled in): weights in tiles of NT = 4 output channels. Q4 blocks are 16 bytes of
// nibbles per channel: byte j holds element j in its low nibble and element j + 16 in its
// high one.
//
// One row (decode) reads the nibbles straight into registers; with 4 or more rows each thread
// unpacks a tile to int16 in a small buffer once and runs every row against it, so the
// weights are read from memory once per call.

#define NT 4
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

// Q4 from its nibbles, in registers. t's int16 lane l holds elements 2l (bits 0-3), 16+2l
// (4-7), 2l+1 (8-11) and 17+2l (12-15); the masks take them without widening, the odd
// elements scaled by 256, which an exact shift removes from their sums.
static inline __m128i q4_block_sums(const uint8_t *nib, __m128i xa, __m128i xc, __m128i xb, __m128i xd) {
    const __m128i lo = _mm_set1_epi16(0x000F), hi = _mm_set1_epi16(0x0F00);
    const __m128i t = _mm_loadu_si128((const __m128i *)nib), s = _mm_srli_epi16(t, 4);
    const __m128i p1 = _mm_add_epi32(_mm_madd_epi16(_mm_and_si128(t, lo), xa), _mm_madd_epi16(_mm_and_si128(s, lo), xb));
    const __m128i p2 = _mm_add_epi32(_mm_madd_epi16(_mm_and_si128(t, hi), xc), _mm_madd_epi16(_mm_and_si128(s, hi), xd));
    return _mm_add_epi32(p1, _mm_srai_epi32(p2, 8));  // products of 256 * e: |p2| < 2^29
}

// A Q4 block unpacked for the buffered path: [e0 e2 .. e14 | e1 .. e15 | e16 .. e30 | e17 .. e31]
// as int16, the activations' Q4 order.
static inline void unpack_q4(const uint8_t *nib, int16_t *dst) {
    const __m128i lo = _mm_set1_epi16(0x000F);
    const __m128i t = _mm_loadu_si128((const __m128i *)nib);
    _mm_store_si128((__m128i *)dst, _mm_and_si128(t, lo));
    _mm_store_si128((__m128i *)(dst + 8), _mm_and_si128(_mm_srli_epi16(t, 8), lo));
    _mm_store_si128((__m128i *)(dst + 16), _mm_and_si128(_mm_srli_epi16(t, 4), lo));
    _mm_store_si128((__m128i *)(dst + 24), _mm_srli_epi16(t, 12));
}

// 32 int16 weights (two halves of 16, either path's layout) against the matching activations.
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

static inline __m128 acc_block(__m128 acc, __m128i sums, const float *scale) {
    return _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_broadcast_ss(scale), acc);
}

// The NT channels' outputs: each accumulator's lanes summed as (l0 + l2) + (l1 + l3), plus m.
static inline __m128 tile_out(const __m128 *acc, __m128 m) {
    const __m128 t0 = _mm_add_ps(_mm_unpacklo_ps(acc[0], acc[1]), _mm_unpackhi_ps(acc[0], acc[1]));
    const __m128 t1 = _mm_add_ps(_mm_unpacklo_ps(acc[2], acc[3]), _mm_unpackhi_ps(acc[2], acc[3]));
    return _mm_add_ps(_mm_add_ps(_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0)), m);
}

// One row's per-block float scales for a tile (prod[b][c] = d[b][c] * d_x[b]) and its m term
// for the NT channels (Q4; mt NULL: zero).
static inline __attribute__((always_inline)) __m128 row_scales(const uint16_t *dt, const uint16_t *mt,
                                                                const float *xd, const float *xs, int nb, float *prod) {
    __m128 m = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        _mm_store_ps(prod + NT * b, _mm_mul_ps(half4(dt + NT * b), _mm_broadcast_ss(xd + b)));
        if (mt) m = _mm_fmadd_ps(half4(mt + NT * b), _mm_broadcast_ss(xs + b), m);
    }
    return m;
}

// One row against one tile read from the packed weights, in registers.
static inline __m128 tile_row(const int16_t *xq, const float *xd, const float *xs, int nb, const uint8_t *wt,
                              const uint16_t *dt, const uint16_t *mt, int q8, float *prod) {
    const __m128 m = row_scales(dt, mt, xd, xs, nb, prod);
    __m128 acc[NT];
    for (int c = 0; c < NT; c++) acc[c] = _mm_setzero_ps();
    if (q8) {
        for (int b = 0; b < nb; b++) {
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + b * QK + 16));
            const int8_t *wb = (const int8_t *)wt + (size_t)b * NT * QK;
            _mm_prefetch((const char *)(wb + 2 * PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + 2 * PREFETCH + 64), _MM_HINT_T0);
            if ((b & 7) == 0) _mm_prefetch((const char *)(dt + NT * b + PREFETCH / 16), _MM_HINT_T0);
#pragma GCC unroll 4
            for (int c = 0; c < NT; c++) acc[c] = acc_block(acc[c], q8_block_sums(wb + c * QK, x0, x1), prod + NT * b + c);
        }
    } else {
        for (int b = 0; b < nb; b++) {
            const int16_t *xb = xq + b * QK;
            const __m128i xa = _mm_loadu_si128((const __m128i *)xb), xc = _mm_loadu_si128((const __m128i *)(xb + 8));
            const __m128i xb_ = _mm_loadu_si128((const __m128i *)(xb + 16)), xd_ = _mm_loadu_si128((const __m128i *)(xb + 24));
            const uint8_t *wb = wt + (size_t)b * NT * 16;
            _mm_prefetch((const char *)(wb + PREFETCH), _MM_HINT_T0);  // the hardware's prefetch alone lags
            if ((b & 7) == 0) _mm_prefetch((const char *)(dt + NT * b + PREFETCH / 16), _MM_HINT_T0),
                              _mm_prefetch((const char *)(mt + NT * b + PREFETCH / 16), _MM_HINT_T0);
#pragma GCC unroll 4
            for (int c = 0; c < NT; c++)
                acc[c] = acc_block(acc[c], q4_block_sums(wb + c * 16, xa, xc, xb_, xd_), prod + NT * b + c);
        }
    }
    return tile_out(acc, m);
}

// Rows m0 and m1 (they may be the same row) against a tile unpacked to int16 (buf), each
// weight vector and scale loaded once for both: row_scales' and tile_row's arithmetic for each
// row. prod: 2 * NT * nb floats.
static inline void tile_rows2(const qrows *r, int m0, int m1, int nb, const uint16_t *dt, const uint16_t *mt,
                              const int16_t *buf, float *prod, __m128 *out0, __m128 *out1) {
    const int16_t *xq0 = r->q + (size_t)m0 * nb * QK, *xq1 = r->q + (size_t)m1 * nb * QK;
    float *prod0 = prod, *prod1 = prod + (size_t)NT * nb;
    const float *xd0 = r->d + (size_t)m0 * nb, *xd1 = r->d + (size_t)m1 * nb;
    const float *xs0 = r->s + (size_t)m0 * nb, *xs1 = r->s + (size_t)m1 * nb;
    __m128 s0 = _mm_setzero_ps(), s1 = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m128 d = half4(dt + NT * b);
        _mm_store_ps(prod0 + NT * b, _mm_mul_ps(d, _mm_broadcast_ss(xd0 + b)));
        _mm_store_ps(prod1 + NT * b, _mm_mul_ps(d, _mm_broadcast_ss(xd1 + b)));
        if (mt) {
            const __m128 m = half4(mt + NT * b);
            s0 = _mm_fmadd_ps(m, _mm_broadcast_ss(xs0 + b), s0);
            s1 = _mm_fmadd_ps(m, _mm_broadcast_ss(xs1 + b), s1);
        }
    }
    __m128 a0[NT], a1[NT];
    for (int c = 0; c < NT; c++) a0[c] = a1[c] = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i x00 = _mm256_loadu_si256((const __m256i *)(xq0 + b * QK));
        const __m256i x01 = _mm256_loadu_si256((const __m256i *)(xq0 + b * QK + 16));
        const __m256i x10 = _mm256_loadu_si256((const __m256i *)(xq1 + b * QK));
        const __m256i x11 = _mm256_loadu_si256((const __m256i *)(xq1 + b * QK + 16));
        const int16_t *wb = buf + (size_t)b * NT * QK;
#pragma GCC unroll 4
        for (int c = 0; c < NT; c++) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(wb + c * QK));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(wb + c * QK + 16));
            a0[c] = acc_block(a0[c], block_sums16(w0, w1, x00, x01), prod0 + NT * b + c);
            a1[c] = acc_block(a1[c], block_sums16(w0, w1, x10, x11), prod1 + NT * b + c);
        }
    }
    *out0 = tile_out(a0, s0);
    *out1 = tile_out(a1, s1);
}

// y[M, N] = x[M, K] @ W^T (+ bias), W in tiles (above): Q4: wq [N/NT][nb][NT][16] nibbles, wd and
// wm [N/NT][nb][NT]; Q8: wq [N/NT][nb][NT][32] int8, wm NULL. K % 32 == 0, N % NT == 0.
// Returns 0, or -1 out of memory. With 4 or more rows each thread unpacks a tile to int16 once
// and runs every row against it, two rows at a time (tile_rows2).
static int linear(const float *x, int M, int K, int N, const uint8_t *wq, const uint16_t *wd,
                  const uint16_t *wm, const float *bias, float *y, int nthreads, int q8) {
    const int nb = K / QK;
    const size_t tile_bytes = (size_t)nb * NT * (q8 ? QK : QK / 2);
    const int buffered = M >= 4;
    qrows r;
    if (quantize_rows(x, M, K, nthreads, !q8, &r)) return -1;
    int failed = 0;
    const int tiles = N / NT;
#pragma omp parallel num_threads(nthreads)
    {
        int16_t *buf = buffered ? (int16_t *)aligned_alloc(32, sizeof(int16_t) * NT * (size_t)K) : NULL;
        float *prod = (float *)aligned_alloc(32, sizeof(float) * 2 * NT * ((size_t)nb + 8));  // two rows' scales
        const int ok = prod && (buf || !buffered);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            if (!ok) continue;
            const uint8_t *wt = wq + (size_t)t * tile_bytes;
            const uint16_t *dt = wd + (size_t)t * nb * NT, *mt = wm ? wm + (size_t)t * nb * NT : NULL;
            if (buffered) {
                for (int i = 0; i < nb * NT; i++) {  // block-major, as stored
                    int16_t *dst = buf + (size_t)i * QK;
                    if (q8) {
                        const int8_t *wb = (const int8_t *)wt + (size_t)i * QK;
                        _mm256_store_si256((__m256i *)dst, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wb)));
                        _mm256_store_si256((__m256i *)(dst + 16), _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 16))));
                    } else {
                        unpack_q4(wt + (size_t)i * 16, dst);
                    }
                }
            }
            const __m128 bv = bias ? _mm_loadu_ps(bias + (size_t)t * NT) : _mm_setzero_ps();
#define STORE(m, out) _mm_storeu_ps(y + (size_t)(m) * N + (size_t)t * NT, bias ? _mm_add_ps(out, bv) : (out))
            if (buffered) {
                for (int m = 0; m < M; m += 2) {
                    const int m1 = m + 1 < M ? m + 1 : m;  // an odd last row is computed twice, stored once
                    __m128 out0, out1;
                    tile_rows2(&r, m, m1, nb, dt, mt, buf, prod, &out0, &out1);
                    STORE(m, out0);
                    if (m1 != m) STORE(m1, out1);
                }
            } else {
                for (int m = 0; m < M; m++)
                    STORE(m, tile_row(r.q + (size_t)m * K, r.d + (size_t)m * nb, r.s + (size_t)m * nb, nb, wt, dt, mt, q8,
                                      prod));
            }
#undef STORE
        }
        free(buf);
        free(prod);
    }
    free_rows(&r);
    return failed ? -1 : 0;
}

