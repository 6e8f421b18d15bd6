// Linear layers over GGUF's 5- and 6-bit and K-quant block formats (included by kernels.c after
// the Q4/Q8 kernels, in both builds): Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. (Q4_0, Q4_1 and Q8_0 run on
// the Q4/Q8 kernels: Q4_0 is Q4_1 with m = -8 d.)
//
// The file's integer codes and scales are kept; only their order changes (tallow/models/
// gguf_linear.py repacks at load). Weights are in tiles of GT = 16 output channels in both
// builds (the last tile padded with zero channels); for tile t and sub-block b of 32 inputs:
//   nib  256 bytes: the codes' low 4 bits, linear_avx512.h's Q4 order: 8 groups of 32 bytes,
//        group g's byte 2c + e = q(c, 4g + e) & 15 | (q(c, 4g + 2 + e) & 15) << 4;
//   then `planes` (0, 1 or 2) bit planes of 64 bytes each, holding bit 4 + p of every code, in
//        one of two orders (the build's, tl_gguf_plane_layout):
//        words (AVX-512, GGUF_PLANE_LANES 0): 16 uint32, word j's bit 2c + e = bit 4 + p of q(c, 2j + e);
//        lanes (AVX2, GGUF_PLANE_LANES 1): 32 uint16, lane 2c + e's bit j = the same bit, so
//        pair vector j's bits are one shift and one mask of a loaded vector (words needed a
//        broadcast, a byte shuffle, a compare and two masks per half: Q6_K ran at half Q4_K's
//        rate on Zen 3).
// So a block is 256, 320 or 384 bytes for 512 weights: 4, 5 or 6 bits per weight, as in the file.
// Widened to int16, pair vector j (j = 0..15) holds (q(c, 2j), q(c, 2j + 1)) - zero in the
// 32-bit lane of channel c, zero = 16 (Q5_0), 32 (Q6_K) or 0.
//
// Scales, float16 unless said otherwise, channels side by side:
//   Q5_0: d [tiles][nb][GT]                    w = d * (q - 16)
//   Q5_1: d, m [tiles][nb][GT]                 w = d * q + m
//   Q4_K, Q5_K: d, dmin [tiles][nb/8][GT]; sc, mn uint8 [tiles][nb][GT] (the 6-bit scales and
//         mins unpacked)                       w = (d * sc) * q - dmin * mn
//   Q6_K: d [tiles][nb/8][GT]; sc int8 [tiles][nb][2][GT] (one per 16 inputs)
//                                              w = (d * sc) * (q - 32)
// The integer dot product of a sub-block (Q6_K: of each half of 16) with the int16 activations
// (quantize_rows, natural order) is exact in int32 (|sum| < 2^26). Per output channel the
// float math then runs in this fixed order, block by block:
//   acc = fma(float(isum), dw * dx, acc)     dw = d (Q5_x) or d * sc (K: exact in float)
//   acc = fma(float(isum1), dw1 * dx, acc)   Q6_K's second half
//   acc = fma(mw, sx, acc)                   mw = m or -(dmin * mn); sx = dx * sum(q_x)
// whatever the rows around it and the threads (threads split the tiles), so a row's result does
// not depend on the batch, and both builds compute the same floats (lanes are channels in both).

#define GT 16
#define GCHUNK 64
// Up to this many rows, each row runs alone through gguf_gemv1 (AVX2: unpack fused with the
// products). Measured on Zen 3 against the many-row loop (gguf_rows, 2-3 rows per pass over an
// unpacked block; stop 32): Q6_K at 2 rows 1.07-1.14x faster alone, Q4_K and the 5-bit formats
// level at 2 rows and 1.1-1.2x slower alone from 3; AVX-512: 1 row.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GGUF_ROW1_MAX(planes) 1
#define GGUF_PLANE_LANES 0
#else
#define GGUF_ROW1_MAX(planes) ((planes) == 2 ? 2 : 1)
#define GGUF_PLANE_LANES 1
#endif

enum { TL_Q5_0 = 0, TL_Q5_1 = 1, TL_Q4_K = 2, TL_Q5_K = 3, TL_Q6_K = 4 };

