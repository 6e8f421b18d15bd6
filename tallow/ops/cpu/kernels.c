// tallow's CPU kernels (AVX2 + FMA), loaded through ctypes by tallow/ops/cpu_native.py.
//
// Linear layers over block-quantized weights: the activations are quantized per block of 32
// to int16 (scale = max|x| / 32767: a relative error of 2^-16 of the block's largest value,
// finer than bfloat16), each block's integer dot product with the weights is exact (madd),
// and is scaled into a float32 accumulator. (int8 activations, as llama.cpp's q8_1, cost
// about as much on AVX2 but moved SmolLM2's greedy answers: 0.3-1.7% error per layer.)
//   Q4: w = d * q + m, q in 0..15 (GGUF's Q4_1), 16 bytes of nibbles per block: byte j
//       holds element j in its low nibble and element j + 16 in its high nibble.
//   Q8: w = d * q, q in -127..127 (GGUF's Q8_0).
// d and m are float16 (as in GGUF), one per (output channel, block). The weights are stored
// in tiles of NT = 4 output channels (see linear() below).
//
// Every output (row, column) is computed by the same arithmetic whatever the number of rows
// and threads: threads split the tiles of columns, never a dot product. So a row's result
// does not depend on what it is batched with (greedy batching invariance).
//
// One row (decode) reads the nibbles straight into registers; with 4 or more rows each thread
// unpacks a tile to int16 in a small buffer once and runs every row against it, so the
// weights are read from memory once per call.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define NT 4
#define PREFETCH 1024  // bytes of Q4 nibbles ahead of the one-row loop (Q8: twice that)

int tl_abi_version(void) { return 6; }

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// One row of K floats (K % 32 == 0) to int16 blocks: q[K], d[K/32] (the scale) and
// s[K/32] (d * the block's integer sum, for Q4's m term). q4_order: each block stored as
// [x0 x2 .. x14 | x1 x3 .. x15 | x16 x18 .. x30 | x17 x19 .. x31], the order of the int16 lanes
// a Q4 block's nibbles give in registers (q4_block_sums); otherwise the natural order.
static void quantize_row_q16(const float *x, int K, int16_t *q, float *d, float *s, int q4_order) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    // within each 128-bit lane: the even int16 elements, then the odd ones
    const __m256i evens_first = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float db = amax / 32767.0f;
        const __m256 id = _mm256_set1_ps(db > 0.0f ? 32767.0f / amax : 0.0f);
        v0 = _mm256_round_ps(_mm256_mul_ps(v0, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v1 = _mm256_round_ps(_mm256_mul_ps(v1, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v2 = _mm256_round_ps(_mm256_mul_ps(v2, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v3 = _mm256_round_ps(_mm256_mul_ps(v3, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        d[b] = db;
        s[b] = db * hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));  // exact integer sum
        // packs works within 128-bit lanes: [a0-3 b0-3 | a4-7 b4-7] -> 64-bit permute restores the order.
        __m256i i0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(v0), _mm256_cvtps_epi32(v1)), 0xD8);
        __m256i i1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(v2), _mm256_cvtps_epi32(v3)), 0xD8);
        if (q4_order) {  // [e0-6 o1-7 | e8-14 o9-15] -> [e0-14 | o1-15]
            i0 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(i0, evens_first), 0xD8);
            i1 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(i1, evens_first), 0xD8);
        }
        _mm256_storeu_si256((__m256i *)(q + b * QK), i0);
        _mm256_storeu_si256((__m256i *)(q + b * QK + 16), i1);
    }
}

// Activations quantized once per call, rows in parallel.
typedef struct {
    int16_t *q;
    float *d, *s;
} qrows;

static int quantize_rows(const float *x, int M, int K, int nthreads, int q4_order, qrows *out) {
    const int nb = K / QK;
    out->q = (int16_t *)aligned_alloc(32, sizeof(int16_t) * ((size_t)M * K + 16));
    out->d = (float *)malloc(sizeof(float) * (size_t)M * nb);
    out->s = (float *)malloc(sizeof(float) * (size_t)M * nb);
    if (!out->q || !out->d || !out->s) {
        free(out->q), free(out->d), free(out->s);
        return -1;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M > 8)
    for (int m = 0; m < M; m++)
        quantize_row_q16(x + (size_t)m * K, K, out->q + (size_t)m * K, out->d + (size_t)m * nb,
                         out->s + (size_t)m * nb, q4_order);
    return 0;
}