static inline int gguf_planes(int fmt) { return fmt == TL_Q6_K ? 2 : fmt == TL_Q4_K ? 0 : 1; }
static inline int gguf_zero(int fmt) { return fmt == TL_Q5_0 ? 16 : fmt == TL_Q6_K ? 32 : 0; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

typedef struct {
    __m512i w[16];
} gblock;

static inline __attribute__((always_inline)) void gguf_unpack(const uint8_t *blk, int planes, int zero, gblock *W) {
    const __m512i lo = _mm512_set1_epi16(0x0F), z = _mm512_set1_epi16((short)zero);
    for (int g = 0; g < 8; g++) {
        const __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 * g)));
        W->w[2 * g] = _mm512_and_si512(t, lo);
        W->w[2 * g + 1] = _mm512_srli_epi16(t, 4);
    }
    const uint32_t *pl = (const uint32_t *)(blk + 256);
    for (int p = 0; p < planes; p++) {
        const __m512i bit = _mm512_set1_epi16((short)(16 << p));
        for (int j = 0; j < 16; j++)
            W->w[j] = _mm512_mask_add_epi16(W->w[j], _cvtu32_mask32(pl[16 * p + j]), W->w[j], bit);
    }
    if (zero)
        for (int j = 0; j < 16; j++) W->w[j] = _mm512_sub_epi16(W->w[j], z);
}

// One row through a block: the block's integer dot products with the row's 32 activations per
// channel (Q6_K: one per half of 16), then the float scale math of the top of this file on the
// GT channels' accumulators acc (dw0, dw1, mw: the block's float scales per channel).
static inline __attribute__((always_inline)) void gguf_row(const gblock *W, const int16_t *xb, float dx, float sx,
                                                            const float *dw0, const float *dw1, const float *mw,
                                                            int halves, int has_m, float *acc) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
        a0 = dpwssd_bcast(a0, W->w[j], xb + 2 * j);
        a1 = dpwssd_bcast(a1, W->w[j + 1], xb + 2 * j + 2);
        b0 = dpwssd_bcast(b0, W->w[j + 8], xb + 2 * j + 16);
        b1 = dpwssd_bcast(b1, W->w[j + 9], xb + 2 * j + 18);
    }
    const __m512i a = _mm512_add_epi32(a0, a1), b = _mm512_add_epi32(b0, b1);
    const __m512 dxv = _mm512_set1_ps(dx);
    __m512 acc_v = _mm512_loadu_ps(acc);
    if (halves) {
        acc_v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(_mm512_loadu_ps(dw0), dxv), acc_v);
        acc_v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_mul_ps(_mm512_loadu_ps(dw1), dxv), acc_v);
    } else {
        acc_v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, b)), _mm512_mul_ps(_mm512_loadu_ps(dw0), dxv),
                                acc_v);
    }
    if (has_m) acc_v = _mm512_fmadd_ps(_mm512_loadu_ps(mw), _mm512_set1_ps(sx), acc_v);
    _mm512_storeu_ps(acc, acc_v);
}


// R rows (row0 + i of r, accumulators acc + i * GT) through a block: gguf_row for each.
static inline __attribute__((always_inline)) void gguf_rows(const gblock *W, const qrows *r, size_t row0, int R, int K,
                                                             int b, const float *dw0, const float *dw1, const float *mw,
                                                             int halves, int has_m, float *acc) {
    const int nb = K / QK;
    for (int i = 0; i < R; i++) {
        const size_t row = row0 + (size_t)i;
        gguf_row(W, r->q + row * K + (size_t)b * QK, r->d[row * nb + b], r->s[row * nb + b], dw0, dw1, mw, halves,
                 has_m, acc + (size_t)i * GT);
    }
}

// One row against one block (M = 1): the unpack and the row as above.
static inline __attribute__((always_inline)) void gguf_row1(const uint8_t *blk, int planes, int zero,
                                                             const int16_t *xb, float dx, float sx, const float *dw0,
                                                             const float *dw1, const float *mw, int halves, int has_m,
                                                             float *acc) {
    gblock W;
    gguf_unpack(blk, planes, zero, &W);
    gguf_row(&W, xb, dx, sx, dw0, dw1, mw, halves, has_m, acc);
}

#else

typedef struct {
    __m256i w[2][16];  // channels 0..7, 8..15
} gblock;

// Plane p's bit for pair vector j, as a value: (bit j of each lane) << (4 + p), from the
// plane's half v (16 lanes: channels 8h..8h+7, lane 2c + e); one shift and one mask.
static inline __attribute__((always_inline)) __m256i plane_bits(__m256i v, int j, int p) {
    const int s = 4 + p - j;
    const __m256i t = s >= 0 ? _mm256_slli_epi16(v, s) : _mm256_srli_epi16(v, -s);
    return _mm256_and_si256(t, _mm256_set1_epi16((short)(16 << p)));
}

// The block's planes, half h of each in v[p][h] (channels 8h..8h+7). Where the zero point is the
// last plane's bit (Q5_0: 16, Q6_K: 32: `folded`), that plane is loaded inverted, so q - zero is
// formed as q_lo (+ 16 b4) - zero * (1 - b_last): no subtraction pass.
static inline __attribute__((always_inline)) int load_planes(const uint8_t *blk, int planes, int zero,
                                                             __m256i v[2][2]) {
    const int folded = planes > 0 && zero == 16 << (planes - 1);
    for (int p = 0; p < planes; p++)
        for (int h = 0; h < 2; h++) {
            v[p][h] = _mm256_loadu_si256((const __m256i *)(blk + 256 + 64 * p + 32 * h));
            if (folded && p == planes - 1) v[p][h] = _mm256_xor_si256(v[p][h], _mm256_set1_epi16(-1));
        }
    return folded;
}

// Pair vector j of half h, q - zero, from its low-nibble codes w and the planes (load_planes).
static inline __attribute__((always_inline)) __m256i with_planes(__m256i w, __m256i v[2][2], int h, int j, int planes,
                                                                 int zero, int folded) {
    for (int p = 0; p < planes; p++)
        w = folded && p == planes - 1 ? _mm256_sub_epi16(w, plane_bits(v[p][h], j, p))
                                      : _mm256_add_epi16(w, plane_bits(v[p][h], j, p));
    return zero && !folded ? _mm256_sub_epi16(w, _mm256_set1_epi16((short)zero)) : w;
}

// The many-row loop's unpack (planes and zero known only at run time there): the low nibbles,
// then each plane over them, the plane's loop innermost (faster here than with_planes per pair
// vector, which gguf_row1 uses with the format's constants).
static inline __attribute__((always_inline)) void gguf_unpack(const uint8_t *blk, int planes, int zero, gblock *W) {
    const __m256i lo = _mm256_set1_epi16(0x0F);
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 8; g++) {
            const __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * g + 16 * h)));
            W->w[h][2 * g] = _mm256_and_si256(t, lo);
            W->w[h][2 * g + 1] = _mm256_srli_epi16(t, 4);
        }
    __m256i v[2][2];
    const int folded = load_planes(blk, planes, zero, v);
    for (int p = 0; p < planes; p++) {
        const int last = folded && p == planes - 1;
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++)
                W->w[h][j] = last ? _mm256_sub_epi16(W->w[h][j], plane_bits(v[p][h], j, p))
                                  : _mm256_add_epi16(W->w[h][j], plane_bits(v[p][h], j, p));
    }
    if (zero && !folded)
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 16; j++) W->w[h][j] = _mm256_sub_epi16(W->w[h][j], _mm256_set1_epi16((short)zero));
}

// Channels 8h..8h+7 of a block's products (a: the first half-block's int32 sums, b: the second)
// into acc: gguf_rows' and gguf_row1's float step, one piece of code so both give the same floats.
static inline __attribute__((always_inline)) void gguf_half_out(__m256i a, __m256i b, int h, __m256 dxv, __m256 sxv,
                                                                 const float *dw0, const float *dw1, const float *mw,
                                                                 int halves, int has_m, float *acc) {
    __m256 acc_v = _mm256_loadu_ps(acc + 8 * h);
    if (halves) {
        acc_v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(_mm256_loadu_ps(dw0 + 8 * h), dxv), acc_v);
        acc_v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_mul_ps(_mm256_loadu_ps(dw1 + 8 * h), dxv), acc_v);
    } else {
        acc_v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(a, b)),
                                _mm256_mul_ps(_mm256_loadu_ps(dw0 + 8 * h), dxv), acc_v);
    }
    if (has_m) acc_v = _mm256_fmadd_ps(_mm256_loadu_ps(mw + 8 * h), sxv, acc_v);
    _mm256_storeu_ps(acc + 8 * h, acc_v);
}

// R rows (row0 + i of r, accumulators acc + i * GT) through an unpacked block together: each
// pair vector is loaded once for the R rows, and each row's activation pair broadcast once for
// both halves (a row at a time, the pair vectors were loaded R times and the row's 16
// broadcasts, kept for both halves, spilled). The int32 sums are exact (a block's in one
// accumulator where it has no halves, passed as a with b = 0), the float math gguf_half_out's:
// the floats of AVX-512's gguf_row. R <= 3 (Q6_K's halves: R <= 2).
static inline __attribute__((always_inline)) void gguf_rows(const gblock *W, const qrows *r, size_t row0, int R, int K,
                                                             int b, const float *dw0, const float *dw1, const float *mw,
                                                             int halves, int has_m, float *acc) {
    const int nb = K / QK;
    const int16_t *x = r->q + row0 * K + (size_t)b * QK;
    __m256i s[3][2], first[3][2];
    for (int i = 0; i < R; i++) s[i][0] = s[i][1] = first[i][0] = first[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        if (halves && j == 8)
            for (int i = 0; i < R; i++)
                first[i][0] = s[i][0], first[i][1] = s[i][1], s[i][0] = s[i][1] = _mm256_setzero_si256();
        __m256i bx[3];
        for (int i = 0; i < R; i++) bx[i] = pair_bcast(x + (size_t)i * K + 2 * j);
        for (int h = 0; h < 2; h++) {
            const __m256i w = _mm256_load_si256(&W->w[h][j]);
            for (int i = 0; i < R; i++) s[i][h] = _mm256_add_epi32(s[i][h], _mm256_madd_epi16(w, bx[i]));
        }
        for (int i = 0; i < R; i++) __asm__("" : "+x"(s[i][0]), "+x"(s[i][1]));  // kept in order: no spills
    }
    for (int i = 0; i < R; i++) {
        const size_t row = row0 + (size_t)i;
        const __m256 dxv = _mm256_set1_ps(r->d[row * nb + b]), sxv = _mm256_set1_ps(r->s[row * nb + b]);
        for (int h = 0; h < 2; h++)
            gguf_half_out(halves ? first[i][h] : s[i][h], halves ? s[i][h] : _mm256_setzero_si256(), h, dxv, sxv, dw0,
                          dw1, mw, halves, has_m, acc + (size_t)i * GT);
    }
}