static void free_rows(qrows *r) { free(r->q), free(r->d), free(r->s); }

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

int tl_q4_linear(const float *x, int M, int K, int N, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm,
                 const float *bias, float *y, int nthreads) {
    return linear(x, M, K, N, wq, wd, wm, bias, y, nthreads, 0);
}

int tl_q8_linear(const float *x, int M, int K, int N, const int8_t *wq, const uint16_t *wd, const uint16_t *unused_wm,
                 const float *bias, float *y, int nthreads) {
    (void)unused_wm;  // the same signature as tl_q4_linear
    return linear(x, M, K, N, (const uint8_t *)wq, wd, NULL, bias, y, nthreads, 1);
}

// ---- elementwise ops, float32 ------------------------------------------------------------

// exp(x) for 8 floats: 2^n * p(f) with n = round(x / ln 2), f = x - n ln 2 (two-part ln 2),
// p a degree-6 polynomial (Cephes expf); relative error ~2e-7. Below -87.3 gives 0.
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

void tl_exp(const float *x, float *y, int n) {  // for tests of exp8
    for (int i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
}

// residual_out = x + residual (residual NULL: x itself); out = residual_out / rms * weight.
// Rows of D (D % 8 == 0), contiguous.
void tl_add_rms_norm(const float *x, const float *residual, const float *weight, float eps, int T, int D,
                     float *out, float *residual_out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * D;
        float *rr = residual_out + (size_t)t * D;
        __m256 ss = _mm256_setzero_ps();
        for (int i = 0; i < D; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            if (residual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + (size_t)t * D + i));
            if (residual_out != x) _mm256_storeu_ps(rr + i, v);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)D + eps));
        const float *src = residual_out == x ? xr : rr;
        for (int i = 0; i < D; i += 8)
            _mm256_storeu_ps(out + (size_t)t * D + i,
                             _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + i), r), _mm256_loadu_ps(weight + i)));
    }
}

// out[t, :I] = silu(x[t, :I]) * x[t, I:2I]; I % 8 == 0.
void tl_silu_and_mul(const float *x, int T, int I, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *g = x + (size_t)t * 2 * I, *u = g + I;
        float *o = out + (size_t)t * I;
        for (int i = 0; i < I; i += 8) {
            __m256 a = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), a))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
    }
}

// Neox rotary embedding in place on x [T, heads, D] (row stride in floats; heads contiguous
// at stride D): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, (cos, sin) = cos_sin[pos] halves.
void tl_rotary(float *x, int T, int heads, int D, long row_stride, const int64_t *positions,
               const float *cos_sin, int nthreads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *c = cos_sin + positions[t] * D, *s = c + half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * row_stride + (size_t)h * D, *x2 = x1 + half;
            int i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
                __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
                _mm256_storeu_ps(x1 + i, _mm256_fmsub_ps(a, cv, _mm256_mul_ps(b, sv)));
                _mm256_storeu_ps(x2 + i, _mm256_fmadd_ps(b, cv, _mm256_mul_ps(a, sv)));
            }
            for (; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

// ---- paged attention, float32 -----------------------------------------------------------

// k/v [T, kv_heads, D] (row strides in floats) into the caches [blocks, block_size, kv_heads, D]
// at slot_mapping[t] (negative: padding, skipped).
void tl_kv_write(const float *k, long k_stride, const float *v, long v_stride, int T, int kv_heads, int D,
                 const int64_t *slot_mapping, float *k_cache, float *v_cache) {
    const size_t n = (size_t)kv_heads * D;
    for (int t = 0; t < T; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * n, k + t * k_stride, n * sizeof(float));
        memcpy(v_cache + slot * n, v + t * v_stride, n * sizeof(float));
    }
}