// One row against one block (M = 1), unpack and products fused: AVX2 has 16 registers, so the
// 32 pair vectors of a whole gblock (and the row's 16 broadcasts) would live on the stack; here
// each pair vector is formed as in gguf_unpack and multiplied at once. The int32 sums are the
// same integers as gguf_unpack + gguf_rows' (exact), and the float math below is gguf_rows', so
// a row's result is the same float whichever path computes it.
static inline __attribute__((always_inline)) void gguf_row1(const uint8_t *blk, int planes, int zero,
                                                             const int16_t *xb, float dx, float sx, const float *dw0,
                                                             const float *dw1, const float *mw, int halves, int has_m,
                                                             float *acc) {
    const __m256i lo = _mm256_set1_epi16(0x0F);
    __m256i v[2][2];
    const int folded = load_planes(blk, planes, zero, v);
    __m256i s[2][2] = {{_mm256_setzero_si256(), _mm256_setzero_si256()},
                       {_mm256_setzero_si256(), _mm256_setzero_si256()}};  // [h][j >= 8]
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const __m256i x0 = pair_bcast(xb + 4 * g);
        const __m256i x1 = pair_bcast(xb + 4 * g + 2);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * g + 16 * h)));
            const __m256i w[2] = {with_planes(_mm256_and_si256(t, lo), v, h, 2 * g, planes, zero, folded),
                                  with_planes(_mm256_srli_epi16(t, 4), v, h, 2 * g + 1, planes, zero, folded)};
            s[h][g >= 4] = _mm256_add_epi32(s[h][g >= 4], _mm256_add_epi32(_mm256_madd_epi16(w[0], x0),
                                                                             _mm256_madd_epi16(w[1], x1)));
        }
    }
    const __m256 dxv = _mm256_set1_ps(dx), sxv = _mm256_set1_ps(sx);
    for (int h = 0; h < 2; h++) {
        gguf_half_out(s[h][0], s[h][1], h, dxv, sxv, dw0, dw1, mw, halves, has_m, acc);
    }
}

#endif

// The GT channels' float scales of block b of a tile: dw0 (and Q6_K's dw1), mw (has_m formats).
// Eight channels at a time (F16C conversions and float32 products, exact conversions and one
// rounding per product: the floats of a scalar loop, in both builds).
static inline __m256 u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline void gguf_block_scales(int fmt, int b, const uint16_t *d, const uint16_t *m, const uint8_t *sc,
                                     const uint8_t *mn, float *dw0, float *dw1, float *mw) {
    if (fmt == TL_Q5_0 || fmt == TL_Q5_1) {
        for (int c = 0; c < GT; c += 8) {
            _mm256_storeu_ps(dw0 + c, half8(d + GT * b + c));
            if (fmt == TL_Q5_1) _mm256_storeu_ps(mw + c, half8(m + GT * b + c));
        }
        return;
    }
    const int sb = b / 8;  // the super-block of 256
    if (fmt == TL_Q6_K) {
        const int8_t *s = (const int8_t *)sc + (size_t)2 * GT * b;
        for (int c = 0; c < GT; c += 8) {
            const __m256 dd = half8(d + GT * sb + c);
            _mm256_storeu_ps(dw0 + c, _mm256_mul_ps(dd, i8x8(s + c)));
            _mm256_storeu_ps(dw1 + c, _mm256_mul_ps(dd, i8x8(s + GT + c)));
        }
        return;
    }
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int c = 0; c < GT; c += 8) {  // Q4_K, Q5_K: dw0 = d * sc, mw = -(dmin * mn)
        _mm256_storeu_ps(dw0 + c, _mm256_mul_ps(half8(d + GT * sb + c), u8x8(sc + GT * b + c)));
        _mm256_storeu_ps(mw + c, _mm256_xor_ps(_mm256_mul_ps(half8(m + GT * sb + c), u8x8(mn + GT * b + c)), sign));
    }
}