// Attention works on chunks of ATT_CHUNK context keys: one work item is (query token, KV head,
// chunk); the GROUP query heads sharing the KV head read its K and V rows from memory once. A
// chunk leaves per head its max score, its sum of exp(score - max) and its unnormalized
// output; a token's chunks are then combined in order.
// The chunks are fixed by the token's context length alone, so the arithmetic of a token does
// not depend on the batch or the threads, and one decode token still spreads over the threads.
#define ATT_CHUNK 64

// The 8 horizontal sums of a0..a7 as one vector: [sum a0, sum a1, ..., sum a7].
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q . k_r for 8 keys (rows at off[r] from k), one FMA chain per key, the eight sums
// transposed at once. Inlined with a constant D (64, 128), the loops unroll.
static inline __attribute__((always_inline)) __m256 qk8(const float *q, const float *k, const size_t *off, int D) {
    __m256 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        const __m256 qi = _mm256_loadu_ps(q + i);
        for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + off[r] + i), a[r]);
    }
    return hsum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
}

static inline __attribute__((always_inline)) float qk1(const float *q, const float *k, int D) {
    __m256 a = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
    return hsum8(a);
}

// acc[0..D) += sum_r p[r] v_r over n rows, the accumulator in registers 128 floats at a time.
static inline __attribute__((always_inline)) void pv_acc(const float *v, const size_t *off, int n, int D,
                                                          const float *p, float *acc) {
    for (int i0 = 0; i0 < D; i0 += 128) {
        const int w = (D - i0) < 128 ? (D - i0) / 8 : 16;
        __m256 a[16];
        for (int r = 0; r < 16; r++)
            if (r < w) a[r] = _mm256_loadu_ps(acc + i0 + 8 * r);
        for (int j = 0; j < n; j++) {
            const float *vr = v + off[j] + i0;
            const __m256 pj = _mm256_broadcast_ss(p + j);
            for (int r = 0; r < 16; r++)
                if (r < w) a[r] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * r), a[r]);
        }
        for (int r = 0; r < 16; r++)
            if (r < w) _mm256_storeu_ps(acc + i0 + 8 * r, a[r]);
    }
}

// One chunk of n <= ATT_CHUNK keys (rows at off[] in the caches) for the group's heads q[g]:
// part[g] = {max, sum, out[D]} with out unnormalized. Head by head: the chunk's K and V rows
// (ATT_CHUNK * D floats each) come from memory for the first head and from L1 for the others.
// scores: ATT_CHUNK floats of scratch.
static inline __attribute__((always_inline)) void attend_chunk(const float *q, int group, int D, float scale,
                                                                const float *k_cache, const float *v_cache,
                                                                const size_t *off, int n, float *scores, float *part) {
    const size_t part_len = (size_t)D + 2;
    const __m256 sv = _mm256_set1_ps(scale);
    for (int j = 0; j < n; j++)  // the rows are scattered over the cache: ask for all of them at once
        for (int i = 0; i < D; i += 16) {
            _mm_prefetch((const char *)(k_cache + off[j] + i), _MM_HINT_T1);
            _mm_prefetch((const char *)(v_cache + off[j] + i), _MM_HINT_T1);
        }
    for (int g = 0; g < group; g++) {
        const float *qg = q + (size_t)g * D;
        float *pg = part + g * part_len;
        int j = 0;
        for (; j + 8 <= n; j += 8) _mm256_storeu_ps(scores + j, _mm256_mul_ps(qk8(qg, k_cache, off + j, D), sv));
        for (; j < n; j++) scores[j] = qk1(qg, k_cache + off[j], D) * scale;
        float mx = scores[0];  // exp(s - max) in place, eight at a time, the tail padded with -inf
        for (j = 1; j < n; j++) mx = scores[j] > mx ? scores[j] : mx;
        const int n8 = n & ~7;
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sum = _mm256_setzero_ps();
        for (j = 0; j < n8; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
            _mm256_storeu_ps(scores + j, e);
            sum = _mm256_add_ps(sum, e);
        }
        float total = hsum8(sum);
        if (n8 < n) {
            float tail[8];
            for (j = 0; j < 8; j++) tail[j] = n8 + j < n ? scores[n8 + j] - mx : -INFINITY;
            _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
            for (j = n8; j < n; j++) scores[j] = tail[j - n8], total += tail[j - n8];
        }
        pg[0] = mx, pg[1] = total;
        memset(pg + 2, 0, sizeof(float) * (size_t)D);
        pv_acc(v_cache, off, n, D, scores, pg + 2);
    }
}

// Causal attention of every query token over its sequence's paged context. q [T, H, D] and
// out [T, H, D] with row strides in floats (heads at stride D); sequence b owns tokens
// query_start_loc[b] .. query_start_loc[b+1] - 1, the last of its seq_lens[b] context
// tokens. Returns 0, or -1 out of memory.
int tl_paged_attention(const float *q, long q_stride, float *out, long out_stride, const float *k_cache,
                       const float *v_cache, const int32_t *query_start_loc, const int32_t *seq_lens,
                       const int32_t *block_tables, long bt_stride, int B, int H, int kv_heads, int D,
                       int block_size, float scale, int nthreads) {
    const int T = query_start_loc[B];
    const int group = H / kv_heads;
    const size_t kv_row = (size_t)kv_heads * D, part_len = (size_t)D + 2;
    // token t: sequence seq[t], context ctx[t], chunks first[t] .. first[t + 1] - 1 (per KV head)
    int *seq = (int *)malloc(sizeof(int) * ((size_t)T + 1) * 3);
    if (!seq) return -1;
    int *ctx = seq + T + 1, *first = ctx + T + 1;
    first[0] = 0;
    for (int b = 0; b < B; b++)
        for (int t = query_start_loc[b]; t < query_start_loc[b + 1]; t++) {
            seq[t] = b;
            ctx[t] = seq_lens[b] - (query_start_loc[b + 1] - 1 - t);  // causal: up to itself
            first[t + 1] = first[t] + (ctx[t] + ATT_CHUNK - 1) / ATT_CHUNK;
        }
    const long chunks = first[T];
    float *parts = (float *)malloc(sizeof(float) * ((size_t)chunks * kv_heads * group * part_len + 1));
    if (!parts) {
        free(seq);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = (float *)malloc(sizeof(float) * ATT_CHUNK);
        size_t *off = (size_t *)malloc(sizeof(size_t) * ATT_CHUNK);
        if (!scores || !off) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < chunks * kv_heads; item++) {
            if (!scores || !off) continue;
            const long chunk = item / kv_heads;
            const int kvh = (int)(item % kv_heads);
            int lo = 0, hi = T - 1;  // the token of this chunk: first[t] <= chunk < first[t + 1]
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (first[mid] <= chunk) lo = mid; else hi = mid - 1;
            }
            const int t = lo;
            const int j0 = (int)(chunk - first[t]) * ATT_CHUNK;
            const int n = ctx[t] - j0 < ATT_CHUNK ? ctx[t] - j0 : ATT_CHUNK;
            const int32_t *table = block_tables + (size_t)seq[t] * bt_stride;
            for (int j = 0, blk = j0 / block_size, slot = j0 % block_size; j < n; j++) {  // no division per row
                off[j] = ((size_t)table[blk] * block_size + slot) * kv_row + (size_t)kvh * D;
                if (++slot == block_size) slot = 0, blk++;
            }
            const float *qh = q + t * q_stride + (size_t)kvh * group * D;
            float *part = parts + (size_t)item * group * part_len;
            if (D == 64)
                attend_chunk(qh, group, 64, scale, k_cache, v_cache, off, n, scores, part);
            else if (D == 128)
                attend_chunk(qh, group, 128, scale, k_cache, v_cache, off, n, scores, part);
            else
                attend_chunk(qh, group, D, scale, k_cache, v_cache, off, n, scores, part);
        }
        // (implicit barrier: every chunk is done) each (token, head)'s chunks combined in order