// y[1, N] (M = 1): tl_gguf_linear's loop for one row, through gguf_row1 with the format's
// constants (one unrolled body per format), kept apart so the many-row loop compiles as before.
static inline __attribute__((always_inline)) void gguf_tile1(int fmt_planes, int fmt_zero, int halves, int has_m,
                                                              int fmt, int nb, const uint8_t *wt, size_t block_bytes,
                                                              const uint16_t *dt, const uint16_t *mt,
                                                              const uint8_t *sct, const uint8_t *mnt,
                                                              const qrows *r, float *acc) {
    for (int c = 0; c < GT; c++) acc[c] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = wt + (size_t)b * block_bytes;
        for (size_t p = 0; p < block_bytes; p += 64) _mm_prefetch((const char *)(wb + 12 * block_bytes + p), _MM_HINT_T0);
        float dw0[GT], dw1[GT], mw[GT];
        gguf_block_scales(fmt, b, dt, mt, sct, mnt, dw0, dw1, mw);
        gguf_row1(wb, fmt_planes, fmt_zero, r->q + (size_t)b * QK, r->d[b], r->s[b], dw0, dw1, mw, halves, has_m, acc);
    }
}

static __attribute__((noinline)) void gguf_gemv1(int K, int N, int fmt, const uint8_t *wq, const uint16_t *wd,
                                                 const uint16_t *wm, const uint8_t *wsc, const uint8_t *wmn,
                                                 const float *bias, float *y, int nthreads, const qrows *r) {
    const int nb = K / QK, tiles = (N + GT - 1) / GT;
    const int planes = gguf_planes(fmt), halves = fmt == TL_Q6_K, kq = fmt >= TL_Q4_K;
    const size_t block_bytes = 256 + (size_t)64 * planes, tile_bytes = (size_t)nb * block_bytes;
    const size_t d_per_tile = (size_t)(kq ? nb / 8 : nb) * GT;
    const size_t sc_per_tile = (size_t)nb * GT * (halves ? 2 : 1);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        float acc[GT] __attribute__((aligned(32)));
        const uint8_t *wt = wq + (size_t)t * tile_bytes;
        const uint16_t *dt = wd + (size_t)t * d_per_tile, *mt = wm ? wm + (size_t)t * d_per_tile : NULL;
        const uint8_t *sct = wsc ? wsc + (size_t)t * sc_per_tile : NULL;
        const uint8_t *mnt = wmn ? wmn + (size_t)t * nb * GT : NULL;
        switch (fmt) {  // planes, zero, halves, has_m as gguf_planes / gguf_zero / tl_gguf_linear
        case TL_Q4_K: gguf_tile1(0, 0, 0, 1, fmt, nb, wt, block_bytes, dt, mt, sct, mnt, r, acc); break;
        case TL_Q6_K: gguf_tile1(2, 32, 1, 0, fmt, nb, wt, block_bytes, dt, mt, sct, mnt, r, acc); break;
        case TL_Q5_K: gguf_tile1(1, 0, 0, 1, fmt, nb, wt, block_bytes, dt, mt, sct, mnt, r, acc); break;
        case TL_Q5_0: gguf_tile1(1, 16, 0, 0, fmt, nb, wt, block_bytes, dt, mt, sct, mnt, r, acc); break;
        default: gguf_tile1(1, 0, 0, 1, fmt, nb, wt, block_bytes, dt, mt, sct, mnt, r, acc); break;  // Q5_1
        }
        const int cols = N - t * GT < GT ? N - t * GT : GT;
        for (int c = 0; c < cols; c++) y[(size_t)t * GT + c] = bias ? acc[c] + bias[(size_t)t * GT + c] : acc[c];
    }
}