#pragma omp for schedule(static)
        for (long th = 0; th < (long)T * H; th++) {
            const int t = (int)(th / H), h = (int)(th % H), kvh = h / group, g = h % group;
            const int nc = first[t + 1] - first[t];
            const size_t stride = (size_t)kv_heads * group * part_len;  // one chunk of t to the next
            const float *p0 = parts + ((size_t)first[t] * kv_heads + kvh) * group * part_len + g * part_len;
            float mx = p0[0];
            for (int c = 1; c < nc; c++) mx = p0[c * stride] > mx ? p0[c * stride] : mx;
            float total = 0.0f;
            float *o = out + t * out_stride + (size_t)h * D;
            memset(o, 0, sizeof(float) * (size_t)D);
            for (int c = 0; c < nc; c++) {
                const float *pc = p0 + c * stride;
                const float w = expf(pc[0] - mx);
                total += pc[1] * w;
                const __m256 wv = _mm256_set1_ps(w);
                for (int i = 0; i < D; i += 8)
                    _mm256_storeu_ps(o + i, _mm256_fmadd_ps(_mm256_loadu_ps(pc + 2 + i), wv, _mm256_loadu_ps(o + i)));
            }
            const __m256 inv = _mm256_set1_ps(1.0f / total);
            for (int i = 0; i < D; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), inv));
        }
        free(scores);
        free(off);
    }
    free(parts);
    free(seq);
    return failed ? -1 : 0;
}

// ---- one Llama decoder layer in one call ------------------------------------------------------

typedef struct {
    const void *w;  // Q4 nibbles or Q8 int8, in tiles (see linear())
    const uint16_t *d, *m;  // float16; m: Q4 only
    const float *bias;  // may be NULL
    int q8, n, k;
} tl_proj;

typedef struct {
    tl_proj qkv, o, gate_up, down;
    const float *in_norm, *post_norm;
    float eps, scale;
    int hidden, heads, kv_heads, head_dim, inter;
} tl_layer;

typedef struct {
    int T, B, block_size;
    long bt_stride;
    const int64_t *positions, *slot_mapping;
    const float *cos_sin;
    const int32_t *query_start_loc, *seq_lens, *block_tables;
    float *x, *qkv, *attn, *gate_up, *act;  // scratch: [T, hidden], [T, qkv], [T, heads*D], [T, 2I], [T, I]
} tl_step;

static int proj(const tl_proj *p, const float *x, int M, float *y, int nthreads) {
    return linear(x, M, p->k, p->n, (const uint8_t *)p->w, p->d, p->q8 ? NULL : p->m, p->bias, y, nthreads, p->q8);
}

// LlamaDecoderLayer.forward on float32 rows: (h, residual) -> (mlp output in h, residual).
// first: residual is not yet set (the first layer): residual = h.
int tl_llama_layer(const tl_layer *L, const tl_step *S, float *k_cache, float *v_cache, float *h, float *residual,
                   int first, int nthreads) {
    const int T = S->T, D = L->head_dim, q_dim = L->heads * D, kv_dim = L->kv_heads * D;
    const long qkv_stride = q_dim + 2 * kv_dim;
    tl_add_rms_norm(h, first ? NULL : residual, L->in_norm, L->eps, T, L->hidden, S->x, residual, nthreads);
    if (proj(&L->qkv, S->x, T, S->qkv, nthreads)) return -1;
    tl_rotary(S->qkv, T, L->heads + L->kv_heads, D, qkv_stride, S->positions, S->cos_sin, nthreads);
    tl_kv_write(S->qkv + q_dim, qkv_stride, S->qkv + q_dim + kv_dim, qkv_stride, T, L->kv_heads, D, S->slot_mapping,
                k_cache, v_cache);
    if (tl_paged_attention(S->qkv, qkv_stride, S->attn, q_dim, k_cache, v_cache, S->query_start_loc, S->seq_lens,
                           S->block_tables, S->bt_stride, S->B, L->heads, L->kv_heads, D, S->block_size, L->scale,
                           nthreads))
        return -1;
    if (proj(&L->o, S->attn, T, h, nthreads)) return -1;
    tl_add_rms_norm(h, residual, L->post_norm, L->eps, T, L->hidden, S->x, residual, nthreads);
    if (proj(&L->gate_up, S->x, T, S->gate_up, nthreads)) return -1;
    tl_silu_and_mul(S->gate_up, T, L->inter, S->act, nthreads);
    return proj(&L->down, S->act, T, h, nthreads);
}