// y[M, N] = x[M, K] @ W^T (+ bias), W of format fmt in tiles (above); K % 32 == 0 (K formats:
// K % 256 == 0), tiles = ceil(N / GT). Returns 0, or -1 out of memory.
int tl_gguf_linear(const float *x, int M, int K, int N, int fmt, const uint8_t *wq, const uint16_t *wd,
                   const uint16_t *wm, const uint8_t *wsc, const uint8_t *wmn, const float *bias, float *y,
                   int nthreads) {
    const int nb = K / QK, tiles = (N + GT - 1) / GT, chunk = M < GCHUNK ? M : GCHUNK;
    const int planes = gguf_planes(fmt), zero = gguf_zero(fmt), halves = fmt == TL_Q6_K;
    const int has_m = fmt != TL_Q5_0 && fmt != TL_Q6_K, kq = fmt >= TL_Q4_K;
    const size_t block_bytes = 256 + (size_t)64 * planes, tile_bytes = (size_t)nb * block_bytes;
    const size_t d_per_tile = (size_t)(kq ? nb / 8 : nb) * GT;  // d (and m/dmin) entries per tile
    const size_t sc_per_tile = (size_t)nb * GT * (halves ? 2 : 1);
    qrows r;
    if (quantize_rows(x, M, K, nthreads, &r)) return -1;
    if (M <= GGUF_ROW1_MAX(planes)) {  // the same floats as the loop below, faster on AVX2 (gguf_row1)
        for (int m = 0; m < M; m++) {
            const qrows rm = {r.q + (size_t)m * K, r.d + (size_t)m * nb, r.s + (size_t)m * nb};
            gguf_gemv1(K, N, fmt, wq, wd, wm, wsc, wmn, bias, y + (size_t)m * N, nthreads, &rm);
        }
        free_rows(&r);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *acc = (float *)aligned_alloc(64, sizeof(float) * GT * (size_t)chunk);
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            if (!acc) continue;
            const uint8_t *wt = wq + (size_t)t * tile_bytes;
            const uint16_t *dt = wd + (size_t)t * d_per_tile, *mt = wm ? wm + (size_t)t * d_per_tile : NULL;
            const uint8_t *sct = wsc ? wsc + (size_t)t * sc_per_tile : NULL;
            const uint8_t *mnt = wmn ? wmn + (size_t)t * nb * GT : NULL;
            const int cols = N - t * GT < GT ? N - t * GT : GT;
            for (int m0 = 0; m0 < M; m0 += chunk) {
                const int rows = M - m0 < chunk ? M - m0 : chunk;
                memset(acc, 0, sizeof(float) * GT * (size_t)rows);
                for (int b = 0; b < nb; b++) {
                    const uint8_t *wb = wt + (size_t)b * block_bytes;
                    for (size_t p = 0; p < block_bytes; p += 64)
                        _mm_prefetch((const char *)(wb + 4 * block_bytes + p), _MM_HINT_T0);
                    gblock W;
                    gguf_unpack(wb, planes, zero, &W);
                    float dw0[GT], dw1[GT], mw[GT];
                    gguf_block_scales(fmt, b, dt, mt, sct, mnt, dw0, dw1, mw);
                    int i = 0;
                    if (halves)
                        for (; i + 2 <= rows; i += 2)
                            gguf_rows(&W, &r, (size_t)(m0 + i), 2, K, b, dw0, dw1, mw, 1, 0, acc + (size_t)i * GT);
                    else {
                        for (; i + 3 <= rows; i += 3)
                            gguf_rows(&W, &r, (size_t)(m0 + i), 3, K, b, dw0, dw1, mw, 0, has_m, acc + (size_t)i * GT);
                        if (rows - i == 2)
                            gguf_rows(&W, &r, (size_t)(m0 + i), 2, K, b, dw0, dw1, mw, 0, has_m, acc + (size_t)i * GT), i += 2;
                    }
                    for (; i < rows; i++)
                        gguf_rows(&W, &r, (size_t)(m0 + i), 1, K, b, dw0, dw1, mw, halves, has_m, acc + (size_t)i * GT);
                }
                for (int i = 0; i < rows; i++) {
                    float *yr = y + (size_t)(m0 + i) * N + (size_t)t * GT;
                    const float *a = acc + (size_t)i * GT;
                    for (int c = 0; c < cols; c++) yr[c] = bias ? a[c] + bias[(size_t)t * GT + c] : a[c];
                }
            }
        }
        free(acc);
    }
    free_rows(&r);
    return failed ? -1 : 0;
}

int tl_gguf_tile_channels(void) { return GT; }
int tl_gguf_plane_layout(void) { return GGUF_PLANE_LANES; }  // 1: lanes, 0: words (the top of this file)

// ---- repacking a GGUF tensor's blocks into the kernels' tiles (at load) -----------------------

// GGML type ids (gguf.constants.GGMLQuantizationType) of the block formats repacked here.
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
       GGML_Q6_K = 14 };

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

// Q4_K / Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes (get_scale_min_k4).
static inline void scale_min_k4(int j, const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The codes of one GGUF block (32 weights; the K formats: 256) as unsigned values q[] (Q8_0:
// int8 stored in uint8), and its float16 scale fields (d, m/dmin) as stored.
static void decode_block(int type, const uint8_t *blk, uint8_t *q, uint16_t *d, uint16_t *m) {
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const uint8_t *qs = blk + (type == GGML_Q4_0 ? 2 : 4);
        *d = rd16(blk);
        if (type == GGML_Q4_1) *m = rd16(blk + 2);
        for (int j = 0; j < 16; j++) q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4;
        break;
    }
    case GGML_Q5_0:
    case GGML_Q5_1: {
        const int off = type == GGML_Q5_0 ? 2 : 4;
        uint32_t qh;
        memcpy(&qh, blk + off, 4);
        const uint8_t *qs = blk + off + 4;
        *d = rd16(blk);
        if (type == GGML_Q5_1) *m = rd16(blk + 2);
        for (int j = 0; j < 16; j++) {
            q[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
            q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        }
        break;
    }
    case GGML_Q8_0:
        *d = rd16(blk);
        memcpy(q, blk + 2, 32);
        break;
    case GGML_Q4_K:
    case GGML_Q5_K: {
        *d = rd16(blk), *m = rd16(blk + 2);
        const uint8_t *qh = blk + 16, *qs = blk + (type == GGML_Q4_K ? 16 : 48);
        for (int i = 0; i < 8; i++)
            for (int l = 0; l < 32; l++) {
                uint8_t v = (qs[(i / 2) * 32 + l] >> ((i % 2) * 4)) & 15;
                if (type == GGML_Q5_K) v |= ((qh[l] >> i) & 1) << 4;
                q[i * 32 + l] = v;
            }
        break;
    }
    case GGML_Q6_K: {
        const uint8_t *ql = blk, *qh = blk + 128;
        *d = rd16(blk + 208);
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 128; r++)
                q[h * 128 + r] = ((ql[h * 64 + (r % 64)] >> (4 * (r / 64))) & 15) |
                                 (((qh[h * 32 + (r % 32)] >> (2 * (r / 32))) & 3) << 4);
        break;
    }
    }
}

static inline uint16_t half_times(uint16_t h, float f) { return _cvtss_sh(_cvtsh_ss(h) * f, 0); }

// A GGUF tensor's rows (raw: rows x cols weights in blocks of its type, rows back to back) into
// the tiles of `tile` output channels its kernel reads (all outputs zeroed by the caller, so
// padding channels are zero):
//   Q4_0, Q4_1 -> the Q4 layout of linear_avx512.h / linear_avx2.h (tiles of 16), Q4_0's
//     m = -8 d (exact in float16); Q8_0 -> the Q8 layout;
//   Q5_0, Q5_1, Q4_K, Q5_K, Q6_K -> this file's layout (tile 16), scales as listed at the top.
// Returns 0, or -1 for a type or tile it does not take.
int tl_gguf_repack(int type, const uint8_t *raw, int rows, int cols, int tile, uint8_t *wq, uint16_t *wd,
                   uint16_t *wm, uint8_t *wsc, uint8_t *wmn, int nthreads) {
    const int kq = type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
    const int q4 = type == GGML_Q4_0 || type == GGML_Q4_1, q8 = type == GGML_Q8_0;
    int block_bytes, fmt = -1;
    switch (type) {
    case GGML_Q4_0: block_bytes = 18; break;
    case GGML_Q4_1: block_bytes = 20; break;
    case GGML_Q5_0: block_bytes = 22, fmt = TL_Q5_0; break;
    case GGML_Q5_1: block_bytes = 24, fmt = TL_Q5_1; break;
    case GGML_Q8_0: block_bytes = 34; break;
    case GGML_Q4_K: block_bytes = 144, fmt = TL_Q4_K; break;
    case GGML_Q5_K: block_bytes = 176, fmt = TL_Q5_K; break;
    case GGML_Q6_K: block_bytes = 210, fmt = TL_Q6_K; break;
    default: return -1;
    }
    if ((q4 || q8) ? (tile != 4 && tile != 16) : tile != GT) return -1;
    const int per = kq ? 256 : 32, nblk = cols / per, nb = cols / QK, tiles = (rows + tile - 1) / tile;
    const size_t row_bytes = (size_t)nblk * block_bytes;
    const int planes = fmt >= 0 ? gguf_planes(fmt) : 0;
    const size_t gblock_bytes = 256 + (size_t)64 * planes;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        uint8_t q[256];
        for (int c = 0; c < tile && t * tile + c < rows; c++) {
            const uint8_t *src = raw + (size_t)(t * tile + c) * row_bytes;
            for (int k = 0; k < nblk; k++) {
                uint16_t d = 0, m = 0;
                decode_block(type, src + (size_t)k * block_bytes, q, &d, &m);
                if (q4 || q8) {  // one block of 32
                    const size_t tb = (size_t)t * nb + k;
                    wd[tb * tile + c] = d;
                    if (q4) wm[tb * tile + c] = type == GGML_Q4_1 ? m : half_times(d, -8.0f);
                    if (q4 && tile == 4) {
                        for (int j = 0; j < 16; j++) wq[(tb * 4 + c) * 16 + j] = q[j] | (q[j + 16] << 4);
                    } else if (q4) {
                        for (int g = 0; g < 8; g++)
                            for (int e = 0; e < 2; e++)
                                wq[tb * 256 + 32 * g + 2 * c + e] = q[4 * g + e] | (q[4 * g + 2 + e] << 4);
                    } else if (tile == 4) {
                        memcpy(wq + (tb * 4 + c) * 32, q, 32);
                    } else {
                        for (int j = 0; j < 16; j++)
                            for (int e = 0; e < 2; e++) wq[tb * 512 + 32 * j + 2 * c + e] = q[2 * j + e];
                    }
                    continue;
                }
                const int subs = per / QK;  // blocks of 32 in this GGUF block
                if (kq) {
                    const size_t sb = (size_t)t * (nb / 8) + k;
                    wd[sb * GT + c] = d;
                    if (type != GGML_Q6_K) wm[sb * GT + c] = m;
                }
                for (int s = 0; s < subs; s++) {
                    const int b = k * subs + s;
                    const size_t tb = (size_t)t * nb + b;
                    const uint8_t *qb = q + 32 * s;
                    uint8_t *blk = wq + tb * gblock_bytes;
                    for (int g = 0; g < 8; g++)
                        for (int e = 0; e < 2; e++)
                            blk[32 * g + 2 * c + e] = (qb[4 * g + e] & 15) | ((qb[4 * g + 2 + e] & 15) << 4);
                    for (int p = 0; p < planes; p++) {
                        for (int j = 0; j < 16; j++)
                            for (int e = 0; e < 2; e++) {
                                const int bit = (qb[2 * j + e] >> (4 + p)) & 1;
                                if (GGUF_PLANE_LANES)
                                    ((uint16_t *)(blk + 256 + 64 * p))[2 * c + e] |= (uint16_t)(bit << j);
                                else
                                    ((uint32_t *)(blk + 256) + 16 * p)[j] |= (uint32_t)bit << (2 * c + e);
                            }
                    }
                    if (type == GGML_Q5_0 || type == GGML_Q5_1) {
                        wd[tb * GT + c] = d;
                        if (type == GGML_Q5_1) wm[tb * GT + c] = m;
                    } else if (type == GGML_Q6_K) {
                        const int8_t *scales = (const int8_t *)(src + (size_t)k * block_bytes + 192);
                        wsc[(tb * 2 + 0) * GT + c] = (uint8_t)scales[2 * s];
                        wsc[(tb * 2 + 1) * GT + c] = (uint8_t)scales[2 * s + 1];
                    } else {
                        scale_min_k4(s, src + (size_t)k * block_bytes + 4, wsc + tb * GT + c, wmn + tb * GT + c);
                    }
                }
            }
        }
    }
    return 0;
}

// ---- float16 / bfloat16 weights (GGUF F16, BF16), kept as stored --------------------------------

static inline __m256 load8_half(const uint16_t *p, int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

// y[M, N] = x[M, K] @ W^T (+ bias), W [N, K] float16 (bf16: bfloat16) rows; K % 8 == 0. Each
// output is one dot product in float32 (two 8-lane FMA chains over K, summed in a fixed order),
// the same whatever the rows around it and the threads (threads split the channels).
int tl_half_linear(const float *x, int M, int K, int N, const uint16_t *w, int bf16, const float *bias, float *y,
                   int nthreads) {
    const int tiles = (N + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < tiles; t++) {  // 4 channels' rows stay in cache for every row of x
        const int n0 = t * 4, cols = N - n0 < 4 ? N - n0 : 4;
        for (int m = 0; m < M; m++) {
            const float *xr = x + (size_t)m * K;
            for (int c = 0; c < cols; c++) {
                const uint16_t *wr = w + (size_t)(n0 + c) * K;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
                int i = 0;
                for (; i + 16 <= K; i += 16) {
                    a0 = _mm256_fmadd_ps(load8_half(wr + i, bf16), _mm256_loadu_ps(xr + i), a0);
                    a1 = _mm256_fmadd_ps(load8_half(wr + i + 8, bf16), _mm256_loadu_ps(xr + i + 8), a1);
                }
                if (i < K) a0 = _mm256_fmadd_ps(load8_half(wr + i, bf16), _mm256_loadu_ps(xr + i), a0);
                const float s = hsum8(_mm256_add_ps(a0, a1));
                y[(size_t)m * N + n0 + c] = bias ? s + bias[n0 + c] : s;
            }
        }
    }
    return 0;
}
